"""The CUDA runtime and driver that torch already loaded, as ``_core.CudaApi``.

Why the already-loaded libraries and not any found on disk: error state and contexts are per
runtime instance, so kvcache must talk to the same one torch uses (``dlopen`` of the file torch
mapped returns that instance). Rust resolves every entry point by name and types it with
CUDA's C signature (``crates/kvcache-py/src/transfer/api.rs``); no function address ever
passes through Python. Tests name a fake runtime built from ``tests/support/fakecuda/`` instead,
which goes through the very same declarations. Nothing here is needed on CPU-only machines.

``cuMemcpyBatchAsync`` (one call for a whole job's copies) lives in the driver library and
exists from CUDA 12.8 drivers on; where it is missing the engine issues one
``cudaMemcpyAsync`` per run instead.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Protocol

from kvcache import _core
from kvcache._core import TransferError

logger = logging.getLogger(__name__)

# One cudaHostRegister call fails at 512 GiB and beyond; stay well below.
MAX_REGISTER_PIECE_BYTES = 64 << 30
# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, and mapped into
# the device address space so kernels can dereference it.
REGISTER_FLAGS = 0x01 | 0x02
# CUmemcpySrcAccessOrder: STREAM for sources the device may still be writing (stores read the
# live KV cache), ANY for host sources nothing writes meanwhile (loads).
SRC_ACCESS_ORDER_STREAM = 1
SRC_ACCESS_ORDER_ANY = 3
# The driver library, by its soname (it carries cuMemcpyBatchAsync).
DRIVER_LIBRARY = "libcuda.so.1"


class Registrable(Protocol):
    """The pool as registration sees it (``kvcache.transfer.HostChunkPool``)."""

    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

    device_can_use_host_pointer: bool
    # The runtime that registered it, and whether a background registration's outcome has
    # been seen (and logged) yet.
    _pin_runtime: CudaRuntime | None
    _pin_reported: bool
    _pin_device: int | None

    def _register(
        self,
        api: _core.CudaApi,
        flags: int,
        max_piece_bytes: int,
        *,
        background: bool = False,
        device: int | None = None,
    ) -> int: ...


@dataclass(frozen=True)
class CudaRuntime:
    """A CUDA runtime (and driver) as the pool and the engine use it."""

    api: _core.CudaApi

    @classmethod
    def load(cls, runtime: str, driver: str | None = DRIVER_LIBRARY) -> CudaRuntime:
        """The runtime at path or soname ``runtime`` and, when it loads, the driver
        ``driver``; ``TransferError`` when the runtime cannot be loaded."""
        if driver is not None:
            try:
                return cls(_core.CudaApi(runtime, driver))
            except TransferError:
                logger.debug("no CUDA driver library %s: per-run copies only", driver)
        return cls(_core.CudaApi(runtime))

    @property
    def batched(self) -> bool:
        """Whether the driver's batched copy is available."""
        return bool(self.api.batched)

    def clear_error(self) -> int:
        """Reads and resets the calling thread's last CUDA error; returns it."""
        return int(self.api.clear_error())

    def error_string(self, code: int) -> str:
        return str(self.api.error_string(code))

    def driver_error_string(self, code: int) -> str:
        """Names a driver (``CUresult``) error code."""
        return str(self.api.driver_error_string(code))

    def device_pointer(self, host_address: int, device: int | None = None) -> int | None:
        """The device address of registered host memory, or None (error cleared); asked with
        ``device`` current when given."""
        return self.api.device_pointer(host_address, device)


#: What the pool and engine need from a runtime (a real one or one over the tests' fake).
Runtime = CudaRuntime


def _loaded_cudart_paths() -> list[str]:
    """Paths of every ``libcudart`` mapped into this process (torch's comes first)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and "/libcudart.so" in fields[5] and fields[5] not in paths:
                    paths.append(fields[5])
    except OSError:
        pass
    return paths


@functools.cache
def runtime() -> CudaRuntime | None:
    """The CUDA runtime torch uses, or None when torch has no usable CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()  # type: ignore[no-untyped-call]  # unannotated in torch
    candidates = [*_loaded_cudart_paths(), "libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for name in candidates:
        try:
            return CudaRuntime.load(name)
        except TransferError:
            continue
    logger.warning("CUDA is available but its runtime library could not be loaded")
    return None


def _current_device() -> int:
    import torch

    return int(torch.cuda.current_device())


def register_pool(
    pool: Registrable,
    rt: CudaRuntime,
    *,
    required: bool,
    background: bool = False,
    max_piece_bytes: int = MAX_REGISTER_PIECE_BYTES,
    device: int | None = None,
) -> bool:
    """Registers ``pool`` in pieces; on failure it is left pageable and the error cleared.

    Every registration call, and the unregistration on ``close()``, runs with ``device``
    current (None: the calling thread's, left alone). Blocking: registers on the calling
    thread; returns whether the pool is now pinned; raises ``TransferError`` on failure if
    ``required``. ``background``: starts the registration on a thread of its own, bound to
    ``device`` (default: the calling thread's current device), and returns True at once; the
    pool reports ``pinned`` when it has finished (see ``HostChunkPool.pin_status``).
    """
    if background and device is None:
        device = _current_device()
    try:
        pieces = pool._register(
            rt.api, REGISTER_FLAGS, max_piece_bytes, background=background, device=device
        )
    except TransferError as exc:
        if required:
            raise TransferError(f"pinning the host chunk pool failed: {exc}") from exc
        logger.warning("pinning the host chunk pool failed, staying pageable (slower): %s", exc)
        return False
    pool._pin_runtime = rt
    pool._pin_device = device
    if background:
        pool._pin_reported = False
        logger.debug("pinning %d bytes in %d background piece(s)", pool.nbytes, pieces)
        return True
    finish_registration(pool, rt)
    logger.debug("pinned %d bytes of host memory in %d piece(s)", pool.nbytes, pieces)
    return True


def finish_registration(pool: Registrable, rt: CudaRuntime) -> None:
    """After registration: may GPU kernels use the pool's host addresses directly?

    Unified addressing normally maps registered memory at its host address; where it does not
    (e.g. some WSL2 setups), the copy kernel would fault, so it is switched off.
    """
    dev = rt.device_pointer(pool.address, getattr(pool, "_pin_device", None))
    pool.device_can_use_host_pointer = dev == pool.address
    if not pool.device_can_use_host_pointer:
        logger.debug("registered host memory has a separate device address; kernel copies off")
