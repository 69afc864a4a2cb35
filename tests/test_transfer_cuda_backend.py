"""The CUDA backend's bookkeeping without a GPU.

A fake CUDA runtime made of ctypes callbacks (real C function pointers, called by the Rust DMA
queues from their own threads exactly as they call ``cudaEventRecord``, ``cudaMemcpyAsync``,
``cuMemcpyBatchAsync`` and friends) executes copies as host memmoves and completes streams when
the test says so. Plans come from a CPU engine, so their addresses are real host memory and
both DMA paths' copies (argument order included) are checked byte for byte. What stays
untested here: real streams, real DMA, the Triton kernel on a GPU (test_transfer_kernel.py
runs the kernel under Triton's interpreter; bench/gpu_worker_check.py covers the GPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvcache import InvalidArgumentError
from kvcache.transfer import HostChunkPool, TransferEngine
from kvcache.transfer._cuda import (
    QUEUE_FUNCTIONS,
    SRC_ACCESS_ORDER_ANY,
    SRC_ACCESS_ORDER_STREAM,
    BatchCopy,
)
from kvcache.transfer._engine import _CudaBackend

C = ctypes
FN = {
    "cudaEventCreateWithFlags": C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_uint),
    "cudaEventDestroy": C.CFUNCTYPE(C.c_int, C.c_void_p),
    "cudaEventRecord": C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p),
    "cudaEventQuery": C.CFUNCTYPE(C.c_int, C.c_void_p),
    "cudaEventSynchronize": C.CFUNCTYPE(C.c_int, C.c_void_p),
    "cudaEventElapsedTime": C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_void_p),
    "cudaStreamWaitEvent": C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_uint),
    "cudaStreamSynchronize": C.CFUNCTYPE(C.c_int, C.c_void_p),
    "cudaMemcpyAsync": C.CFUNCTYPE(
        C.c_int, C.c_void_p, C.c_void_p, C.c_size_t, C.c_int, C.c_void_p
    ),
    "cudaSetDevice": C.CFUNCTYPE(C.c_int, C.c_int),
    "cudaGetLastError": C.CFUNCTYPE(C.c_int),
    "cudaGetErrorString": C.CFUNCTYPE(C.c_void_p, C.c_int),
}
BATCH = C.CFUNCTYPE(
    C.c_int,
    C.c_void_p,  # dsts
    C.c_void_p,  # srcs
    C.c_void_p,  # sizes
    C.c_size_t,  # count
    C.c_void_p,  # attrs
    C.c_void_p,  # attrsIdxs
    C.c_size_t,  # numAttrs
    C.c_void_p,  # failIdx
    C.c_void_p,  # stream
)
NOT_READY = 600
COMPUTE = 0x500  # the handle of the fake "current" stream


class FakeRuntime:
    """A CUDA runtime whose device runs a stream only when told (:meth:`complete`, or an event
    synchronisation), and whose copies are host memmoves at enqueue time."""

    host_register = host_unregister = get_last_error = 0

    def __init__(self, *, fail_copy: int | None = None, batch_fails: bool = False) -> None:
        self.lock = threading.Lock()
        self.fail_copy = fail_copy
        self.batch_fails = batch_fails
        self.copies: list[tuple[int, int, int, int]] = []  # (dst, src, size, stream)
        self.batches: list[tuple[int, int, int]] = []  # (count, src access order, stream)
        self.ops: dict[int, int] = {}  # stream -> operations enqueued
        self.done: dict[int, int] = {}  # stream -> operations completed
        self.events: dict[int, tuple[int, int] | None] = {}  # event -> (stream, op) recorded
        self.waits: list[tuple[int, int]] = []  # (stream, event recorded on which stream)
        self.devices: list[tuple[int, int]] = []  # (device, thread)
        self.last_error = 0
        self.cleared = 0
        self._names = {
            code: C.create_string_buffer(f"fake error {code}".encode()) for code in (1, 700, 999)
        }
        self._next = 0x9000
        self._callbacks = {name: FN[name](getattr(self, "_" + name)) for name in QUEUE_FUNCTIONS}
        self.queue_functions = {
            name: C.cast(cb, C.c_void_p).value for name, cb in self._callbacks.items()
        }
        self.memcpy_async = self.queue_functions["cudaMemcpyAsync"]
        self._batch_cb = BATCH(self._batch)
        self.batch = BatchCopy(C.cast(self._batch_cb, C.c_void_p).value, v2=False)

    # -- what the engine calls from Python ----------------------------------------------------

    def clear_error(self) -> int:
        self.cleared += 1
        err, self.last_error = self.last_error, 0
        return err

    def error_string(self, code: int) -> str:
        return f"fake error {code}"

    def driver_error_string(self, code: int) -> str:
        return f"fake driver error {code}"

    def device_pointer(self, host_address: int) -> int | None:
        return host_address

    # -- the device ------------------------------------------------------------------------------

    def _enqueue(self, stream: int) -> int:
        self.ops[stream] = self.ops.get(stream, 0) + 1
        return self.ops[stream]

    def complete(self, stream: int | None = None) -> None:
        """The device runs everything queued so far (on one stream, or all)."""
        with self.lock:
            for s in [stream] if stream is not None else list(self.ops):
                self.done[s] = self.ops.get(s, 0)

    # -- the runtime functions (called from Rust, any thread) --------------------------------------

    def _cudaEventCreateWithFlags(self, out: int, flags: int) -> int:
        with self.lock:
            self._next += 1
            self.events[self._next] = None
            C.c_void_p.from_address(out).value = self._next
        return 0

    def _cudaEventDestroy(self, ev: int) -> int:
        with self.lock:
            self.events.pop(ev, None)
        return 0

    def _cudaEventRecord(self, ev: int, stream: int | None) -> int:
        with self.lock:
            s = stream or 0
            self.events[ev] = (s, self._enqueue(s))
        return 0

    def _cudaEventQuery(self, ev: int) -> int:
        with self.lock:
            s, op = self.events[ev]
            return 0 if self.done.get(s, 0) >= op else NOT_READY

    def _cudaEventSynchronize(self, ev: int) -> int:
        with self.lock:
            s, op = self.events[ev]
            self.done[s] = max(self.done.get(s, 0), op)
        return 0

    def _cudaEventElapsedTime(self, out: int, start: int, end: int) -> int:
        with self.lock:
            C.c_float.from_address(out).value = float(self.events[end][1] - self.events[start][1])
        return 0

    def _cudaStreamWaitEvent(self, stream: int, ev: int, flags: int) -> int:
        with self.lock:
            self.waits.append((stream, self.events[ev][0]))
        return 0

    def _cudaStreamSynchronize(self, stream: int) -> int:
        self.complete(stream)
        return 0

    def _cudaMemcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> int:
        with self.lock:
            self.copies.append((dst, src, size, stream))
            if len(self.copies) == self.fail_copy:
                self.last_error = 700
                return 700
            self._enqueue(stream)
        C.memmove(dst, src, size)
        return 0

    def _cudaSetDevice(self, device: int) -> int:
        self.devices.append((device, threading.get_ident()))
        return 0

    def _cudaGetLastError(self) -> int:
        err, self.last_error = self.last_error, 0
        return err

    def _cudaGetErrorString(self, code: int) -> int:
        buf = self._names.get(code, self._names[999])
        return C.addressof(buf)

    def _batch(self, dsts, srcs, sizes, count, attrs, idxs, num_attrs, fail_idx, stream) -> int:
        order = C.c_int.from_address(attrs).value
        with self.lock:
            self.batches.append((count, order, stream or 0))
            assert num_attrs == 1
            assert C.c_size_t.from_address(idxs).value == 0
            if self.batch_fails:
                C.c_size_t.from_address(fail_idx).value = 0
                return 1  # CUDA_ERROR_INVALID_VALUE
            self._enqueue(stream)
        d = (C.c_uint64 * count).from_address(dsts)
        s = (C.c_uint64 * count).from_address(srcs)
        n = (C.c_size_t * count).from_address(sizes)
        for i in range(count):
            C.memmove(d[i], s[i], n[i])
        return 0


class FakeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


class FakeCuda:
    """The subset of ``torch.cuda`` the backend uses outside the Rust queues."""

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []

    def Stream(self, device: object) -> FakeStream:
        self.streams.append(FakeStream(0x1000 + len(self.streams)))
        return self.streams[-1]

    def current_stream(self, device: object) -> FakeStream:
        return FakeStream(COMPUTE)

    @contextlib.contextmanager
    def device(self, device: object) -> Iterator[None]:
        yield


def setup(
    rt: FakeRuntime, *, batch: Any = "auto"
) -> tuple[Any, HostChunkPool, TransferEngine, _CudaBackend, FakeCuda]:
    rng = np.random.default_rng(9)
    layers = [torch.from_numpy(rng.integers(0, 256, (32, 256), dtype=np.uint8)) for _ in range(2)]
    pool = HostChunkPool(16, 2 * 2 * 256, pin=False)
    planner = TransferEngine(layers, pool, blocks_per_chunk=2)  # host plans for the fake DMA
    cuda = FakeCuda()
    backend = _CudaBackend(
        torch.device("cuda", 3),
        pool,
        planner._layout,
        copy="dma",
        kernel_max_run_bytes=1 << 15,
        kernel_min_runs=16,
        kernel_programs=8,
        runtime=rt,
        cuda=cuda,
        batch=batch,
    )
    return layers, pool, planner, backend, cuda


def settle(backend: _CudaBackend) -> None:
    """Until every DMA queue's thread has put its jobs on the stream (bounded)."""
    for _ in range(4000):
        if all(q.queued() == 0 for q in backend._dma.values()):
            return
        threading.Event().wait(0.005)
    raise AssertionError("the DMA threads did not get to their jobs")


