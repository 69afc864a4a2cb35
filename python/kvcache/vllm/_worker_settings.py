"""Which worker moves the bytes, as both of kvcache's specs decide it: the worker keys of
``kv_connector_extra_config`` and what kvcache's worker can serve.

:class:`WorkerSettings` is a base of ``CPUOffloadingSpec`` and ``KvCacheTieringOffloadingSpec``:
both read the same keys with the same checks and apply the same rule, so neither borrows the
other's methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvcache import _extra_config as settings
from kvcache._core import InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import CanonicalKVCaches

#: The GPU run that made kvcache's worker the specs' default: the path, relative to the
#: repository, of a ``gpu/check.py`` JSON whose every path passed on a GPU (see
#: docs/worker.md, "Which worker runs"). None: no GPU run has passed yet, so vLLM's own worker
#: moves the bytes unless ``"kvcache_worker": true``. Setting it is the whole switch;
#: ``tests/test_worker_default.py`` checks that the file it names passed.
WORKER_GPU_EVIDENCE: str | None = None

#: Why the worker is vLLM's when the configuration does not say.
WORKER_DEFAULT_REASON = (
    'the default until kvcache\'s worker passes a GPU run; "kvcache_worker": true selects it'
)


class WorkerSettings:
    """The worker settings of a kvcache spec (read by :meth:`read_worker_settings`, with
    typed errors for bad values) and :meth:`worker_unsupported`, the configurations kvcache's
    worker cannot serve."""

    #: ``kvcache_worker`` as given; None when the configuration does not name a worker (the
    #: default applies).
    worker_setting: bool | None
    use_kvcache_worker: bool
    pin_setting: str
    copy_setting: str
    kernel_max_run_bytes: int | None
    # Set by vLLM's spec, which the class using these settings also subclasses.
    replicated_layout: bool
    num_chunks: int
    blocks_per_chunk: int

    def read_worker_settings(self, extra: Mapping[str, Any]) -> None:
        """The worker keys of ``kv_connector_extra_config``."""
        self.worker_setting = settings.flag(extra, "kvcache_worker")
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
        self.kernel_max_run_bytes = cutoff

    def worker_options(self) -> dict[str, Any]:
        """The arguments of kvcache's worker that these settings and the spec decide."""
        return {
            "blocks_per_chunk": self.blocks_per_chunk,
            "num_chunks": self.num_chunks,
            "pin": self.pin_setting,
            "copy": self.copy_setting,
            "kernel_max_run_bytes": self.kernel_max_run_bytes,
        }

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
