"""kvcache's CUDA backend over the fake CUDA library, without a GPU.

The backend talks to CUDA in two ways, and both reach the same fake library here:

- its Rust DMA queues and the pool's registration go through ``_core.CudaApi``, which
  ``dlopen``s the fake's path and resolves CUDA's names in it exactly as it does in the real
  ``libcudart``/``libcuda`` (:func:`runtime`);
- its Python side uses a ``torch.cuda`` subset (streams, events, the current stream and
  device) and launches the copy kernel: :class:`TorchCuda` and :class:`FakeLauncher` give it
  those over the fake's streams, events and its model of the kernel (same tables, read on the
  stream when it runs, faulting on a misaligned or pageable access as a GPU does).

"Device memory" is CPU memory the test declares as a device's (:func:`device_layers`), so every
byte the backend moves can be compared with torch indexing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kvcache.transfer import TransferEngine, _cuda
from kvcache.transfer._cuda_backend import CudaBackend
from tests.support.fakecuda import NOT_READY, SUCCESS, FakeCuda
from tests.support.waiting import wait_until

_FAKE: FakeCuda | None = None


def fake() -> FakeCuda:
    """The process's fake library (built once; one instance, as with a real runtime)."""
    global _FAKE
    if _FAKE is None:
        _FAKE = FakeCuda()
    return _FAKE


def runtime(*, batch: bool = True) -> _cuda.CudaRuntime:
    """The fake as kvcache loads a runtime: by path, for the runtime and the driver."""
    path = str(fake().path)
    from kvcache import _core

    return _cuda.CudaRuntime(_core.CudaApi(path, path, batch=batch))


def check(call: str, rc: int) -> None:
    if rc != SUCCESS:
        raise RuntimeError(f"CUDA error: {call} returned {rc} ({fake().error_string(rc)})")


class Stream:
    """``torch.cuda.Stream`` over a fake stream."""

    def __init__(self, cuda: TorchCuda, handle: int, device: int) -> None:
        self._cuda = cuda
        self.cuda_stream = handle
        self.device_index = device

    def wait_stream(self, other: Stream) -> None:
        # As torch does: an event recorded on `other` (on other's device), waited for here.
        self._cuda.waits.append((self.cuda_stream, other.cuda_stream))
        f = fake()
        with self._cuda.on(other.device_index):
            event = f.event_create(timing=False)
            check("cudaEventRecord", f.event_record(event, other.cuda_stream))
        with self._cuda.on(self.device_index):
            check("cudaStreamWaitEvent", f.stream_wait_event(self.cuda_stream, event))
        f.event_destroy(event)

    def synchronize(self) -> None:
        with self._cuda.on(self.device_index):
            check("cudaStreamSynchronize", fake().stream_synchronize(self.cuda_stream))

    def query(self) -> bool:
        with self._cuda.on(self.device_index):
            rc = fake().stream_query(self.cuda_stream)
        if rc == NOT_READY:
            return False
        check("cudaStreamQuery", rc)
        return True


class Event:
    """``torch.cuda.Event`` over a fake event (created on the device of its first stream)."""

    def __init__(self, cuda: TorchCuda, enable_timing: bool = False) -> None:
        self._cuda = cuda
        self._timing = enable_timing
        self.handle = 0
        self._device = 0

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else self._cuda.current_stream()
        f = fake()
        with self._cuda.on(stream.device_index):
            if not self.handle:
                self.handle = f.event_create(timing=self._timing)
                self._device = stream.device_index
            check("cudaEventRecord", f.event_record(self.handle, stream.cuda_stream))

    def query(self) -> bool:
        if not self.handle:
            return True
        with self._cuda.on(self._device):  # as torch's device guard does
            rc = fake().event_query(self.handle)
        if rc == NOT_READY:
            return False
        check("cudaEventQuery", rc)
        return True

    def synchronize(self) -> None:
        if self.handle:
            with self._cuda.on(self._device):
                check("cudaEventSynchronize", fake().event_synchronize(self.handle))

    def elapsed_time(self, end: Event) -> float:
        with self._cuda.on(self._device):
            rc, ms = fake().event_elapsed(self.handle, end.handle)
        check("cudaEventElapsedTime", rc)
        return ms


class TorchCuda:
    """The ``torch.cuda`` subset ``CudaBackend`` uses, over the fake. ``compute[d]`` is the
    stream the "model" runs on for device ``d`` (what ``current_stream`` returns)."""

    def __init__(self, devices: int | tuple[int, ...] = 1) -> None:
        self._local = threading.local()
        #: (waiting stream, stream waited for), in order: every wait_stream.
        self.waits: list[tuple[int, int]] = []
        self.compute = {}
        for d in range(devices) if isinstance(devices, int) else devices:
            with self.on(d):
                self.compute[d] = Stream(self, fake().stream_create(), d)

    @contextlib.contextmanager
    def on(self, device: int) -> Iterator[None]:
        """``device`` current on this thread for the block (the thread's own is restored)."""
        f = fake()
        before = f.get_device()
        check("cudaSetDevice", f.set_device(device))
        try:
            yield
        finally:
            f.set_device(before)

    def device(self, device: Any) -> contextlib.AbstractContextManager[None]:
        return self.on(_index(device))

    def Stream(self, device: Any = None) -> Stream:
        d = _index(device) if device is not None else fake().get_device()
        with self.on(d):
            return Stream(self, fake().stream_create(), d)

    def Event(self, enable_timing: bool = False) -> Event:
        return Event(self, enable_timing)

    def current_stream(self, device: Any = None) -> Stream:
        d = _index(device) if device is not None else fake().get_device()
        override = getattr(self._local, "streams", {}).get(d)
        return override if override is not None else self.compute[d]

    @contextlib.contextmanager
    def stream(self, stream: Stream) -> Iterator[None]:
        streams = self._local.__dict__.setdefault("streams", {})
        before = streams.get(stream.device_index)
        streams[stream.device_index] = stream
        try:
            yield
        finally:
            streams[stream.device_index] = before


