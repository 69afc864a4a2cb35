"""A fake libcudart + libcuda for testing the transfer engine without a GPU.

The C library in this folder (``fakecuda.h`` says what it models and which file holds what)
exports the real CUDA entry points (same names, same C signatures), backed by host memory that
a test declares as device memory, with streams that run later on threads of their own. This
module compiles it once per source version and wraps its test controls.

The engine must ``dlopen`` the very path :func:`library_path` returns: ``dlopen`` of one path
gives one copy of the library, so the engine and :class:`FakeCuda` share its state.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: The library's C files, compiled and linked as one shared library; the header is part of the
#: source version too.
SOURCES = tuple(sorted(HERE.glob("*.c")))
HEADERS = tuple(sorted(HERE.glob("*.h")))
CFLAGS = ("-O1", "-g", "-shared", "-fPIC", "-pthread", "-Wall", "-Werror")
REPO = Path(__file__).resolve().parents[3]
CACHE = REPO / ".pytest_cache" / "fakecuda"

# cudaError_t / CUresult values the fake produces.
SUCCESS = 0
INVALID_VALUE = 1
INVALID_DEVICE = 101
INVALID_HANDLE = 400
NOT_READY = 600
ILLEGAL_ADDRESS = 700
HOST_MEMORY_ALREADY_REGISTERED = 712
HOST_MEMORY_NOT_REGISTERED = 713
MISALIGNED_ADDRESS = 716
LAUNCH_FAILURE = 719

EVENT_DISABLE_TIMING = 2
HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2
MEMCPY_DEFAULT = 4
# What cudaHostGetDevicePointer adds to a host address after set_uva(False).
NON_UVA_OFFSET = 0x100000000000
SIZE_MAX = 2**64 - 1

_build_lock = threading.Lock()


def library_path() -> Path:
    """The compiled library for the current source, building it on first use."""
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    for path in (*HEADERS, *SOURCES):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    target = CACHE / digest.hexdigest()[:16] / "libfakecuda.so"
    with _build_lock:
        if target.exists():
            return target
        compiler = shutil.which("cc")
        if compiler is None:
            raise RuntimeError("fakecuda needs a C compiler: `cc` is not on PATH")
        target.parent.mkdir(parents=True, exist_ok=True)
        # A unique temporary name and an atomic rename: concurrent test processes may build
        # the same version at once, and none may load a half-written file.
        fd, tmp = tempfile.mkstemp(prefix=".libfakecuda.", suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            result = subprocess.run(
                [compiler, *CFLAGS, "-o", tmp, *map(str, SOURCES)],
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode != 0:
                raise RuntimeError(f"compiling the fake CUDA in {HERE} failed:\n{result.stderr}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


class CudaError(RuntimeError):
    """A fake CUDA call that a wrapper expected to succeed returned ``code``."""

    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call} returned {code}")
        self.call = call
        self.code = code


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


_P = ctypes.c_void_p
_I = ctypes.c_int
_U = ctypes.c_uint
_SZ = ctypes.c_size_t
_U64 = ctypes.c_uint64
_PSZ = ctypes.POINTER(ctypes.c_size_t)
_PU64 = ctypes.POINTER(ctypes.c_uint64)
_PATTR = ctypes.POINTER(MemcpyAttributes)

# name: (restype, argtypes), for every exported function.
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "cudaSetDevice": (_I, [_I]),
    "cudaGetDevice": (_I, [ctypes.POINTER(_I)]),
    "cudaGetDeviceCount": (_I, [ctypes.POINTER(_I)]),
    "cudaGetLastError": (_I, []),
    "cudaPeekAtLastError": (_I, []),
    "cudaGetErrorString": (ctypes.c_char_p, [_I]),
    "cudaStreamCreateWithFlags": (_I, [ctypes.POINTER(_P), _U]),
    "cudaStreamCreate": (_I, [ctypes.POINTER(_P)]),
    "cudaStreamDestroy": (_I, [_P]),
    "cudaStreamSynchronize": (_I, [_P]),
    "cudaStreamQuery": (_I, [_P]),
    "cudaStreamWaitEvent": (_I, [_P, _P, _U]),
    "cudaEventCreateWithFlags": (_I, [ctypes.POINTER(_P), _U]),
    "cudaEventCreate": (_I, [ctypes.POINTER(_P)]),
    "cudaEventDestroy": (_I, [_P]),
    "cudaEventRecord": (_I, [_P, _P]),
    "cudaEventQuery": (_I, [_P]),
    "cudaEventSynchronize": (_I, [_P]),
    "cudaEventElapsedTime": (_I, [ctypes.POINTER(ctypes.c_float), _P, _P]),
    "cudaMemcpyAsync": (_I, [_P, _P, _SZ, _I, _P]),
    "cudaHostRegister": (_I, [_P, _SZ, _U]),
    "cudaHostUnregister": (_I, [_P]),
    "cudaHostGetDevicePointer": (_I, [ctypes.POINTER(_P), _P, _U]),
    "cuGetErrorString": (_I, [_I, ctypes.POINTER(ctypes.c_char_p)]),
    "cuMemcpyBatchAsync": (_I, [_PU64, _PU64, _PSZ, _SZ, _PATTR, _PSZ, _SZ, _PSZ, _P]),
    "cuMemcpyBatchAsync_v2": (_I, [_PU64, _PU64, _PSZ, _SZ, _PATTR, _PSZ, _SZ, _P]),
    "fakecuda_reset": (_I, [_I]),
    "fakecuda_add_device_memory": (_I, [_I, _U64, _SZ]),
    "fakecuda_remove_device_memory": (_I, [_U64]),
    "fakecuda_fail_batch": (None, [_I, _SZ, _I]),
    "fakecuda_fail_memcpy": (None, [ctypes.c_long, _I]),
    "fakecuda_fail_register": (None, [ctypes.c_long, _I]),
    "fakecuda_stream_gate": (_U64, [_P]),
    "fakecuda_gate_open": (_I, [_U64]),
    "fakecuda_gate_reached": (_I, [_U64]),
    "fakecuda_stream_pending": (ctypes.c_long, [_P]),
    "fakecuda_stream_blocked": (_I, [_P]),
    "fakecuda_waiting": (_I, []),
    "fakecuda_hold_memcpy": (_I, [_P, _I]),
    "fakecuda_holding": (_I, []),
    "fakecuda_register_gate": (None, [_I]),
    "fakecuda_registers_waiting": (_I, []),
    "fakecuda_fault": (None, [_I]),
    "fakecuda_sticky": (_I, []),
    "fakecuda_set_uva": (None, [_I]),
    "fakecuda_touched_devices": (_U64, []),
    "fakecuda_count": (ctypes.c_long, [ctypes.c_char_p]),
    "fakecuda_last_batch_order": (_I, []),
    "fakecuda_launch_copy": (_I, [_P, _P, _SZ, _P, _SZ, _I]),
    "fakecuda_stream_device": (_I, [_P]),
    "fakecuda_live_streams": (_I, []),
    "fakecuda_drop_copy": (None, [ctypes.c_long]),
    "fakecuda_forget_device_memory": (_I, [ctypes.c_uint64, _SZ]),
    "fakecuda_corrupt_copy": (None, [ctypes.c_long]),
    "fakecuda_registration": (
        _I,
        [
            _I,
            _SZ,
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_int),
        ],
    ),
}


class FakeCuda:
    """The loaded fake library: test controls plus thin wrappers over its CUDA calls.

    Creators (``stream_create``, ``event_create``, ``get_device``) raise :class:`CudaError`;
    every other CUDA wrapper returns the error code so tests can assert on it. ``lib`` is the
    raw ``ctypes`` library with every signature declared.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else library_path()
        self.lib = ctypes.CDLL(str(self.path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.restype = restype
            fn.argtypes = argtypes

    def address(self, name: str) -> int:
        """The address of an exported function, as the engine receives CUDA entry points."""
        value = ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value
        assert value is not None
        return value

    # ---- test controls ------------------------------------------------------------------

    def reset(self, devices: int = 1) -> None:
        if self.lib.fakecuda_reset(devices) != SUCCESS:
            raise ValueError(f"devices must be in 1..64, got {devices}")

    def add_device_memory(self, device: int, ptr: int, nbytes: int) -> None:
        if self.lib.fakecuda_add_device_memory(device, ptr, nbytes) != SUCCESS:
            raise ValueError(f"cannot declare {nbytes} bytes at {ptr:#x} as device {device}")

    def remove_device_memory(self, ptr: int) -> None:
        if self.lib.fakecuda_remove_device_memory(ptr) != SUCCESS:
            raise ValueError(f"no device memory starts at {ptr:#x}")

    def device_tensor(self, device: int, tensor: Any) -> Any:
        """Declares a CPU torch tensor's whole storage as memory of ``device`` (forgetting
        what freed memory at that place was declared as before); returns it."""
        storage = tensor.untyped_storage()
        self.declare(device, storage.data_ptr(), storage.nbytes())
        return tensor

    def declare(self, device: int, ptr: int, nbytes: int) -> None:
        """Declares ``[ptr, ptr + nbytes)`` as memory of ``device``, replacing any earlier
        declaration it overlaps (host memory freed and reallocated is a new allocation)."""
        if not self._same(device, ptr, nbytes):
            self.lib.fakecuda_forget_device_memory(ptr, nbytes)
            self.add_device_memory(device, ptr, nbytes)

    def forget(self, ptr: int, nbytes: int) -> None:
        """Host memory at ``[ptr, ptr + nbytes)`` is no device's any more (it was freed and
        reallocated as host memory)."""
        self.lib.fakecuda_forget_device_memory(ptr, nbytes)

    def _same(self, device: int, ptr: int, nbytes: int) -> bool:
        # An exact duplicate is accepted by the library as it is.
        return self.lib.fakecuda_add_device_memory(device, ptr, nbytes) == SUCCESS

    def fail_batch(self, mode: int, index: int = 0, code: int = INVALID_VALUE) -> None:
        self.lib.fakecuda_fail_batch(mode, index, code)

    def fail_memcpy(self, nth: int, code: int = ILLEGAL_ADDRESS) -> None:
        self.lib.fakecuda_fail_memcpy(nth, code)

    def fail_register(self, nth: int, code: int) -> None:
        self.lib.fakecuda_fail_register(nth, code)

    def stream_gate(self, stream: int) -> int:
        gate = self.lib.fakecuda_stream_gate(stream)
        if gate == 0:
            raise CudaError("fakecuda_stream_gate", INVALID_HANDLE)
        return gate

    def gate_open(self, gate: int) -> None:
        """Opens ``gate``, once. A gate stays the test's to open until then (or the next
        reset), even when its stream dropped it under a sticky fault."""
        if self.lib.fakecuda_gate_open(gate) != SUCCESS:
            raise ValueError(f"no pending gate {gate}")

    def gate_reached(self, gate: int) -> bool:
        """Whether the stream has got to ``gate`` (waits there, or dropped it): everything
        enqueued before it has executed, nothing after it has."""
        reached = self.lib.fakecuda_gate_reached(gate)
        if reached < 0:
            raise ValueError(f"no pending gate {gate}")
        return bool(reached)

    def stream_pending(self, stream: int) -> int:
        """Ops enqueued on ``stream`` not yet executed or dropped (answers under a sticky
        fault, unlike ``cudaStreamQuery``)."""
        pending = self.lib.fakecuda_stream_pending(stream)
        if pending < 0:
            raise CudaError("fakecuda_stream_pending", INVALID_HANDLE)
        return pending

    def stream_blocked(self, stream: int) -> bool:
        """Whether ``stream``'s thread sits at a gate or at a wait for an event."""
        blocked = self.lib.fakecuda_stream_blocked(stream)
        if blocked < 0:
            raise CudaError("fakecuda_stream_blocked", INVALID_HANDLE)
        return bool(blocked)

    def waiting(self) -> int:
        """Callers blocked inside a synchronising call: a stream or event synchronize, a
        pageable copy waiting for its stream, a stream destroy draining its work."""
        return self.lib.fakecuda_waiting()

    def hold_memcpy(self, stream: int, on: bool) -> None:
        rc = self.lib.fakecuda_hold_memcpy(stream, int(on))
        if rc != SUCCESS:
            raise CudaError("fakecuda_hold_memcpy", rc)

    def holding(self) -> int:
        return self.lib.fakecuda_holding()

    def register_gate(self, closed: bool) -> None:
        self.lib.fakecuda_register_gate(int(closed))

    def registers_waiting(self) -> int:
        return self.lib.fakecuda_registers_waiting()

    def fault(self, code: int) -> None:
        self.lib.fakecuda_fault(code)

    def sticky(self) -> int:
        return self.lib.fakecuda_sticky()

    def set_uva(self, on: bool) -> None:
        self.lib.fakecuda_set_uva(int(on))

    def touched_devices(self) -> set[int]:
        mask = self.lib.fakecuda_touched_devices()
        return {d for d in range(64) if mask >> d & 1}

    def count(self, name: str) -> int:
        value = self.lib.fakecuda_count(name.encode())
        if value < 0:
            raise KeyError(name)
        return value

    def last_batch_order(self) -> int:
        return self.lib.fakecuda_last_batch_order()

    def launch_copy(
        self, stream: int, table_ptr: int, n: int, refs_ptr: int, nrefs: int, to_device: bool
    ) -> int:
        return self.lib.fakecuda_launch_copy(stream, table_ptr, n, refs_ptr, nrefs, int(to_device))

    def stream_device(self, stream: int) -> int:
        """The device of a live created stream, -1 for any other handle."""
        return self.lib.fakecuda_stream_device(stream)

    def live_streams(self) -> int:
        return self.lib.fakecuda_live_streams()

    def drop_copy(self, nth: int) -> None:
        """The ``nth`` copy executed from now (1-based) is skipped, yet reported done."""
        self.lib.fakecuda_drop_copy(nth)

    def corrupt_copy(self, nth: int) -> None:
        """The ``nth`` copy executed from now flips a byte of its destination after copying."""
        self.lib.fakecuda_corrupt_copy(nth)

    def registrations(self, *, unregistered: bool = False) -> list[tuple[int, int, int, int]]:
        """Every successful ``cudaHostRegister`` (or ``cudaHostUnregister``) since the last
        reset, as ``(start, length, flags, device current on the calling thread)``."""
        out = []
        start, length = ctypes.c_uint64(), ctypes.c_uint64()
        flags, device = ctypes.c_uint(), ctypes.c_int()
        i = 0
        while (
            self.lib.fakecuda_registration(
                int(unregistered),
                i,
                ctypes.byref(start),
                ctypes.byref(length),
                ctypes.byref(flags),
                ctypes.byref(device),
            )
            == SUCCESS
        ):
            out.append((start.value, length.value, flags.value, device.value))
            i += 1
        return out

    # ---- CUDA wrappers ------------------------------------------------------------------

    def set_device(self, device: int) -> int:
        return self.lib.cudaSetDevice(device)

    def get_device(self) -> int:
        device = ctypes.c_int(-1)
        rc = self.lib.cudaGetDevice(ctypes.byref(device))
        if rc != SUCCESS:
            raise CudaError("cudaGetDevice", rc)
        return device.value

    def get_last_error(self) -> int:
        return self.lib.cudaGetLastError()

    def peek_at_last_error(self) -> int:
        return self.lib.cudaPeekAtLastError()

    def error_string(self, code: int) -> str:
        return self.lib.cudaGetErrorString(code).decode()

    def stream_create(self, flags: int = 0) -> int:
        handle = ctypes.c_void_p()
        rc = self.lib.cudaStreamCreateWithFlags(ctypes.byref(handle), flags)
        if rc != SUCCESS:
            raise CudaError("cudaStreamCreateWithFlags", rc)
        return handle.value or 0

    def stream_destroy(self, stream: int) -> int:
        return self.lib.cudaStreamDestroy(stream)

    def stream_synchronize(self, stream: int) -> int:
        return self.lib.cudaStreamSynchronize(stream)

    def stream_query(self, stream: int) -> int:
        return self.lib.cudaStreamQuery(stream)

    def event_create(self, timing: bool = True) -> int:
        handle = ctypes.c_void_p()
        flags = 0 if timing else EVENT_DISABLE_TIMING
        rc = self.lib.cudaEventCreateWithFlags(ctypes.byref(handle), flags)
        if rc != SUCCESS:
            raise CudaError("cudaEventCreateWithFlags", rc)
        return handle.value or 0

    def event_destroy(self, event: int) -> int:
        return self.lib.cudaEventDestroy(event)

    def event_record(self, event: int, stream: int) -> int:
        return self.lib.cudaEventRecord(event, stream)

    def event_query(self, event: int) -> int:
        return self.lib.cudaEventQuery(event)

    def event_synchronize(self, event: int) -> int:
        return self.lib.cudaEventSynchronize(event)

    def event_elapsed(self, start: int, end: int) -> tuple[int, float]:
        ms = ctypes.c_float(0.0)
        rc = self.lib.cudaEventElapsedTime(ctypes.byref(ms), start, end)
        return rc, ms.value

    def stream_wait_event(self, stream: int, event: int, flags: int = 0) -> int:
        return self.lib.cudaStreamWaitEvent(stream, event, flags)

    def memcpy_async(
        self, dst: int, src: int, n: int, stream: int, kind: int = MEMCPY_DEFAULT
    ) -> int:
        return self.lib.cudaMemcpyAsync(dst, src, n, kind, stream)

    def host_register(self, ptr: int, n: int, flags: int = HOST_REGISTER_MAPPED) -> int:
        return self.lib.cudaHostRegister(ptr, n, flags)

    def host_unregister(self, ptr: int) -> int:
        return self.lib.cudaHostUnregister(ptr)

    def host_get_device_pointer(self, ptr: int) -> tuple[int, int]:
        device = ctypes.c_void_p()
        rc = self.lib.cudaHostGetDevicePointer(ctypes.byref(device), ptr, 0)
        return rc, device.value or 0

    def memcpy_batch(
        self,
        dsts: list[int],
        srcs: list[int],
        sizes: list[int],
        stream: int,
        order: int = 3,
        *,
        v2: bool = False,
    ) -> tuple[int, int]:
        """One batched call with a single attribute for every copy: ``(rc, failIdx)``.

        ``failIdx`` is :data:`SIZE_MAX` for ``v2``, which has none.
        """
        n = len(dsts)
        dst_arr = (ctypes.c_uint64 * max(n, 1))(*dsts)
        src_arr = (ctypes.c_uint64 * max(n, 1))(*srcs)
        size_arr = (ctypes.c_size_t * max(n, 1))(*sizes)
        attrs = MemcpyAttributes(srcAccessOrder=order)
        first = ctypes.c_size_t(0)
        fail = ctypes.c_size_t(SIZE_MAX)
        if v2:
            rc = self.lib.cuMemcpyBatchAsync_v2(
                dst_arr, src_arr, size_arr, n, ctypes.byref(attrs), ctypes.byref(first), 1, stream
            )
        else:
            rc = self.lib.cuMemcpyBatchAsync(
                dst_arr,
                src_arr,
                size_arr,
                n,
                ctypes.byref(attrs),
                ctypes.byref(first),
                1,
                ctypes.byref(fail),
                stream,
            )
        return rc, fail.value
