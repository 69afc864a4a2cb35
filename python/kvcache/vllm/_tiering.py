"""vLLM's tiered offloading (0.33.0 and 0.34.0) with kvcache's Rust manager as the CPU
primary tier.

vLLM's ``TieringOffloadingSpec`` (``vllm/v1/kv_offload/tiering/``) puts secondary tiers
(``fs``, ``obj``, ``p2p``, out-of-tree ones) behind a CPU primary tier: its
``TieringOffloadingManager`` stores every chunk in the primary tier and cascades it to each
secondary tier, and promotes chunks found only in a secondary tier into the primary tier
before the GPU loads them. :class:`KvCacheTieringOffloadingSpec` keeps all of that vLLM's own
(the tiering manager, every tier, their I/O, NIXL, the shared host region the tiers read and
write) and replaces the primary tier's bookkeeping with kvcache's Rust manager
(:class:`CPUPrimaryTierOffloadingManager`): the same decisions, events, stats and chunk ids as
vLLM's ``CPUPrimaryTierOffloadingManager``, for kvcache's policies.

The primary tier's contract, beyond the GPU-facing manager protocol, as the tiering manager
uses it:

- ``prepare_read(keys, req_context)``: pin ready chunks for a cascade to a secondary tier,
  without recording an access of the request (tiering's own transfer, not a cache reuse);
  ``complete_read`` is ``complete_load``.
- ``prepare_write``/``complete_write``: ``prepare_store``/``complete_store`` of a promotion.
- ``defer_write_release(keys) -> chunk ids`` (0.34 only; 0.33 fails a promotion with
  ``complete_write(success=False)``, freeing its chunks at once): a failed promotion's keys
  leave the cache while the tier that was writing may still touch their chunks;
  ``release_deferred_write(ids)`` frees them later; ``num_deferred_release_chunks``;
  ``reset_cache`` is refused meanwhile.
- ``get_kv_memoryview()``: the shared host region (rows of chunks) the secondary tiers copy
  to and from; ``_num_chunks``; ``shutdown()`` releases the view and the region.

vLLM's tiering manager does not pass ``on_new_request`` on to its primary tier: kvcache's
primary tier reads a request's retention hint (``kvcache._hints``) from the context of the
first call that records the request (``prepare_store``, ``prepare_load``, a promotion's
``prepare_write``), before its keys reach the policy, and its hint counters travel in the
tiering manager's stats (the spec declares them).

Under vLLM 0.33 the manager follows 0.33's decisions (``touch``, ``on_store_miss``, stored
events), as everywhere in ``kvcache.vllm``.
"""

from __future__ import annotations

import logging
from typing import Any, Self

from vllm.v1.kv_offload.base import OffloadingManager, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager as _VllmPrimaryTier,
)
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvcache import _extra_config as settings
from kvcache.vllm._logging import route_to_vllm
from kvcache.vllm._manager import CPUOffloadingManager, build_manager
from kvcache.vllm._metrics import hint_metric_definitions
from kvcache.vllm._version import RUNNING_VLLM_SEMANTICS
from kvcache.vllm._worker import HostRegionView, build_worker
from kvcache.vllm._worker_settings import WorkerSettings

logger = logging.getLogger("kvcache.vllm")


class CPUPrimaryTierOffloadingManager(CPUOffloadingManager):
    """vLLM's CPU primary tier on kvcache's Rust manager (see the module docs): the
    constructor and methods of vLLM's ``CPUPrimaryTierOffloadingManager``."""

    def __new__(
        cls,
        num_chunks: int,
        mmap_region: Any,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        info: Any = None,
    ) -> Self:
        return super().__new__(
            cls, num_chunks, cache_policy, cache_policy_module_path, enable_events, info=info
        )

    def __init__(
        self,
        num_chunks: int,
        mmap_region: Any,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        info: Any = None,
    ) -> None:
        super().__init__(
            num_chunks, cache_policy, cache_policy_module_path, enable_events, info=info
        )
        self._mmap_region = mmap_region
        self._kv_memoryview: memoryview = mmap_region.create_kv_memoryview()

    # The secondary tier's view of the same operations (vLLM's aliases).
    complete_read = CPUOffloadingManager.complete_load
    prepare_write = CPUOffloadingManager.prepare_store
    complete_write = CPUOffloadingManager.complete_store

    @property
    def _num_chunks(self) -> int:
        return int(self.num_chunks)

    def get_kv_memoryview(self) -> memoryview:
        """The shared host region as ``(num_chunks, row bytes)``: chunk ``c`` is
        ``view[c]``."""
        return self._kv_memoryview

    def shutdown(self) -> None:
        super().shutdown()
        self._kv_memoryview.release()
        self._mmap_region.cleanup()


