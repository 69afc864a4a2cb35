"""Access to the CUDA runtime that torch already loaded, through ctypes.

Why not ``torch.cuda.cudart()``: it does not expose ``cudaGetLastError`` (needed to clear the
sticky error a failed registration leaves) nor ``cudaMemcpyAsync``. Why the already-loaded
library and not any ``libcudart`` found on disk: error state and contexts are per runtime
instance, so we must talk to the same one torch uses. Rust receives plain function addresses
(see ``crates/kvcache-py/src/transfer/cuda.rs``); nothing here is needed on CPU-only machines.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvcache.transfer._pool import HostChunkPool

logger = logging.getLogger(__name__)

# One cudaHostRegister call fails at 512 GiB and beyond; stay well below.
MAX_REGISTER_PIECE_BYTES = 64 << 30
# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, and mapped into
# the device address space so kernels can dereference it.
REGISTER_FLAGS = 0x01 | 0x02
# cudaMemcpyDefault: direction inferred from unified virtual addresses.
MEMCPY_DEFAULT = 4


class Runtime(Protocol):
    """What the pool and engine need from a CUDA runtime (the real one or a test fake)."""

    host_register: int
    host_unregister: int
    get_last_error: int
    memcpy_async: int

    def clear_error(self) -> int: ...

    def error_string(self, code: int) -> str: ...

    def device_pointer(self, host_address: int) -> int | None: ...


@dataclass(frozen=True)
class CudaRuntime:
    """Entry points of the loaded ``libcudart`` as integer addresses, plus a few helpers."""

    lib: ctypes.CDLL
    host_register: int
    host_unregister: int
    get_last_error: int
    memcpy_async: int

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
        return cls(
            lib=lib,
            host_register=addr("cudaHostRegister"),
            host_unregister=addr("cudaHostUnregister"),
            get_last_error=addr("cudaGetLastError"),
            memcpy_async=addr("cudaMemcpyAsync"),
        )

    def clear_error(self) -> int:
        """Reads and resets the calling thread's last CUDA error; returns it."""
        return int(self.lib.cudaGetLastError())

    def error_string(self, code: int) -> str:
        raw = self.lib.cudaGetErrorString(code)
        return raw.decode(errors="replace") if raw else f"CUDA error {code}"

    def device_pointer(self, host_address: int) -> int | None:
        """The device address of registered host memory, or None (error cleared)."""
        out = ctypes.c_void_p()
        if self.lib.cudaHostGetDevicePointer(ctypes.byref(out), host_address, 0) != 0:
            self.clear_error()
            return None
        return out.value


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


def register_pool(
    pool: HostChunkPool,
    rt: Runtime,
    *,
    required: bool,
    max_piece_bytes: int = MAX_REGISTER_PIECE_BYTES,
) -> bool:
    """Registers ``pool`` in pieces; on failure it is left pageable and the error cleared.

    Returns whether the pool is now pinned; raises ``RuntimeError`` on failure if ``required``.
    """
    try:
        pieces = pool._register(
            rt.host_register,
            rt.host_unregister,
            rt.get_last_error,
            REGISTER_FLAGS,
            max_piece_bytes,
            rt,
        )
    except RuntimeError as exc:
        if required:
            raise RuntimeError(f"pinning the host chunk pool failed: {exc}") from exc
        logger.warning("pinning the host chunk pool failed, staying pageable (slower): %s", exc)
        return False
    dev = rt.device_pointer(pool.address)
    pool.device_can_use_host_pointer = dev == pool.address
    if not pool.device_can_use_host_pointer:
        logger.info("registered host memory has a separate device address; kernel copies off")
    logger.debug("pinned %d bytes of host memory in %d piece(s)", pool.nbytes, pieces)
    return True


def pin_pool(pool: HostChunkPool, *, required: bool) -> bool:
    """Applies the pool's ``pin`` policy: register when CUDA is available."""
    rt = runtime()
    if rt is None:
        if required:
            raise RuntimeError("pin=True but CUDA is not available")
        logger.debug("CUDA not available: the host chunk pool stays pageable")
        return False
    return register_pool(pool, rt, required=required)