def plan(planner: TransferEngine, store: bool, blocks: list[int], chunks: list[int]) -> Any:
    return planner.plan(store=store, gpu_block_ids=blocks, chunk_ids=chunks)


def ids_ok(results: list[Any]) -> list[tuple[int, bool]]:
    return [(r.job_id, r.success) for r in results]


@pytest.mark.parametrize("batched", [True, False])
def test_dma_jobs_run_off_thread_in_stream_order_and_release_the_pool(batched: bool) -> None:
    rt = FakeRuntime()
    layers, pool, planner, backend, cuda = setup(rt, batch="auto" if batched else None)
    store_stream, _load_stream, _expedited_stream = (s.cuda_stream for s in cuda.streams[:3])
    backend.submit(0, plan(planner, True, [3, 4, 9, 1], [5, 2]), "store")
    backend.submit(1, plan(planner, True, [7, 8], [6]), "store")
    backend.wait(set())  # nothing to wait for: returns
    settle(backend)
    # The queue's thread selected the device and made its stream wait for the caller's
    # stream before copying (the submission point).
    assert rt.waits == [(store_stream, COMPUTE)] * 2
    assert {d for d, _ in rt.devices} == {3}
    assert threading.get_ident() not in {t for _, t in rt.devices}
    if batched:
        assert rt.copies == []
        assert [(o, s) for _, o, s in rt.batches] == [(SRC_ACCESS_ORDER_STREAM, store_stream)] * 2
    else:
        assert {c[3] for c in rt.copies} == {store_stream}
    # Chunk layout, byte for byte: the "DMA" ran with (dst, src) in the right order.
    host = pool.tensor()
    assert torch.equal(
        host[5], torch.cat([layers[0][[3, 4]].reshape(-1), layers[1][[3, 4]].reshape(-1)])
    )
    assert torch.equal(host[2][:256], layers[0][9])
    assert backend.collect() == []  # the device has not run the stream yet
    assert backend.in_flight() == 2
    with pytest.raises(RuntimeError, match="in flight"):
        pool.close()  # unfinished jobs hold the pool
    rt.complete(store_stream)
    results = backend.collect()
    assert ids_ok(results) == [(0, True), (1, True)]
    # Sizes as vLLM reports them, times from the events (fake milliseconds -> seconds).
    assert [r.nbytes for r in results] == [4 * 2 * 256, 2 * 2 * 256]
    assert all(r.seconds is not None and r.seconds > 0 for r in results)
    backend.submit(2, plan(planner, False, [30, 31], [5]), "load")
    backend.submit(3, plan(planner, False, [20, 21], [2]), "expedited")
    backend.wait({3})  # the expedited job alone: the regular load may still be pending
    got = ids_ok(backend.collect())
    assert (3, True) in got
    if batched:
        assert rt.batches[-1][1] == SRC_ACCESS_ORDER_ANY
    backend.wait(None)
    got += ids_ok(backend.collect())
    assert sorted(got) == [(2, True), (3, True)]
    assert torch.equal(layers[1][30], layers[1][3])
    assert torch.equal(layers[0][21], layers[0][1])
    del host
    backend.close()
    planner.close()
    pool.close()  # every lease was released