class KvCacheTieringOffloadingSpec(WorkerSettings, TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` (same keys: ``secondary_tiers``,
    ``tier_poll_interval_s``, ``backpressure``, ``cpu_bytes_to_use``, ``eviction_policy``)
    with kvcache's Rust manager as the CPU primary tier; every secondary tier and the tiering
    manager are vLLM's. The GPU worker follows the same rule as ``KvCacheOffloadingSpec``:
    vLLM's, unless ``"kvcache_worker": true`` (the default once kvcache's worker has passed a
    GPU run), in which case kvcache's worker moves the bytes directly in vLLM's shared host
    region, the rows the secondary tiers read and write."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """vLLM's tiering metrics (its tiers' included) and the retention-hint counters of
        kvcache's primary tier, which vLLM's tiering manager passes on from its stats."""
        return {**super().build_metric_definitions(extra_config), **hint_metric_definitions()}

    def __init__(self, config: OffloadingConfig) -> None:
        route_to_vllm()
        # As kvcache's CPU spec: checked before vLLM's spec reads them.
        settings.check_kvcache_keys(config.extra_config)
        settings.cpu_bytes(config.extra_config)
        # Refused here, not when the manager is built: vLLM's tiering spec would refuse it
        # from get_manager, after the spec was handed to the scheduler.
        self.store_threshold = settings.store_threshold(config.extra_config, tiering=True)
        super().__init__(config)
        # The worker settings and the policy are read exactly as kvcache's CPU spec reads them.
        self.read_worker_settings(self.extra_config)
        self.policy_kind = settings.policy_kind(
            self.eviction_policy, self.cache_policy_module_path, CachePolicyFactory._registry
        )

    def create_worker(self, kv_caches: Any) -> Any:
        """vLLM's worker, or kvcache's over vLLM's shared host region (see the class docs);
        one start-up line says which, and why."""
        reason = self.worker_unsupported(kv_caches)
        if reason is not None:
            worker: OffloadingWorker = super().create_worker(kv_caches)
            self._log_worker(f"vLLM's ({reason})")
            return worker
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        view = HostRegionView(
            # vLLM types it Optional; the constructor has just mapped it.
            buffer=memoryview(region.mmap_obj),  # type: ignore[arg-type]
            row_bytes=self.kv_bytes_per_chunk,
            slot_offset=rank * self.cpu_page_size_per_worker,
            release=region.cleanup,
        )
        try:
            worker, why = build_worker(
                kv_caches,
                lambda: TieringOffloadingSpec.create_worker(self, kv_caches),
                host_region=view,
                **self.worker_options(),
            )
        except BaseException:
            del view
            region.cleanup()
            raise
        where = "kvcache (in vLLM's shared host region)"
        self._log_worker(where if why is None else f"vLLM's ({why})")
        return worker

    def _log_worker(self, text: str) -> None:
        logger.info(
            "kvcache worker ready: vllm=%s tiering=vLLM's primary=%s worker=%s chunks=%d",
            RUNNING_VLLM_SEMANTICS,
            "kvcache (Rust)" if self.policy_kind is not None else "vLLM's",
            text,
            self.num_chunks,
        )

    def _primary_tier(self, region: SharedOffloadRegion) -> Any:
        kwargs = dict(
            num_chunks=self.num_chunks,
            enable_events=self.kv_events_config.enable_kv_cache_events,
            mmap_region=region,
            info=self.cpu_info,
        )
        return build_manager(
            self, CPUPrimaryTierOffloadingManager, _VllmPrimaryTier, "primary tier", kwargs
        )

    def get_manager(self) -> OffloadingManager:
        if self._manager is not None:
            return self._manager
        region: SharedOffloadRegion | None = None
        primary: Any = None
        tiers: list[Any] = []
        try:
            # The scheduler's mapping of the shared host region (rank None): the secondary
            # tiers copy chunks through it while the workers' mappings fill it from the GPU.
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=None,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._scheduler_mmap = region
            primary = self._primary_tier(region)
            view = primary.get_kv_memoryview()
            for tier_config in self.secondary_tier_configs:
                tiers.append(SecondaryTierFactory.create_secondary_tier(tier_config, view, self))
            self._manager = TieringOffloadingManager(
                primary_tier=primary,
                secondary_tiers=tiers,
                tier_poll_interval_s=self.tier_poll_interval_s,
            )
        except BaseException:
            _close_all(tiers, primary, region)
            self._scheduler_mmap = None
            raise
        logger.info(
            "kvcache manager ready: vllm=%s tiering=vLLM's primary=%s policy=%s "
            "secondary_tiers=[%s] chunks=%d",
            RUNNING_VLLM_SEMANTICS,
            "kvcache (Rust)" if self.policy_kind is not None else "vLLM's",
            self.policy_kind or self.eviction_policy,
            ", ".join(t.tier_type for t in tiers),
            self.num_chunks,
        )
        return self._manager


def _close_all(tiers: list[Any], primary: Any, region: Any) -> None:
    """Undoes a manager built part-way (tiers first, then the primary tier or its region)."""
    for tier in reversed(tiers):
        try:
            tier.shutdown()
        except Exception:
            logger.exception("shutting down a secondary tier after a failed start failed")
    try:
        if primary is not None:
            primary.shutdown()
        elif region is not None:
            region.cleanup()
    except Exception:
        logger.exception("releasing the primary tier after a failed start failed")
