"""The adapter vLLM 0.33.0 loads by configuration.

kvcache's manager and policies, with vLLM's own worker moving the bytes (kvcache's worker is
one setting away, ``"kvcache_worker": True``; it becomes the default once it has passed a GPU
run, see ``WORKER_GPU_EVIDENCE``)::

    kv_connector_extra_config = {
        "spec_name": "KvCacheOffloadingSpec",
        "spec_module_path": "kvcache.vllm",
        "eviction_policy": "turn",  # or "arc", "lru"; their class names alike
        "cpu_bytes_to_use": 64 << 30,
    }

(vLLM's ``OffloadingSpecFactory`` resolves a registered name before any module path, and
``CPUOffloadingSpec`` is registered to vLLM's spec: hence the distinct name
``KvCacheOffloadingSpec``, an alias of ``kvcache.vllm.CPUOffloadingSpec``.)

Policies only (vLLM's manager and worker, our policies): the policy must be named by its class
name, because vLLM's ``CachePolicyFactory`` resolves the registered names ``lru``/``arc`` to its
own Python classes *before* looking at the module path::

    kv_connector_extra_config = {
        "eviction_policy": "ARCCachePolicy",  # NOT "arc": that silently runs vLLM's ARC
        "cache_policy_module_path": "kvcache.vllm",  # or "kvcache" (see kvcache.__getattr__)
    }

Every key kvcache's specs read is checked when vLLM builds the spec (``kvcache._extra_config``);
``kvcache check-config`` shows what a configuration builds without a GPU.

Switches (``kv_connector_extra_config``), all optional:

- ``"kvcache_worker"``: ``true`` moves the bytes with kvcache's worker, ``false`` with vLLM's;
  default: vLLM's until kvcache's worker has passed a GPU run (``WORKER_GPU_EVIDENCE``).
- ``"kvcache_pin"``: ``"background"`` (default: start at once, pin in pieces on a thread of
  its own), ``"blocking"`` (pin before the worker starts) or ``"off"`` (pageable).
- ``"kvcache_copy"``: ``"auto"`` (default), ``"dma"`` or ``"kernel"`` (loads; stores use DMA).
- ``"kvcache_kernel_max_run_bytes"``: the kernel/DMA cut-off for loads in bytes (0: DMA only);
  default: calibrated per device at start-up.

Importing this module imports vLLM (and refuses a release other than 0.33.0 unless
``KVCACHE_ALLOW_UNTESTED_VLLM=1``); ``import kvcache`` does not. vLLM's ``CachePolicyFactory``
asserts a policy class subclasses its ``CachePolicy``: the Rust classes are registered as
*virtual* subclasses (``CachePolicy.register``). ``CPUOffloadingManager`` subclasses both the
Rust manager (first in the MRO, so calls go straight to Rust) and vLLM's ``OffloadingManager``,
and returns vLLM's own result types.
"""

from __future__ import annotations

import functools
import logging
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from kvcache.vllm._version import (  # first: refuses an untested vLLM before importing it
    ALLOW_UNTESTED_ENV,
    TESTED_VLLM_VERSIONS,
    VLLM_SEMANTICS,
    UnsupportedVersionError,
)

# isort: split
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingWorker,
    PrepareStoreOutput,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as _VllmManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy as _VllmCachePolicy
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as _VllmCPUOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcache import _extra_config as settings
from kvcache._core import POLICY_KINDS, InvalidArgumentError, InvalidTypeError
from kvcache._core import OffloadingManager as _RustManager
from kvcache.vllm._logging import route_to_vllm
from kvcache.vllm._metrics import add_hint_counts, hint_metric_definitions
from kvcache.vllm._worker import CPUOffloadingWorker, build_worker

if TYPE_CHECKING:  # at run time served by ``__getattr__`` below
    from kvcache._core import ARCCachePolicy, LRUCachePolicy, TurnCachePolicy

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "TESTED_VLLM_VERSIONS",
    "VLLM_SEMANTICS",
    "ARCCachePolicy",
    "CPUOffloadingManager",
    "CPUOffloadingSpec",
    "CPUOffloadingWorker",
    "KvCacheOffloadingSpec",
    "KvCacheTieringOffloadingSpec",
    "LRUCachePolicy",
    "TurnCachePolicy",
    "UnsupportedVersionError",
    "rust_policy",
]