class NullRegistrar:
    """cudaHostRegister and friends that accept everything (a pool that counts as pinned)."""

    def __init__(self) -> None:
        reg = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_size_t, C.c_uint)(lambda p, n, f: 0)
        unreg = C.CFUNCTYPE(C.c_int, C.c_void_p)(lambda p: 0)
        last = C.CFUNCTYPE(C.c_int)(lambda: 0)
        self._keep = (reg, unreg, last)
        self.host_register, self.host_unregister, self.get_last_error = (
            C.cast(f, C.c_void_p).value for f in self._keep
        )

    def device_pointer(self, address: int) -> int:
        return address


@pytest.mark.parametrize("pinned", [True, False])
def test_failed_batch_falls_back_to_per_run_copies(
    caplog: pytest.LogCaptureFixture, pinned: bool
) -> None:
    from kvcache.transfer import _cuda

    rt = FakeRuntime(batch_fails=True)
    layers, pool, planner, backend, _cuda_fake = setup(rt)
    if pinned:
        assert _cuda.register_pool(pool, NullRegistrar(), required=True)
    scattered = plan(planner, True, [3, 9, 1, 20], [0, 7])
    runs = len(scattered)
    backend.submit(0, scattered, "store")
    backend.wait(None)
    assert len(rt.batches) == 1
    assert len(rt.copies) == runs == 8  # re-issued run by run
    backend.submit(1, plan(planner, True, [5, 6], [1]), "store")
    backend.wait(None)
    # Pinned or pageable, the memory will not change (no background pinning is running): the
    # queue stops batching. (Only while pinning runs does the next job try again.)
    assert len(rt.batches) == 1
    with caplog.at_level(logging.WARNING):
        assert ids_ok(backend.collect()) == [(0, True), (1, True)]
    assert any("cuMemcpyBatchAsync failed" in r.getMessage() for r in caplog.records)
    assert torch.equal(pool.tensor()[7][:256], layers[0][1])
    backend.close()
    planner.close()
    pool.close()