def _index(device: Any) -> int:
    if isinstance(device, int):
        return device
    return int(getattr(device, "index", None) or 0)


class FakeLauncher:
    """The copy kernel as the fake models it: the same per-block and per-tensor tables as the
    Triton kernel's, in "device memory", read by the stream when the launch runs."""

    def __init__(self, cuda: TorchCuda, device: int) -> None:
        self._cuda = cuda
        self._device = device
        self.launches = 0

    def launch(
        self,
        plan: Any,
        group: int,
        num_blocks: int,
        refs: list[tuple[int, int, int, int, int]],
        *,
        to_device: bool,
        programs: int,
        max_page_bytes: int,
    ) -> tuple[Any, ...]:
        f = fake()
        table = np.empty(3 * num_blocks, dtype=np.int64)
        plan.write_block_table(group, table)
        refs_arr = np.asarray(refs, dtype=np.int64).reshape(-1)
        for arr in (table, refs_arr):
            f.declare(self._device, arr.ctypes.data, arr.nbytes)
        stream = self._cuda.current_stream(self._device).cuda_stream
        rc = f.launch_copy(
            stream, table.ctypes.data, num_blocks, refs_arr.ctypes.data, len(refs), to_device
        )
        check("copy kernel launch", rc)
        self.launches += 1
        return (table, refs_arr)


def device_layers(tensors: list[torch.Tensor], device: int) -> list[torch.Tensor]:
    """Declares each CPU tensor's storage as memory of ``device``."""
    for t in tensors:
        fake().device_tensor(device, t)
    return tensors


def engine_on_fake(
    layers: list[torch.Tensor],
    pool: Any,
    *,
    device: int = 0,
    devices: int = 1,
    cuda: TorchCuda | None = None,
    batch: bool = True,
    copy: str = "dma",
    kernel_max_run_bytes: int = 0,
    kernel_min_runs: int = 16,
    log_failures: bool = False,
    **kw: Any,
) -> TransferEngine:
    """A TransferEngine whose jobs run through the CUDA backend on the fake: ``layers`` (CPU
    tensors) are declared memory of ``device``; the engine plans against them as usual."""
    host_pool(pool)
    device_layers(layers, device)
    engine = TransferEngine(layers, pool, log_failures=log_failures, **kw)
    engine._backend.close()
    cuda = cuda if cuda is not None else TorchCuda(devices)
    engine._backend = CudaBackend(
        torch.device("cuda", device),
        pool,
        engine._layout,
        copy=copy,  # type: ignore[arg-type]
        kernel_max_run_bytes=kernel_max_run_bytes,
        kernel_min_runs=kernel_min_runs,
        kernel_programs=8,
        runtime=runtime(batch=batch),
        cuda=cuda,
        launcher=FakeLauncher(cuda, device),
    )
    return engine


def dma_settled(backend: CudaBackend) -> None:
    """Until every DMA queue's thread has put its jobs on its stream (a job leaves the
    queue's count only once its copies are enqueued)."""
    wait_until(
        lambda: all(q.queued() == 0 for q in backend._dma.values()),
        "the DMA threads enqueueing their jobs",
    )


def host_pool(pool: Any) -> Any:
    """``pool``, its memory known to the fake as host memory (a mapping may reuse the
    addresses of freed tensors the test had declared device memory)."""
    fake().forget(pool.address, pool.mapped_bytes)
    return pool


def pin(pool: Any, *, background: bool = False, device: int = 0) -> bool:
    """Registers ``pool`` with the fake, through the pool's real registration path."""
    host_pool(pool)
    return _cuda.register_pool(pool, runtime(), required=True, background=background, device=device)


class InterpretedLauncher:
    """The real Triton kernel under Triton's interpreter (``TRITON_INTERPRET=1``), on the
    fake's streams: the interpreter runs a kernel during its launch, on the CPU, reading the
    host addresses of the tensors and the pool, so the launch first lets its stream reach the
    launch point (everything the stream waits for: the queue's earlier DMA jobs, the caller's
    stream), as the GPU would before running it."""

    def __init__(self, cuda: TorchCuda, device: int) -> None:
        from kvcache.transfer._cuda_backend import TritonLauncher

        self._cuda = cuda
        self._device = device
        self._triton = TritonLauncher(torch.device("cpu"))  # tables stay in host memory
        self.launches = 0

    def launch(self, plan: Any, group: int, num_blocks: int, refs: Any, **kw: Any) -> Any:
        self._cuda.current_stream(self._device).synchronize()
        keep = self._triton.launch(plan, group, num_blocks, refs, **kw)
        self.launches += 1
        return keep


def scratch_on_fake(before: Any = None) -> Any:
    """A ``TransferEngine._scratch_engine`` (what the start-up self-check builds) whose
    engines run on the fake; ``before()`` runs before each is built (to inject a fault)."""

    def scratch(self: TransferEngine, layers: list[torch.Tensor], pool: Any, method: str) -> Any:
        if before is not None:
            before()
        return engine_on_fake(
            layers,
            pool,
            blocks_per_chunk=self._blocks_per_chunk,
            groups=self._group_refs,
            offsets=self._offsets,
        )

    return scratch
