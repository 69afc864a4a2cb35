"""The CUDA backend's bookkeeping without a GPU.

A stand-in for ``torch.cuda`` provides streams and events whose completion the test controls,
and the "cudaMemcpyAsync" handed to Rust is a ctypes callback that copies host memory. Plans
come from a CPU engine, so their addresses are real host memory and the DMA path's copies
(argument order included) can be checked byte for byte. What stays untested here: real
streams, real DMA, the Triton kernel on a GPU (see test_transfer_kernel.py for the kernel
under the interpreter).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvcache.transfer import HostChunkPool, TransferEngine
from kvcache.transfer._cuda import MEMCPY_DEFAULT
from kvcache.transfer._engine import _CudaBackend

MEMCPY = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
)


class FakeRuntime:
    """``cudaMemcpyAsync`` as a host memmove; fails the ``fail_on``-th call with code 700."""

    host_register = host_unregister = get_last_error = 0

    def __init__(self, *, fail_on: int | None = None) -> None:
        self.fail_on = fail_on
        self.calls: list[tuple[int, int, int, int, int]] = []
        self.cleared = 0
        self._memcpy = MEMCPY(self._do_memcpy)
        self.memcpy_async = ctypes.cast(self._memcpy, ctypes.c_void_p).value

    def _do_memcpy(self, dst: int, src: int, size: int, kind: int, stream: int) -> int:
        self.calls.append((dst, src, size, kind, stream or 0))
        if len(self.calls) == self.fail_on:
            return 700
        ctypes.memmove(dst, src, size)
        return 0

    def clear_error(self) -> int:
        self.cleared += 1
        return 0

    def error_string(self, code: int) -> str:
        return f"fake error {code}"

    def device_pointer(self, host_address: int) -> int | None:
        return host_address


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.fail = False

    def record(self, stream: FakeStream) -> None:
        stream.events.append(self)

    def query(self) -> bool:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.done

    def synchronize(self) -> None:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.done = True


class FakeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle
        self.events: list[FakeEvent] = []
        self.waited = 0
        self.synchronized = 0
        self.fail_wait = False

    def wait_stream(self, other: object) -> None:
        if self.fail_wait:
            raise RuntimeError("CUDA error: launch failure")
        self.waited += 1

    def synchronize(self) -> None:
        self.synchronized += 1


class FakeCuda:
    """The subset of ``torch.cuda`` the backend uses."""

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []
        self.Event = FakeEvent

    def Stream(self, device: object) -> FakeStream:
        self.streams.append(FakeStream(0x1000 + len(self.streams)))
        return self.streams[-1]

    def current_stream(self, device: object) -> str:
        return "compute"

    @contextlib.contextmanager
    def device(self, device: object) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def stream(self, stream: object) -> Iterator[None]:
        yield


def setup(rt: FakeRuntime) -> tuple[Any, HostChunkPool, TransferEngine, Any, FakeCuda]:
    rng = np.random.default_rng(9)
    layers = [torch.from_numpy(rng.integers(0, 256, (32, 256), dtype=np.uint8)) for _ in range(2)]
    pool = HostChunkPool(16, 2 * 2 * 256, pin=False)
    planner = TransferEngine(layers, pool, blocks_per_chunk=2)  # host plans for the fake DMA
    cuda = FakeCuda()
    backend = _CudaBackend(
        torch.device("cuda", 0),
        pool,
        copy="dma",
        kernel_max_run_bytes=1 << 15,
        kernel_min_runs=16,
        kernel_programs=8,
        runtime=rt,
        cuda=cuda,
    )
    return layers, pool, planner, backend, cuda


def test_dma_jobs_complete_in_stream_order_and_release_the_pool() -> None:
    rt = FakeRuntime()
    layers, pool, planner, backend, cuda = setup(rt)
    store_stream, load_stream = cuda.streams
    blocks, chunks = [3, 4, 9, 1], [5, 2]
    backend.submit(0, planner.plan(store=True, gpu_block_ids=blocks, chunk_ids=chunks), store=True)
    backend.submit(1, planner.plan(store=True, gpu_block_ids=[7, 8], chunk_ids=[6]), store=True)
    assert store_stream.waited == 2  # each job waited for the current stream first
    assert {c[3] for c in rt.calls} == {MEMCPY_DEFAULT}
    assert {c[4] for c in rt.calls} == {store_stream.cuda_stream}
    # Chunk layout, byte for byte: the "DMA" ran with (dst, src) in the right order.
    host = pool.tensor()
    assert torch.equal(
        host[5], torch.cat([layers[0][[3, 4]].reshape(-1), layers[1][[3, 4]].reshape(-1)])
    )
    assert torch.equal(host[2][:256], layers[0][9])
    assert backend.collect() == []
    assert backend.in_flight() == 2
    with pytest.raises(RuntimeError, match="in flight"):
        pool.close()  # unfinished jobs hold the pool
    store_stream.events[1].done = True  # the later event alone cannot be reported first
    assert backend.collect() == []
    store_stream.events[0].done = True
    assert backend.collect() == [(0, True), (1, True)]
    backend.submit(2, planner.plan(store=False, gpu_block_ids=[30, 31], chunk_ids=[5]), store=False)
    assert load_stream.waited == 1
    backend.wait({2})
    assert backend.collect() == [(2, True)]
    assert torch.equal(layers[1][30], layers[1][3])
    del host
    planner.close()
    pool.close()  # every lease was released


def test_failed_dma_reports_false_and_clears_the_error(caplog: pytest.LogCaptureFixture) -> None:
    rt = FakeRuntime(fail_on=2)
    _layers, pool, planner, backend, _cuda = setup(rt)
    scattered = planner.plan(store=True, gpu_block_ids=[3, 9, 1, 20], chunk_ids=[0, 7])
    with caplog.at_level(logging.ERROR):
        backend.submit(0, scattered, store=True)
    assert len(rt.calls) == 2
    assert rt.cleared == 1
    assert any("fake error 700" in r.getMessage() for r in caplog.records)
    backend.wait(None)
    assert backend.collect() == [(0, False)]
    planner.close()
    pool.close()


def test_device_errors_and_submission_errors_report_false() -> None:
    rt = FakeRuntime()
    _layers, pool, planner, backend, cuda = setup(rt)
    store_stream = cuda.streams[0]
    backend.submit(0, planner.plan(store=True, gpu_block_ids=[1, 2], chunk_ids=[0]), store=True)
    store_stream.events[0].fail = True  # e.g. a sticky error surfacing at query time
    assert backend.collect() == [(0, False)]
    store_stream.fail_wait = True
    backend.submit(1, planner.plan(store=True, gpu_block_ids=[3, 4], chunk_ids=[1]), store=True)
    assert store_stream.synchronized == 1  # drained before the job's memory can be reused
    assert backend.collect() == [(1, False)]
    store_stream.fail_wait = False
    backend.submit(2, planner.plan(store=True, gpu_block_ids=[5, 6], chunk_ids=[2]), store=True)
    store_stream.events[-1].fail = True
    backend.wait(None)
    assert backend.collect() == [(2, False)]
    planner.close()
    pool.close()


def test_kernel_needs_a_pinned_pool() -> None:
    rt = FakeRuntime()
    with HostChunkPool(4, 64, pin=False) as pool, pytest.raises(ValueError, match="pinned"):
        _CudaBackend(
            torch.device("cuda", 0),
            pool,
            copy="kernel",
            kernel_max_run_bytes=1 << 15,
            kernel_min_runs=16,
            kernel_programs=8,
            runtime=rt,
            cuda=FakeCuda(),
        )