def test_failed_dma_reports_failure_with_its_cause_once_the_stream_is_done() -> None:
    rt = FakeRuntime(fail_copy=2)
    _layers, pool, planner, backend, _cuda = setup(rt, batch=None)
    backend.submit(0, plan(planner, True, [3, 9, 1, 20], [0, 7]), "store")
    settle(backend)
    assert backend.collect() == []  # not before the stream has drained
    rt.complete()
    backend.wait(None)
    (result,) = backend.collect()
    assert (result.job_id, result.success, result.store) == (0, False, True)
    assert result.error is not None
    assert "fake error 700" in result.error
    assert "after 1 of 8 runs" in result.error
    backend.close()
    planner.close()
    pool.close()


def test_engine_logs_a_failure_with_job_direction_and_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt = FakeRuntime(fail_copy=1)
    _layers, pool, planner, backend, _cuda = setup(rt, batch=None)
    planner._backend.close()
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
    with HostChunkPool(4, 64, pin=False) as pool:
        planner = TransferEngine([torch.zeros(4, 64, dtype=torch.uint8)], pool)
        with pytest.raises(InvalidArgumentError, match="pin"):
            _CudaBackend(
                torch.device("cuda", 0),
                pool,
                planner._layout,
                copy="kernel",
                kernel_max_run_bytes=1 << 15,
                kernel_min_runs=16,
                kernel_programs=8,
                runtime=rt,
                cuda=FakeCuda(),
            )
        planner.close()


