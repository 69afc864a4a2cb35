"""Access to the CUDA runtime and driver that torch already loaded, through ctypes.

Why not ``torch.cuda.cudart()``: it exposes neither ``cudaGetLastError`` (needed to clear the
sticky error a failed registration leaves) nor ``cudaMemcpyAsync``. Why the already-loaded
libraries and not any found on disk: error state and contexts are per runtime instance, so we
must talk to the same one torch uses. Rust receives plain function addresses (see
``crates/kvcache-py/src/transfer/``); nothing here is needed on CPU-only machines.

``cuMemcpyBatchAsync`` (one call for a whole job's copies) lives in the driver library and
exists from CUDA 12.8 drivers on: it is looked up when a runtime is first used, and when it is
missing the engine issues one ``cudaMemcpyAsync`` per run instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from typing import Protocol

from kvcache._core import TransferError

logger = logging.getLogger(__name__)

# One cudaHostRegister call fails at 512 GiB and beyond; stay well below.
MAX_REGISTER_PIECE_BYTES = 64 << 30
# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, and mapped into
# the device address space so kernels can dereference it.
REGISTER_FLAGS = 0x01 | 0x02
# cudaMemcpyDefault: direction inferred from unified virtual addresses.
MEMCPY_DEFAULT = 4
# CUmemcpySrcAccessOrder: STREAM for sources the device may still be writing (stores read the
# live KV cache), ANY for host sources nothing writes meanwhile (loads).
SRC_ACCESS_ORDER_STREAM = 1
SRC_ACCESS_ORDER_ANY = 3


@dataclass(frozen=True)
class BatchCopy:
    """The driver's batched copy entry point: its address and whether it is the ``_v2``
    signature (CUDA 13, no ``failIdx``)."""

    address: int
    v2: bool


class Registrable(Protocol):
    """The pool as registration sees it (``kvcache.transfer.HostChunkPool``)."""

    address: int
    nbytes: int
    device_can_use_host_pointer: bool
    # The runtime that registered it, and whether a background registration's outcome has
    # been seen (and logged) yet.
    _pin_runtime: Runtime | None
    _pin_reported: bool

    def _register(
        self,
        register_fn: int,
        unregister_fn: int,
        get_last_error_fn: int,
        flags: int,
        max_piece_bytes: int,
        keepalive: object,
        *,
        background: bool = False,
        set_device_fn: int = 0,
        device: int = 0,
    ) -> int: ...


#: CUDA runtime functions a DMA queue (``_core.CudaQueue``) calls from its thread.
QUEUE_FUNCTIONS = (
    "cudaEventCreateWithFlags",
    "cudaEventDestroy",
    "cudaEventRecord",
    "cudaEventQuery",
    "cudaEventSynchronize",
    "cudaEventElapsedTime",
    "cudaStreamWaitEvent",
    "cudaStreamSynchronize",
    "cudaMemcpyAsync",
    "cudaSetDevice",
    "cudaGetLastError",
    "cudaGetErrorString",
)


class Runtime(Protocol):
    """What the pool and engine need from a CUDA runtime (the real one or a test fake)."""

    host_register: int
    host_unregister: int
    get_last_error: int
    memcpy_async: int
    #: ``QUEUE_FUNCTIONS`` by name -> address.
    queue_functions: dict[str, int]
    batch: BatchCopy | None

    def clear_error(self) -> int: ...

    def error_string(self, code: int) -> str: ...

    def device_pointer(self, host_address: int) -> int | None: ...


@dataclass(frozen=True)
class CudaRuntime:
    """Entry points of the loaded ``libcudart`` (and the driver) as integer addresses."""

    lib: ctypes.CDLL
    host_register: int
    host_unregister: int
    get_last_error: int
    memcpy_async: int
    set_device: int
    queue_functions: dict[str, int]
    driver: ctypes.CDLL | None
    batch: BatchCopy | None

    @classmethod
    def from_library(cls, lib: ctypes.CDLL) -> CudaRuntime:
        def addr(name: str) -> int:
            value = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
            if not value:
                raise OSError(f"{name} not found in {lib._name}")
            return value

        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetLastError.argtypes = []
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaHostGetDevicePointer.restype = ctypes.c_int
        lib.cudaHostGetDevicePointer.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
            ctypes.c_uint,
        ]
        driver, batch = _driver_batch_copy()
        return cls(
            lib=lib,
            host_register=addr("cudaHostRegister"),
            host_unregister=addr("cudaHostUnregister"),
            get_last_error=addr("cudaGetLastError"),
            memcpy_async=addr("cudaMemcpyAsync"),
            set_device=addr("cudaSetDevice"),
            queue_functions={name: addr(name) for name in QUEUE_FUNCTIONS},
            driver=driver,
            batch=batch,
        )

    def clear_error(self) -> int:
        """Reads and resets the calling thread's last CUDA error; returns it."""
        return int(self.lib.cudaGetLastError())

    def error_string(self, code: int) -> str:
        raw = self.lib.cudaGetErrorString(code)
        return raw.decode(errors="replace") if raw else f"CUDA error {code}"

    def driver_error_string(self, code: int) -> str:
        """Names a driver (``CUresult``) error code."""
        if self.driver is None:
            return f"CUDA driver error {code}"
        out = ctypes.c_char_p()
        if self.driver.cuGetErrorString(code, ctypes.byref(out)) != 0 or not out.value:
            return f"CUDA driver error {code}"
        return out.value.decode(errors="replace")

    def device_pointer(self, host_address: int) -> int | None:
        """The device address of registered host memory, or None (error cleared)."""
        out = ctypes.c_void_p()
        if self.lib.cudaHostGetDevicePointer(ctypes.byref(out), host_address, 0) != 0:
            self.clear_error()
            return None
        return out.value