logger = logging.getLogger(__name__)

# Every Rust policy class is a vLLM ``CachePolicy`` and is found here by vLLM's class name
# (``cache_policy_module_path="kvcache.vllm"``); the list comes from the Rust core.
_POLICY_CLASSES = {cls.__name__: cls for cls in POLICY_KINDS.values()}
for _policy_cls in _POLICY_CLASSES.values():
    _VllmCachePolicy.register(_policy_cls)

#: The module whose ``getattr`` means "vLLM's own manager is about to build this policy".
_VLLM_POLICY_FACTORY = CachePolicyFactory.__module__


def __getattr__(name: str) -> Any:
    # The policy classes are served from here rather than from the module's globals so that
    # the one case kvcache builds no spec or manager of its own (vLLM's manager, configured
    # with ``cache_policy_module_path="kvcache.vllm"``) still gets kvcache's start-up line.
    # vLLM's factory looks the class up with ``getattr`` right before it constructs it.
    if name not in _POLICY_CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if sys._getframe(1).f_globals.get("__name__") == _VLLM_POLICY_FACTORY:
        return policy_for_vllm_factory(name, __name__)
    return _POLICY_CLASSES[name]


def policy_for_vllm_factory(name: str, module: str) -> type:
    """Policy class ``name``, as vLLM's ``CachePolicyFactory`` loads it from ``module``
    (``cache_policy_module_path``), with kvcache's start-up line."""
    logger.info(
        "kvcache policy ready: manager=vLLM's policy=%s (kvcache, Rust, vLLM %s protocol) "
        "worker=vLLM's (loaded by vLLM's CachePolicyFactory from %s)",
        name,
        VLLM_SEMANTICS,
        module,
    )
    return _POLICY_CLASSES[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *_POLICY_CLASSES})


#: Policy names kvcache's Rust manager runs, by the name given in ``eviction_policy``.
RUST_POLICIES = settings.RUST_POLICIES
#: ``cache_policy_module_path`` values that mean "kvcache's policies" (or none given).
OUR_MODULES = settings.OUR_MODULES


def rust_policy(name: str, module_path: str | None) -> str | None:
    """``"lru"``/``"arc"`` when kvcache's Rust manager runs policy ``name`` from
    ``module_path``; None for an out-of-tree Python policy (vLLM's manager must run it).

    Broader than ``OffloadingManager(cache_policy=...)``, which follows vLLM's factory: with
    kvcache's module path a registered short name (``"arc"``) also means kvcache's policy here,
    and the spec warns about it (see ``KvCacheOffloadingSpec``)."""
    if module_path not in OUR_MODULES:
        return None
    return RUST_POLICIES.get(name)