def test_stores_use_dma_and_loads_with_small_runs_the_kernel() -> None:
    """The method choice alone (no launch): with a kernel-ready pool, stores stay on DMA; loads
    take the kernel when their DMA runs after coalescing would be small and there are enough
    pages, whatever the page size."""
    rt = FakeRuntime()
    _layers, pool, planner, backend, _cuda = setup(rt)
    backend._copy = "auto"
    backend._triton = True
    backend._pool_kernel_ready = lambda: True  # type: ignore[method-assign]
    backend._kernel_min_runs = 2
    backend.kernel_max_run_bytes = 1024
    scattered = list(range(0, 16, 2))
    p = plan(planner, True, scattered, [0, 1, 2, 3])
    assert not backend._use_kernel(p)
    p = plan(planner, False, scattered, [0, 1, 2, 3])
    assert backend._use_kernel(p)
    # Consecutive ids: each chunk's two blocks coalesce per layer into 512-byte runs, still
    # small; a cut-off of 256 bytes sends them to DMA, while scattered 256-byte pages would
    # still take the kernel.
    fresh = list(range(8))
    fresh_plan = plan(planner, False, fresh, [0, 1, 2, 3])
    assert fresh_plan.nbytes / fresh_plan.max_runs == 512
    assert fresh_plan.max_runs == len(fresh_plan)
    assert p.nbytes / p.max_runs == 256
    backend.kernel_max_run_bytes = 256
    assert not backend._use_kernel(fresh_plan)
    assert backend._use_kernel(plan(planner, False, scattered, [0, 1, 2, 3]))
    backend.kernel_max_run_bytes = 128  # pages of 256 bytes are now "large"
    assert not backend._use_kernel(p)
    del p, fresh_plan  # a plan holds the pool
    backend.close()
    planner.close()
    pool.close()


def test_kernel_copy_waits_for_background_pinning() -> None:
    """copy='kernel' with a pool still pinning in the background is accepted: jobs use DMA
    until the pinning has finished, then the kernel. A pool never pinned is refused."""
    pytest.importorskip("triton")
    from kvcache.transfer import _cuda

    gate = threading.Event()
    rt = FakeRuntime()
    registrar = NullRegistrar()
    slow = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_size_t, C.c_uint)(
        lambda p, n, f: 0 if gate.wait(10.0) else 1
    )
    registrar.host_register = C.cast(slow, C.c_void_p).value
    layers = [torch.zeros(32, 256, dtype=torch.uint8) for _ in range(2)]
    pool = HostChunkPool(16, 2 * 2 * 256, pin=False)
    planner = TransferEngine(layers, pool, blocks_per_chunk=2)
    assert _cuda.register_pool(pool, registrar, required=False, background=True, device=0)
    assert pool.pin_status()["state"] == "pinning"
    backend = _CudaBackend(
        torch.device("cuda", 0),
        pool,
        planner._layout,
        copy="kernel",
        kernel_max_run_bytes=None,
        kernel_min_runs=16,
        kernel_programs=8,
        runtime=rt,
        cuda=FakeCuda(),
    )
    ids = list(range(0, 16, 2))
    assert not backend._use_kernel(plan(planner, False, ids, [0, 1, 2, 3]))
    gate.set()
    assert pool.wait_pinned(10.0)["state"] == "pinned"
    assert backend._use_kernel(plan(planner, False, ids, [0, 1, 2, 3]))
    assert backend._use_kernel(plan(planner, True, ids, [0, 1, 2, 3]))
    backend.close()
    planner.close()
    pool.close()
    del slow


