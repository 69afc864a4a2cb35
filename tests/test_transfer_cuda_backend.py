"""The CUDA backend's bookkeeping without a GPU.

A stand-in for ``torch.cuda`` provides streams and events whose completion the test controls;
``cudaMemcpyAsync`` and ``cuMemcpyBatchAsync`` handed to Rust are ctypes callbacks that copy
host memory. Plans come from a CPU engine, so their addresses are real host memory and both DMA
paths' copies (argument order included) can be checked byte for byte. What stays untested here:
real streams, real DMA, the Triton kernel on a GPU (see test_transfer_kernel.py for the kernel
under the interpreter, and bench/gpu_worker_check.py for the GPU).
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

from kvcache import InvalidArgumentError
from kvcache.transfer import HostChunkPool, TransferEngine
from kvcache.transfer._cuda import (
    MEMCPY_DEFAULT,
    SRC_ACCESS_ORDER_ANY,
    SRC_ACCESS_ORDER_STREAM,
    BatchCopy,
)
from kvcache.transfer._engine import _CudaBackend

MEMCPY = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
)
BATCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,  # dsts
    ctypes.c_void_p,  # srcs
    ctypes.c_void_p,  # sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # attrs
    ctypes.c_void_p,  # attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # failIdx
    ctypes.c_void_p,  # stream
)


class FakeRuntime:
    """``cudaMemcpyAsync`` and ``cuMemcpyBatchAsync`` as host memmoves; the ``fail_on``-th
    per-run call fails with code 700, a batch fails when ``batch_fails``."""

    host_register = host_unregister = get_last_error = 0

    def __init__(self, *, fail_on: int | None = None, batch_fails: bool = False) -> None:
        self.fail_on = fail_on
        self.batch_fails = batch_fails
        self.calls: list[tuple[int, int, int, int, int]] = []
        self.batches: list[tuple[int, int, int]] = []  # (count, src access order, stream)
        self.cleared = 0
        self._memcpy = MEMCPY(self._do_memcpy)
        self._batch_fn = BATCH(self._do_batch)
        self.memcpy_async = ctypes.cast(self._memcpy, ctypes.c_void_p).value
        self.batch = BatchCopy(ctypes.cast(self._batch_fn, ctypes.c_void_p).value, v2=False)

    def _do_memcpy(self, dst: int, src: int, size: int, kind: int, stream: int) -> int:
        self.calls.append((dst, src, size, kind, stream or 0))
        if len(self.calls) == self.fail_on:
            return 700
        ctypes.memmove(dst, src, size)
        return 0

    def _do_batch(self, dsts, srcs, sizes, count, attrs, idxs, num_attrs, fail_idx, stream) -> int:
        order = ctypes.c_int.from_address(attrs).value
        self.batches.append((count, order, stream or 0))
        assert num_attrs == 1
        assert ctypes.c_size_t.from_address(idxs).value == 0
        if self.batch_fails:
            ctypes.c_size_t.from_address(fail_idx).value = 0
            return 1  # CUDA_ERROR_INVALID_VALUE
        d = (ctypes.c_uint64 * count).from_address(dsts)
        s = (ctypes.c_uint64 * count).from_address(srcs)
        n = (ctypes.c_size_t * count).from_address(sizes)
        for i in range(count):
            ctypes.memmove(d[i], s[i], n[i])
        return 0

    def clear_error(self) -> int:
        self.cleared += 1
        return 0

    def error_string(self, code: int) -> str:
        return f"fake error {code}"

    def driver_error_string(self, code: int) -> str:
        return f"fake driver error {code}"

    def device_pointer(self, host_address: int) -> int | None:
        return host_address


class FakeEvent:
    def __init__(self, *, enable_timing: bool = False) -> None:
        self.timing = enable_timing
        self.done = False
        self.fail = False
        self.at = 0.0

    def record(self, stream: FakeStream) -> None:
        stream.events.append(self)
        self.at = float(len(stream.events))

    def query(self) -> bool:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.done

    def synchronize(self) -> None:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.timing
        assert end.timing
        return end.at - self.at  # milliseconds


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

    def end_events(self) -> list[FakeEvent]:
        return self.events[1::2]


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


def setup(
    rt: FakeRuntime, *, batch: Any = "auto"
) -> tuple[Any, HostChunkPool, TransferEngine, Any, FakeCuda]:
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
        batch=batch,
    )
    return layers, pool, planner, backend, cuda


def plan(planner: TransferEngine, store: bool, blocks: list[int], chunks: list[int]) -> Any:
    return planner.plan(store=store, gpu_block_ids=blocks, chunk_ids=chunks)


def ids_ok(results: list[Any]) -> list[tuple[int, bool]]:
    return [(r.job_id, r.success) for r in results]


@pytest.mark.parametrize("batched", [True, False])
def test_dma_jobs_complete_in_stream_order_and_release_the_pool(batched: bool) -> None:
    rt = FakeRuntime()
    layers, pool, planner, backend, cuda = setup(rt, batch="auto" if batched else None)
    store_stream, load_stream, expedited_stream = cuda.streams
    blocks, chunks = [3, 4, 9, 1], [5, 2]
    backend.submit(0, plan(planner, True, blocks, chunks), "store")
    backend.submit(1, plan(planner, True, [7, 8], [6]), "store")
    assert store_stream.waited == 2  # each job waited for the current stream first
    if batched:
        # One batched call per job, in stream order, reading the live KV in stream order.
        assert rt.calls == []
        assert [(o, s) for _, o, s in rt.batches] == [
            (SRC_ACCESS_ORDER_STREAM, store_stream.cuda_stream)
        ] * 2
    else:
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
    store_stream.end_events()[1].done = True  # the later event alone cannot be reported first
    assert backend.collect() == []
    store_stream.end_events()[0].done = True
    results = backend.collect()
    assert ids_ok(results) == [(0, True), (1, True)]
    # Sizes as vLLM reports them, times from the events (fake milliseconds -> seconds).
    assert [r.nbytes for r in results] == [4 * 2 * 256, 2 * 2 * 256]
    assert all(r.seconds is not None and r.seconds > 0 for r in results)
    backend.submit(2, plan(planner, False, [30, 31], [5]), "load")
    backend.submit(3, plan(planner, False, [20, 21], [2]), "expedited")
    assert (load_stream.waited, expedited_stream.waited) == (1, 1)
    if batched:
        assert rt.batches[-1][1:] == (SRC_ACCESS_ORDER_ANY, expedited_stream.cuda_stream)
    # The expedited job is reported without waiting for the regular load.
    expedited_stream.end_events()[0].done = True
    assert ids_ok(backend.collect()) == [(3, True)]
    backend.wait({2})
    assert ids_ok(backend.collect()) == [(2, True)]
    assert torch.equal(layers[1][30], layers[1][3])
    assert torch.equal(layers[0][21], layers[0][1])
    del host
    planner.close()
    pool.close()  # every lease was released


def test_failed_batch_falls_back_to_per_run_copies(caplog: pytest.LogCaptureFixture) -> None:
    rt = FakeRuntime(batch_fails=True)
    layers, pool, planner, backend, _cuda = setup(rt)
    scattered = plan(planner, True, [3, 9, 1, 20], [0, 7])
    with caplog.at_level(logging.WARNING):
        backend.submit(0, scattered, "store")
    assert len(rt.batches) == 1
    assert len(rt.calls) == len(scattered) == 8
    assert rt.cleared == 1
    assert any("cuMemcpyBatchAsync failed" in r.getMessage() for r in caplog.records)
    backend.submit(1, plan(planner, True, [5, 6], [1]), "store")
    assert len(rt.batches) == 1  # later jobs go straight to the per-run path
    backend.wait(None)
    assert ids_ok(backend.collect()) == [(0, True), (1, True)]
    assert torch.equal(pool.tensor()[7][:256], layers[0][1])
    planner.close()
    pool.close()


def test_failed_dma_reports_failure_with_its_cause() -> None:
    rt = FakeRuntime(fail_on=2)
    _layers, pool, planner, backend, _cuda = setup(rt, batch=None)
    backend.submit(0, plan(planner, True, [3, 9, 1, 20], [0, 7]), "store")
    assert len(rt.calls) == 2
    assert rt.cleared == 1
    backend.wait(None)
    (result,) = backend.collect()
    assert (result.job_id, result.success, result.store) == (0, False, True)
    assert result.error is not None
    assert "fake error 700" in result.error
    assert "after 1 of 8 runs" in result.error
    planner.close()
    pool.close()


def test_device_errors_and_submission_errors_report_failure() -> None:
    rt = FakeRuntime()
    _layers, pool, planner, backend, cuda = setup(rt)
    store_stream = cuda.streams[0]
    backend.submit(0, plan(planner, True, [1, 2], [0]), "store")
    store_stream.end_events()[0].fail = True  # e.g. a sticky error surfacing at query time
    (r0,) = backend.collect()
    assert not r0.success
    assert "illegal memory access" in r0.error
    store_stream.fail_wait = True
    backend.submit(1, plan(planner, True, [3, 4], [1]), "store")
    assert store_stream.synchronized == 1  # drained before the job's memory can be reused
    (r1,) = backend.collect()
    assert not r1.success
    assert "launch failure" in r1.error
    store_stream.fail_wait = False
    backend.submit(2, plan(planner, True, [5, 6], [2]), "store")
    store_stream.end_events()[-1].fail = True
    backend.wait(None)
    (r2,) = backend.collect()
    assert not r2.success
    planner.close()
    pool.close()


def test_engine_logs_a_failure_with_job_direction_and_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt = FakeRuntime(fail_on=1)
    _layers, pool, planner, backend, _cuda = setup(rt, batch=None)
    planner._backend = backend  # drive the engine's bookkeeping over the fake CUDA backend
    with caplog.at_level(logging.ERROR):
        job = planner.load([3], [10, 11])
        planner.wait([job])
        assert planner.poll() == [(job, False)]
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    message = record.getMessage()
    assert f"job {job}" in message
    assert "load, host -> device" in message
    assert "fake error 700" in message
    planner.close()
    pool.close()


def test_kernel_needs_a_pinned_pool() -> None:
    rt = FakeRuntime()
    with HostChunkPool(4, 64, pin=False) as pool, pytest.raises(InvalidArgumentError, match="pin"):
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


def test_stores_use_dma_and_small_loads_the_kernel() -> None:
    """The method choice alone (no launch): with a kernel-ready pool, stores stay on DMA, loads
    take the kernel when their average run is small and there are enough runs."""
    rt = FakeRuntime()
    _layers, pool, planner, backend, _cuda = setup(rt)
    backend._copy = "auto"
    backend._triton = True
    backend._pool_kernel_ready = lambda: True  # type: ignore[method-assign]
    backend._kernel_min_runs = 2
    backend.kernel_max_run_bytes = 1024
    scattered = list(range(0, 16, 2))
    assert not backend._use_kernel(plan(planner, True, scattered, [0, 1, 2, 3]))
    assert backend._use_kernel(plan(planner, False, scattered, [0, 1, 2, 3]))
    backend.kernel_max_run_bytes = 128  # runs of 256 bytes are now "large"
    assert not backend._use_kernel(plan(planner, False, scattered, [0, 1, 2, 3]))
    planner.close()
    pool.close()
