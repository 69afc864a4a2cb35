"""``CPUOffloadingManager``: vLLM's CPU offloading manager on kvcache's Rust manager.

It subclasses both the Rust manager (first in the MRO, so calls go straight to Rust) and vLLM's
``OffloadingManager``, and returns vLLM's own result types, with the running vLLM release's
semantics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Self

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
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcache import _extra_config as settings
from kvcache._core import InvalidArgumentError
from kvcache._core import OffloadingManager as _RustManager
from kvcache.vllm._metrics import add_hint_counts
from kvcache.vllm._version import RUNNING_VLLM_SEMANTICS

logger = logging.getLogger("kvcache.vllm")


class _NotInThisRelease:
    """A method the running vLLM's manager protocol does not have: reading it raises
    ``AttributeError``, as on vLLM's own manager, so ``hasattr`` answers as it does there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        raise AttributeError(
            f"{(objtype or type(obj)).__name__!r} has no attribute {self.name!r} under vLLM "
            f"{RUNNING_VLLM_SEMANTICS} (vLLM {RUNNING_VLLM_SEMANTICS}'s manager has no {self.name})"
        )


class CPUOffloadingManager(_RustManager, OffloadingManager):
    """Drop-in for vLLM's ``CPUOffloadingManager``: same constructor, methods, decisions and
    result types; the bookkeeping runs in Rust, with the running vLLM release's semantics."""

    if not hasattr(_VllmManager, "touch"):
        touch = _NotInThisRelease()

    _result_types = SimpleNamespace(
        native=False,
        miss=LookupResult.MISS,
        hit=LookupResult.HIT,
        hit_pending=LookupResult.HIT_PENDING,
        spec_cls=CPULoadStoreSpec,
        output_cls=PrepareStoreOutput,
        event_cls=OffloadingEvent,
        event_takes_context="req_context" in OffloadingEvent.__dataclass_fields__,
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
    ) -> Self:
        # The Rust base reads a str subclass's characters, whatever its __eq__ answers; so
        # does this check.
        if isinstance(cache_policy, str) and str.__str__(cache_policy) == settings.OFFLINE_POLICY:
            # The Rust manager runs it for the replay, which tells it the future.
            raise InvalidArgumentError(settings.offline_policy_refusal("cache_policy"))
        # `info` is for __init__ (vLLM's config facts); the Rust base takes the rest.
        return super().__new__(
            cls,
            num_chunks,
            cache_policy,
            cache_policy_module_path,
            enable_events=enable_events,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            vllm_semantics=RUNNING_VLLM_SEMANTICS,
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
        usage, write_usage, read_usage, sizes, skipped, hints = self._take_stats()
        stats = OffloadingConnectorStats()
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        for size in sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write_usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, read_usage)
        if skipped is not None:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, skipped)
        add_hint_counts(stats, hints)
        return stats


def build_manager(
    spec: Any,
    ours: Callable[..., OffloadingManager],
    theirs: Callable[..., OffloadingManager],
    what: str,
    kwargs: dict[str, Any],
) -> OffloadingManager:
    """``ours`` (kvcache's Rust ``what``) running the spec's policy, or, for a policy kvcache
    does not have (``spec.policy_kind`` None: an out-of-tree Python class), ``theirs`` (vLLM's)
    running it, with one warning."""
    if spec.policy_kind is None:
        logger.warning(
            "kvcache's %s runs kvcache's policies only; policy %r from %r runs in vLLM's %s",
            what,
            spec.eviction_policy,
            spec.cache_policy_module_path,
            what,
        )
        return theirs(
            cache_policy=spec.eviction_policy,
            cache_policy_module_path=spec.cache_policy_module_path,
            **kwargs,
        )
    return ours(cache_policy=spec.policy_kind, cache_policy_module_path=None, **kwargs)
