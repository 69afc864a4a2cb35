"""``CPUOffloadingSpec`` (``KvCacheOffloadingSpec``): vLLM's CPU offloading spec with kvcache's
manager and worker."""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as _VllmManager
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as _VllmCPUOffloadingSpec

from kvcache import _extra_config as settings
from kvcache.vllm._logging import route_to_vllm
from kvcache.vllm._manager import CPUOffloadingManager, build_manager
from kvcache.vllm._metrics import hint_metric_definitions
from kvcache.vllm._policies import OUR_MODULES
from kvcache.vllm._version import RUNNING_VLLM_SEMANTICS
from kvcache.vllm._worker import CPUOffloadingWorker, build_worker
from kvcache.vllm._worker_settings import WORKER_DEFAULT_REASON, WorkerSettings

logger = logging.getLogger("kvcache.vllm")


class CPUOffloadingSpec(WorkerSettings, _VllmCPUOffloadingSpec):
    """vLLM's CPU offloading spec with kvcache's manager and worker.

    The manager: kvcache's Rust manager for ``lru``/``arc``/``turn`` (by either name); vLLM's
    manager only for an out-of-tree Python policy, decided from the policy name and module before
    anything is built. The worker: :class:`CPUOffloadingWorker` with ``"kvcache_worker": true``
    (or by default once ``WORKER_GPU_EVIDENCE`` names a passed GPU run), unless the
    configuration is one it does not support (replicated MLA layout, devices other than
    CUDA) or its start-up self-check fails; otherwise vLLM's worker, with the reason in the
    one start-up line. Bad settings raise (a ``KvCacheError`` subclass); nothing falls
    back silently.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """vLLM's CPU metrics and kvcache's retention-hint counters (``kvcache.vllm._metrics``),
        which vLLM's Prometheus layer refuses unless the spec declares them."""
        return {**super().build_metric_definitions(extra_config), **hint_metric_definitions()}

    def __init__(self, config: OffloadingConfig) -> None:
        route_to_vllm()  # vLLM may have configured its logging after this module was imported
        # Checked before vLLM's spec reads them: it would take `cpu_bytes_to_use` "64GiB" to
        # a bare ValueError and ignore a misspelled kvcache key.
        settings.check_kvcache_keys(config.extra_config)
        settings.cpu_bytes(config.extra_config)
        super().__init__(config)
        extra = self.extra_config
        self.read_worker_settings(extra)
        self._read_policy()
        self.store_threshold = settings.store_threshold(extra, tiering=False)
        self.max_tracker_size = settings.max_tracker_size(extra)

    def _read_policy(self) -> None:
        """``eviction_policy`` and ``cache_policy_module_path``: which policy runs, and whose
        manager runs it (``policy_kind`` None: vLLM's); a policy no manager could run is
        refused here rather than by vLLM's factory when the manager is built."""
        self.policy_kind = settings.policy_kind(
            self.eviction_policy, self.cache_policy_module_path, CachePolicyFactory._registry
        )
        if (
            self.cache_policy_module_path in OUR_MODULES[1:]
            and self.eviction_policy in CachePolicyFactory._registry
        ):
            logger.warning(
                "eviction_policy %r with cache_policy_module_path %r: kvcache runs its Rust %s "
                "here (spec %s), but under vLLM's own spec vLLM resolves %r to its Python class "
                "first and never loads kvcache. Use %r to make the policy choice unambiguous.",
                self.eviction_policy,
                self.cache_policy_module_path,
                self.policy_kind,
                type(self).__name__,
                self.eviction_policy,
                f"{self.eviction_policy.upper()}CachePolicy",
            )

    def manager_description(self) -> str:
        if self.policy_kind is None:
            return (
                f"vLLM's (out-of-tree policy {self.eviction_policy!r} from "
                f"{self.cache_policy_module_path!r})"
            )
        return "kvcache (Rust)"

    def get_manager(self) -> OffloadingManager:
        if self._manager is not None:
            return self._manager
        kwargs: dict[str, Any] = dict(
            num_chunks=self.num_chunks,
            enable_events=self.kv_events_config.enable_kv_cache_events,
            store_threshold=self.store_threshold,
            max_tracker_size=self.max_tracker_size,
            info=self.cpu_info,
        )
        self._manager = build_manager(self, CPUOffloadingManager, _VllmManager, "manager", kwargs)
        self._announce("manager", None)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is not None:
            return self._worker
        reason = self.worker_unsupported(kv_caches)
        if reason is not None:
            worker = super().get_worker(kv_caches)
        else:
            worker, reason = build_worker(
                kv_caches, functools.partial(super().get_worker, kv_caches), **self.worker_options()
            )
            if reason is None:
                self._worker = worker  # type: ignore[assignment]
        self._announce("worker", reason)
        return worker

    def _announce(self, built: str, worker_reason: str | None) -> None:
        """The one start-up line: what runs, with the pool and copy settings."""
        worker = self._worker
        if isinstance(worker, CPUOffloadingWorker):
            d = worker.describe()
            worker_text = f"kvcache ({d['backend']}"
            if d["backend"] == "cuda":
                worker_text += f", DMA {d['dma']}"
            worker_text += ")"
            pool = (
                f"{d['pool_bytes'] / 2**30:.2f} GiB on rank {self.config.parallel.rank} "
                f"({d['num_chunks']} chunks of {d['chunk_bytes']} B)"
            )
            pinned = d["pinned"]
            cutoff_bytes = d.get("kernel_max_run_bytes")
            cutoff = (
                "n/a"
                if cutoff_bytes is None
                else f"{cutoff_bytes // 1024} KiB"
                + (" (calibrated)" if d.get("calibrated") else "")
            )
        else:
            if worker is not None:
                worker_text = f"vLLM's ({worker_reason})"
            elif self.use_kvcache_worker:
                worker_text = "kvcache (built on the worker side)"
            elif self.worker_setting is None:
                worker_text = f"vLLM's ({WORKER_DEFAULT_REASON})"
            else:
                worker_text = "vLLM's (kvcache_worker is false)"
            pool = (
                f"{self.num_chunks} chunks, {self.num_chunks * self.kv_bytes_per_chunk / 2**30:.2f}"
                " GiB across ranks"
            )
            pinned = "n/a" if worker is None else "vLLM's"
            cutoff = "n/a"
        logger.info(
            "kvcache %s ready: vllm=%s manager=%s policy=%s worker=%s pool=%s pinned=%s "
            "load kernel/DMA cut-off=%s",
            built,
            RUNNING_VLLM_SEMANTICS,
            self.manager_description(),
            self.policy_kind or self.eviction_policy,
            worker_text,
            pool,
            pinned,
            cutoff,
        )


#: The name to give vLLM's ``OffloadingSpecFactory`` (``spec_name``): ``CPUOffloadingSpec``
#: itself is registered to vLLM's spec, which the factory would pick instead.
KvCacheOffloadingSpec = CPUOffloadingSpec