def _driver_batch_copy() -> tuple[ctypes.CDLL | None, BatchCopy | None]:
    """The driver library and its ``cuMemcpyBatchAsync``, when this driver has it."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, None
    driver.cuGetErrorString.restype = ctypes.c_int
    driver.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    # Prefer the original export (with failIdx): 12.8+ and 13.x drivers both have it.
    for name, v2 in (("cuMemcpyBatchAsync", False), ("cuMemcpyBatchAsync_v2", True)):
        try:
            fn = getattr(driver, name)
        except AttributeError:
            continue
        address = ctypes.cast(fn, ctypes.c_void_p).value
        if address:
            return driver, BatchCopy(address, v2)
    return driver, None


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
    torch.cuda.init()
    candidates = [*_loaded_cudart_paths(), "libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for name in candidates:
        try:
            return CudaRuntime.from_library(ctypes.CDLL(name))
        except (OSError, AttributeError):
            continue
    logger.warning("CUDA is available but its runtime library could not be loaded")
    return None


def _current_device() -> int:
    import torch

    return int(torch.cuda.current_device())


def register_pool(
    pool: Registrable,
    rt: Runtime,
    *,
    required: bool,
    background: bool = False,
    max_piece_bytes: int = MAX_REGISTER_PIECE_BYTES,
    device: int | None = None,
) -> bool:
    """Registers ``pool`` in pieces; on failure it is left pageable and the error cleared.

    Blocking: returns whether the pool is now pinned; raises ``TransferError`` on failure if
    ``required``. ``background``: starts the registration on a thread of its own (bound to
    ``device``, default the current one) and returns True at once; the pool reports
    ``pinned`` when it has finished (see ``HostChunkPool.pin_status``).
    """
    set_device = getattr(rt, "set_device", 0) if background else 0
    if background and set_device and device is None:
        device = _current_device()
    try:
        pieces = pool._register(
            rt.host_register,
            rt.host_unregister,
            rt.get_last_error,
            REGISTER_FLAGS,
            max_piece_bytes,
            rt,
            background=background,
            set_device_fn=set_device,
            device=device or 0,
        )
    except TransferError as exc:
        if required:
            raise TransferError(f"pinning the host chunk pool failed: {exc}") from exc
        logger.warning("pinning the host chunk pool failed, staying pageable (slower): %s", exc)
        return False
    pool._pin_runtime = rt
    if background:
        pool._pin_reported = False
        logger.debug("pinning %d bytes in %d background piece(s)", pool.nbytes, pieces)
        return True
    finish_registration(pool, rt)
    logger.debug("pinned %d bytes of host memory in %d piece(s)", pool.nbytes, pieces)
    return True


def finish_registration(pool: Registrable, rt: Runtime) -> None:
    """After registration: may GPU kernels use the pool's host addresses directly?

    Unified addressing normally maps registered memory at its host address; where it does not
    (e.g. some WSL2 setups), the copy kernel would fault, so it is switched off.
    """
    dev = rt.device_pointer(pool.address)
    pool.device_can_use_host_pointer = dev == pool.address
    if not pool.device_can_use_host_pointer:
        logger.debug("registered host memory has a separate device address; kernel copies off")