class _NotInThisRelease:
    """A method the running vLLM's manager protocol does not have: reading it raises
    ``AttributeError``, as on vLLM's own manager, so ``hasattr`` answers as it does there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        raise AttributeError(
            f"{(objtype or type(obj)).__name__!r} has no attribute {self.name!r} under vLLM "
            f"{VLLM_SEMANTICS} (vLLM {VLLM_SEMANTICS}'s manager has no {self.name})"
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
    ) -> CPUOffloadingManager:
        if cache_policy == settings.OFFLINE_POLICY:
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
            vllm_semantics=VLLM_SEMANTICS,
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


#: The GPU run that made kvcache's worker the spec's default: the path, relative to the
#: repository, of a ``bench/gpu_check.py`` JSON whose every path passed on a GPU (see
#: docs/worker.md, "Which worker runs"). None: no GPU run has passed yet, so vLLM's own worker
#: moves the bytes unless ``"kvcache_worker": true``. Setting it is the whole switch;
#: ``tests/test_worker_default.py`` checks that the file it names passed.
WORKER_GPU_EVIDENCE: str | None = None

#: Why the worker is vLLM's when the configuration does not say.
WORKER_DEFAULT_REASON = (
    'the default until kvcache\'s worker passes a GPU run; "kvcache_worker": true selects it'
)


class CPUOffloadingSpec(_VllmCPUOffloadingSpec):
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
        self._read_worker_settings(extra)
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

    def _read_worker_settings(self, extra: Any) -> None:
        """The worker keys of ``kv_connector_extra_config`` (typed errors for bad values)."""
        #: None when the configuration does not name a worker (the default applies).
        self.worker_setting: bool | None = settings.flag(extra, "kvcache_worker")
        self.use_kvcache_worker = (
            WORKER_GPU_EVIDENCE is not None if self.worker_setting is None else self.worker_setting
        )
        self.pin_setting = settings.choice(extra, "kvcache_pin", settings.PIN_SETTINGS)
        self.copy_setting = settings.choice(extra, "kvcache_copy", settings.COPY_SETTINGS)
        cutoff = extra.get("kvcache_kernel_max_run_bytes")
        if cutoff is not None and (isinstance(cutoff, bool) or not isinstance(cutoff, int)):
            raise InvalidTypeError("kvcache_kernel_max_run_bytes must be an int (bytes) or null")
        if cutoff is not None and cutoff < 0:
            raise InvalidArgumentError("kvcache_kernel_max_run_bytes must be >= 0")
        self.kernel_max_run_bytes: int | None = cutoff

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

    def worker_unsupported(self, kv_caches: CanonicalKVCaches) -> str | None:
        """Why kvcache's worker cannot serve this configuration (None: it can)."""
        import torch

        if not self.use_kvcache_worker:
            if self.worker_setting is None:
                return WORKER_DEFAULT_REASON
            return "kvcache_worker is false in kv_connector_extra_config"
        if self.replicated_layout:
            return "replicated (MLA) layout: ranks share one host copy, kvcache pools are per rank"
        if self.num_chunks <= 0:
            return "cpu_bytes_to_use buys no chunk"
        if not kv_caches.tensors:
            return "no KV cache tensors"
        devices = {t.tensor.device for t in kv_caches.tensors}
        if len(devices) != 1:
            return f"KV tensors on several devices ({sorted(map(str, devices))})"
        (device,) = devices
        if device.type == "cuda" and getattr(torch.version, "hip", None):
            return "ROCm (kvcache's worker supports CUDA)"
        if device.type not in ("cuda", "cpu"):
            return f"device type {device.type!r} (kvcache's worker supports CUDA)"
        for i, t in enumerate(kv_caches.tensors):
            tensor = t.tensor
            if tensor.dim() == 0 or (tensor.numel() * tensor.element_size()) % t.page_size_bytes:
                return f"KV tensor {i} is not a whole number of {t.page_size_bytes}-byte pages"
        return None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is not None:
            return self._worker
        reason = self.worker_unsupported(kv_caches)
        if reason is not None:
            worker = super().get_worker(kv_caches)
        else:
            worker, reason = build_worker(
                kv_caches,
                functools.partial(super().get_worker, kv_caches),
                blocks_per_chunk=self.blocks_per_chunk,
                num_chunks=self.num_chunks,
                pin=self.pin_setting,  # type: ignore[arg-type]
                copy=self.copy_setting,  # type: ignore[arg-type]
                kernel_max_run_bytes=self.kernel_max_run_bytes,
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
            VLLM_SEMANTICS,
            self.manager_description(),
            self.policy_kind or self.eviction_policy,
            worker_text,
            pool,
            pinned,
            cutoff,
        )


def build_manager(
    spec: Any, ours: type, theirs: type, what: str, kwargs: dict[str, Any]
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


#: The name to give vLLM's ``OffloadingSpecFactory`` (``spec_name``): ``CPUOffloadingSpec``
#: itself is registered to vLLM's spec, which the factory would pick instead.
KvCacheOffloadingSpec = CPUOffloadingSpec


from kvcache.vllm._tiering import KvCacheTieringOffloadingSpec, primary_tier_class  # noqa: E402

#: The CPU primary tier of vLLM's tiered offloading, on kvcache's Rust manager.
CPUPrimaryTierOffloadingManager = primary_tier_class()