class CorruptingRuntime(FakeRuntime):
    """Copies every run, then flips one byte of the first run's destination: a DMA path
    that reports success but moves wrong bytes."""

    def _cudaMemcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> int:
        rc = super()._cudaMemcpyAsync(dst, src, size, kind, stream)
        if len(self.copies) == 1:
            byte = C.c_uint8.from_address(dst)
            byte.value ^= 0x5A
        return rc


def fake_cuda_engine(rt: FakeRuntime, layers: list[torch.Tensor], pool: Any, **kw: Any) -> Any:
    """A TransferEngine whose jobs go through the CUDA backend over the fake runtime (its plans
    address the CPU tensors, so the fake's memmoves are real copies)."""
    engine = TransferEngine(layers, pool, log_failures=False, **kw)
    engine._backend.close()
    engine._backend = _CudaBackend(
        torch.device("cuda", 0),
        pool,
        engine._layout,
        copy="dma",
        kernel_max_run_bytes=0,
        kernel_min_runs=16,
        kernel_programs=8,
        runtime=rt,
        cuda=FakeCuda(),
        batch=None,
    )
    return engine


def scratch_over(rt_factory: Any) -> Any:
    """A ``TransferEngine._scratch_engine`` building fake-CUDA engines with ``rt_factory()``."""

    def scratch(self: TransferEngine, layers: list[torch.Tensor], pool: Any, method: str) -> Any:
        return fake_cuda_engine(
            rt_factory(),
            layers,
            pool,
            blocks_per_chunk=self._blocks_per_chunk,
            groups=self._group_refs,
            offsets=self._offsets,
        )

    return scratch


@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_self_check_passes_on_honest_copies_and_names_corruption(
    monkeypatch: pytest.MonkeyPatch, bpc: int
) -> None:
    """The start-up round trip through the DMA path: honest copies pass; one flipped byte is
    found and named, with no live block or pool chunk touched."""
    rng = np.random.default_rng(3)
    # Two groups sharing tensor 1, a padded reference (200 of 256 bytes).
    layers = [torch.from_numpy(rng.integers(0, 256, (16, 256), dtype=np.uint8)) for _ in range(3)]
    groups = [[(0, 256), (1, 256)], [(1, 256), (2, 200)]]
    chunk = 3 * 256 * bpc
    pool = HostChunkPool(8, chunk, pin=False)
    before = [t.clone() for t in layers]
    engine = TransferEngine(layers, pool, blocks_per_chunk=bpc, groups=groups)
    monkeypatch.setattr(TransferEngine, "_scratch_engine", scratch_over(FakeRuntime))
    assert engine.self_check() is None
    monkeypatch.setattr(TransferEngine, "_scratch_engine", scratch_over(CorruptingRuntime))
    cause = engine.self_check()
    assert cause is not None
    assert "store wrote wrong bytes" in cause
    assert all(torch.equal(a, b) for a, b in zip(layers, before, strict=True))
    assert not any(bytes(memoryview(pool)))

    class DroppingRuntime(FakeRuntime):
        """Reports success but copies nothing."""

        def _cudaMemcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> int:
            with self.lock:
                self.copies.append((dst, src, size, stream))
                self._enqueue(stream)
            return 0

    runtimes = iter([FakeRuntime(), DroppingRuntime()])  # the store's engine, then the load's
    monkeypatch.setattr(TransferEngine, "_scratch_engine", scratch_over(lambda: next(runtimes)))
    cause = engine.self_check()
    assert cause is not None
    assert "load wrote wrong bytes" in cause

    def broken(*args: Any) -> Any:
        raise RuntimeError("no scratch memory")

    monkeypatch.setattr(TransferEngine, "_scratch_engine", broken)
    assert engine.self_check() == "RuntimeError: no scratch memory"
    engine.close()
    pool.close()


