"""The adapter vLLM 0.33.0 loads by configuration.

Policies only (vLLM's manager, our policies)::

    kv_connector_extra_config = {
        "eviction_policy": "ARCCachePolicy",  # or "LRUCachePolicy"
        "cache_policy_module_path": "kvcache.vllm",
    }

Our manager and policies (vLLM's worker is kept)::

    kv_connector_extra_config = {
        "spec_name": "KvCacheOffloadingSpec",
        "spec_module_path": "kvcache.vllm",
        "eviction_policy": "arc",  # or "lru"
    }

(vLLM's ``OffloadingSpecFactory`` resolves a registered name before any module path, and
``CPUOffloadingSpec`` is registered to vLLM's own spec: hence the distinct name
``KvCacheOffloadingSpec``, an alias of ``kvcache.vllm.CPUOffloadingSpec``.)

vLLM's ``CachePolicyFactory`` asserts a policy class subclasses its ``CachePolicy``: the Rust
classes are registered as *virtual* subclasses (``CachePolicy.register``), which satisfies
``issubclass`` without a Python class in front of the Rust methods. ``CPUOffloadingManager``
subclasses both the Rust manager (first in the MRO, so calls go straight to Rust) and vLLM's
``OffloadingManager`` (for its defaults: ``lock``, ``on_schedule_end`` …), and returns vLLM's
own result types. Importing this module imports vLLM; ``import kvcache`` does not.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as _VllmManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy as _VllmCachePolicy
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as _VllmCPUOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcache._core import ARCCachePolicy, LRUCachePolicy
from kvcache._core import OffloadingManager as _RustManager

__all__ = [
    "ARCCachePolicy",
    "CPUOffloadingManager",
    "CPUOffloadingSpec",
    "KvCacheOffloadingSpec",
    "LRUCachePolicy",
]

logger = logging.getLogger(__name__)

_VllmCachePolicy.register(LRUCachePolicy)
_VllmCachePolicy.register(ARCCachePolicy)


class CPUOffloadingManager(_RustManager, OffloadingManager):
    """Drop-in for vLLM's ``CPUOffloadingManager``: same constructor, methods, decisions and
    result types; the bookkeeping runs in Rust."""

    _result_types = SimpleNamespace(
        native=False,
        miss=LookupResult.MISS,
        hit=LookupResult.HIT,
        hit_pending=LookupResult.HIT_PENDING,
        spec_cls=CPULoadStoreSpec,
        output_cls=PrepareStoreOutput,
        event_cls=OffloadingEvent,
        medium=Medium.CPU,
        new_request=RequestOffloadingContext,
    )

    def __new__(
        cls,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: Any = None,
    ) -> CPUOffloadingManager:
        # `info` is for __init__ (vLLM's config facts); the Rust base takes the rest.
        return super().__new__(
            cls,
            num_chunks,
            cache_policy,
            cache_policy_module_path,
            enable_events=enable_events,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
        )

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: Any = None,
    ) -> None:
        # The Rust base was built by __new__ from the same arguments.
        self.medium = Medium.CPU
        self._config_info = info.as_config_info() if info is not None else {}

    def get_load_source(self, key: bytes, req_context: Any) -> CacheHitSource:
        return CacheHitSource.HOST

    def config_info(self) -> list[Any]:
        return [self._config_info]

    def get_stats(self) -> OffloadingConnectorStats:
        usage, write_usage, read_usage, sizes, skipped = self._take_stats()
        stats = OffloadingConnectorStats()
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        for size in sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write_usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, read_usage)
        if skipped is not None:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, skipped)
        return stats


class CPUOffloadingSpec(_VllmCPUOffloadingSpec):
    """vLLM's CPU offloading spec (and worker) with kvcache's manager.

    Policies the Rust manager does not run (an out-of-tree Python policy) fall back to vLLM's
    manager, with a warning.
    """

    def get_manager(self) -> OffloadingManager:
        if self._manager is not None:
            return self._manager
        kwargs = dict(
            num_chunks=self.num_chunks,
            cache_policy=self.eviction_policy,
            cache_policy_module_path=self.cache_policy_module_path,
            enable_events=self.kv_events_config.enable_kv_cache_events,
            store_threshold=int(self.extra_config.get("store_threshold", 0)),
            max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
            info=self.cpu_info,
        )
        try:
            self._manager = CPUOffloadingManager(**kwargs)
        except ValueError as exc:
            logger.warning("kvcache cannot run this policy (%s); using vLLM's manager", exc)
            self._manager = _VllmManager(**kwargs)
        return self._manager


#: The name to give vLLM's ``OffloadingSpecFactory`` (``spec_name``): ``CPUOffloadingSpec``
#: itself is registered to vLLM's spec, which the factory would pick instead.
KvCacheOffloadingSpec = CPUOffloadingSpec