def test_self_check_runs_on_the_cpu_copier() -> None:
    layers = [torch.arange(8 * 64, dtype=torch.int32).reshape(8, 64)]
    pool = HostChunkPool(4, 2 * 256, pin=False)
    with pool, TransferEngine(layers, pool, blocks_per_chunk=2) as engine:
        assert engine.self_check() is None


class HoldingRuntime(FakeRuntime):
    """Copies enqueued on stream ``held`` wait inside the runtime call until ``release`` is
    set: that stream's DMA queue thread is stuck in the middle of a job, as behind a long
    transfer."""

    def __init__(self) -> None:
        super().__init__()
        self.held: int | None = None
        self.holding = threading.Event()  # a copy is being held
        self.release = threading.Event()

    def _cudaMemcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> int:
        if stream == self.held:
            self.holding.set()
            self.release.wait(30.0)
        return super()._cudaMemcpyAsync(dst, src, size, kind, stream)


def test_an_expedited_load_overtakes_a_regular_load_held_in_flight() -> None:
    """A regular load's queue is stuck in its copies; an expedited load submitted after it
    still runs on its own queue thread and stream, and is reported first. Were both on one
    queue, the expedited load would wait behind the held one and never be reported here."""
    rt = HoldingRuntime()
    rng = np.random.default_rng(11)
    layers = [torch.from_numpy(rng.integers(0, 256, (32, 256), dtype=np.uint8)) for _ in range(2)]
    pool = HostChunkPool(8, 2 * 256, pin=False)
    engine = fake_cuda_engine(rt, layers, pool)
    backend = engine._backend
    try:
        store = engine.store([0, 1], [0, 1])
        engine.wait([store])
        assert [(r.job_id, r.success) for r in engine.poll_results()] == [(store, True)]
        rt.held = backend._streams["load"].cuda_stream
        regular = engine.load([0], [10])
        assert rt.holding.wait(10.0), "the regular load never reached its copies"
        expedited = engine.load([1], [11], expedited=True)
        got: list[Any] = []
        for _ in range(2000):  # bounded: a misrouted expedited load must fail, not hang
            rt.complete(backend._streams["expedited"].cuda_stream)
            got = engine.poll_results()
            if got:
                break
            threading.Event().wait(0.005)
        assert [(r.job_id, r.success) for r in got] == [(expedited, True)]
        assert all(torch.equal(t[11], t[1]) for t in layers)
        assert engine.in_flight == 1  # the regular load, still held
        assert not torch.equal(layers[0][10], layers[0][0])
        rt.release.set()
        engine.wait([regular])
        assert [(r.job_id, r.success) for r in engine.poll_results()] == [(regular, True)]
        assert all(torch.equal(t[10], t[0]) for t in layers)
    finally:
        rt.release.set()
        engine.close()
        pool.close()


def test_jobs_by_method_counts_the_method_each_job_was_handed() -> None:
    """The per-method job counts (what bench/gpu_worker_check.py labels its rows with) follow
    the choice submit makes, kernel or DMA, not the job's shape."""
    rt = FakeRuntime()
    layers, pool, planner, backend, _cuda = setup(rt)
    launched: list[Any] = []
    backend._use_kernel = lambda p: not p.store  # type: ignore[method-assign]
    backend._submit_kernel = lambda job_id, p, q: launched.append(p)  # type: ignore[method-assign]
    backend.submit(0, plan(planner, True, [3, 4], [5]), "store")
    backend.submit(1, plan(planner, False, [20, 21], [5]), "expedited")
    assert backend.jobs_by_method == {"dma": 1, "kernel": 1}
    assert len(launched) == 1
    launched.pop().release()  # the stand-in launch ran nothing
    real, planner._backend = planner._backend, backend
    assert planner.jobs_by_method == {"dma": 1, "kernel": 1}
    planner._backend = real
    with TransferEngine(layers, pool, blocks_per_chunk=2) as cpu:
        assert cpu.jobs_by_method == {"cpu": 0}
    settle(backend)
    rt.complete()
    assert [r.job_id for r in backend.collect()] == [0]  # releases the store's lease
    backend.close()
    planner.close()
    pool.close()
