"""The CUDA backend on a fake CUDA that behaves like CUDA (``tests/support/fakecuda``).

The fake is a C library exporting CUDA's own names and signatures; kvcache loads it by path
exactly as it loads the real runtime and driver (``_core.CudaApi``), so the Rust DMA queues,
the pool's registration and the batched copy go through the very declarations the real
libraries do. Like CUDA, it runs each stream later, on a thread of its own, in enqueue order;
enforces events and stream waits; keeps the current device and the last error per thread;
tells registered from pageable memory (pageable copies are synchronous, the copy kernel faults
on them); can fail a batched call as a whole or at an index; makes a fault sticky; and faults an
8-byte access at a misaligned address. Device memory is CPU memory declared as a device's, so
every byte moved is compared with torch indexing.

What stays untested here: real streams, DMA engines and the Triton kernel on a GPU (the
kernel's own arithmetic runs under Triton's interpreter in test_worker_kernel_conformance.py;
``gpu/check.py`` covers the GPU).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvcache import InvalidArgumentError, TransferError
from kvcache.transfer import HostChunkPool, TransferEngine
from kvcache.transfer._cuda import SRC_ACCESS_ORDER_ANY, SRC_ACCESS_ORDER_STREAM
from tests.support.fakecuda import ILLEGAL_ADDRESS
from tests.support.fakecuda.shim import TorchCuda, dma_settled, engine_on_fake, fake, pin
from tests.support.waiting import HANG_S, wait_until

PAGE = 256


@pytest.fixture(autouse=True)
def fresh_fake() -> Iterator[None]:
    """Every test starts on a reset fake with two devices."""
    fake().reset(2)
    yield
    fake().reset(2)


def kv(seed: int, blocks: int = 32, page: int = PAGE, layers: int = 2) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [
        torch.from_numpy(rng.integers(0, 256, (blocks, page), dtype=np.uint8))
        for _ in range(layers)
    ]


def settle(engine: TransferEngine) -> None:
    dma_settled(engine._backend)


def results(engine: TransferEngine) -> list[tuple[int, bool]]:
    return [(r.job_id, r.success) for r in engine.poll_results()]


def chunk_bytes(layers: list[torch.Tensor], blocks: list[int]) -> torch.Tensor:
    """A chunk's expected bytes: per layer, the blocks' pages back to back."""
    return torch.cat([t[blocks].reshape(-1) for t in layers])


@pytest.mark.parametrize("batched", [True, False])
def test_dma_runs_later_on_its_stream_in_order_and_releases_the_pool(batched: bool) -> None:
    layers = kv(9)
    pool = HostChunkPool(16, 2 * 2 * PAGE, pin=False)
    pin(pool)
    engine = engine_on_fake(layers, pool, batch=batched, blocks_per_chunk=2)
    backend = engine._backend
    store_stream = backend._streams["store"].cuda_stream
    gate = fake().stream_gate(store_stream)  # the device has not reached the store queue
    a = engine.store([3, 4, 9, 1], [5, 2])
    b = engine.store([7, 8], [6])
    settle(engine)
    host = pool.tensor()
    assert not host.any(), "copies ran at enqueue time"
    assert results(engine) == []
    assert engine.in_flight == 2
    with pytest.raises(TransferError, match="in flight"):
        pool.close()  # unfinished jobs hold the pool
    fake().gate_open(gate)
    engine.wait([a, b])
    got = engine.poll_results()
    assert [(r.job_id, r.success) for r in got] == [(a, True), (b, True)]
    assert [r.nbytes for r in got] == [4 * 2 * PAGE, 2 * 2 * PAGE]
    assert all(r.seconds is not None and r.seconds > 0 for r in got)
    assert torch.equal(host[5], chunk_bytes(layers, [3, 4]))
    assert torch.equal(host[2][:PAGE], layers[0][9])
    # Loads on their queues: the regular and the expedited one.
    c = engine.load([5], [30, 31])
    d = engine.load([2], [20, 21], expedited=True)
    engine.wait([d])
    engine.wait()
    assert sorted(results(engine)) == [(c, True), (d, True)]
    assert all(torch.equal(t[30], t[3]) and torch.equal(t[21], t[1]) for t in layers)
    methods = engine.jobs_by_method
    if batched:
        # The batched driver call really ran: every job went through it.
        assert methods == {"dma-batched": 4, "dma-per-run": 0, "kernel": 0}
        assert fake().count("batch_ok") == 4
        assert fake().last_batch_order() == SRC_ACCESS_ORDER_ANY
    else:
        assert methods == {"dma-batched": 0, "dma-per-run": 4, "kernel": 0}
        assert fake().count("batch_ok") == 0
    assert fake().count("cross_device_calls") == 0
    del host
    engine.close()
    pool.close()  # every lease was released


def test_stores_use_stream_order_for_the_live_kv_and_any_order_for_loads() -> None:
    layers = kv(1)
    pool = HostChunkPool(4, 2 * PAGE, pin=False)
    pin(pool)
    engine = engine_on_fake(layers, pool)
    engine.wait([engine.store([1], [0])])
    assert fake().last_batch_order() == SRC_ACCESS_ORDER_STREAM
    engine.wait([engine.load([0], [2])])
    assert fake().last_batch_order() == SRC_ACCESS_ORDER_ANY
    engine.close()
    pool.close()


def test_a_store_waits_for_the_compute_stream_still_writing_its_source() -> None:
    """The model's stream is still writing a block when its store is submitted: the store
    must copy the bytes as they are once that write has run (it waits on an event recorded
    on the caller's stream at submission), not the bytes in memory at enqueue time."""
    layers = kv(2)
    pool = HostChunkPool(4, 2 * PAGE, pin=False)
    pin(pool)
    cuda = TorchCuda(2)
    engine = engine_on_fake(layers, pool, cuda=cuda)
    compute = cuda.compute[0].cuda_stream
    new = torch.full((PAGE,), 0xAB, dtype=torch.uint8)
    fake().device_tensor(0, new)
    gate = fake().stream_gate(compute)  # the "model" is busy
    # The model's write of block 6, queued behind the gate on the compute stream.
    assert fake().memcpy_async(layers[0][6].data_ptr(), new.data_ptr(), PAGE, compute) == 0
    job = engine.store([6], [1])
    settle(engine)
    store_stream = engine._backend._streams["store"].cuda_stream
    wait_until(lambda: fake().stream_blocked(store_stream), "the store stream at its wait")
    assert not pool.tensor()[1].any(), "the store ran before the write it must follow"
    fake().gate_open(gate)
    engine.wait([job])
    assert results(engine) == [(job, True)]
    assert torch.equal(pool.tensor()[1][:PAGE], new)
    engine.close()
    pool.close()


def test_copies_run_on_pageable_memory_while_pinning_runs_in_the_background() -> None:
    """Background pinning registers 1 GiB pieces; a copy waits only while a piece of its own
    1 GiB stripe of the pool is being registered. With piece 0 stuck in cudaHostRegister, a
    store into the second GiB runs at once, on pageable memory (synchronously, as CUDA does);
    once pinning is over the same chunk moves by asynchronous DMA. (2 GiB of pool, of which
    pinning prefaults what it registers.)"""
    layers = kv(3)
    mib = 1 << 20
    pool = HostChunkPool(2048, mib, pin=False)  # 2 GiB: two pieces, two stripes
    far = 1536  # a chunk in the second GiB
    fake().register_gate(True)  # the registration thread will be stuck in cudaHostRegister
    try:
        assert pin(pool, background=True, device=0)
        wait_until(fake().registers_waiting, "the pinning thread in cudaHostRegister")
        assert fake().registers_waiting() == 1
        assert pool.pin_status()["state"] == "pinning"
        engine = engine_on_fake(layers, pool, groups=[[(0, PAGE), (1, PAGE)]], offsets=[0, PAGE])
        job = engine.store([4], [far])
        engine.wait([job])
        assert results(engine) == [(job, True)]
        assert torch.equal(pool.tensor()[far][: 2 * PAGE], chunk_bytes(layers, [4]))
        assert fake().count("pageable_copies") >= 1
        assert pool.pin_status()["state"] == "pinning"
    finally:
        fake().register_gate(False)
    assert pool.wait_pinned(HANG_S)["state"] == "pinned"
    before = fake().count("pageable_copies")
    job = engine.load([far], [20])
    engine.wait([job])
    assert results(engine) == [(job, True)]
    assert fake().count("pageable_copies") == before  # pinned now: asynchronous DMA
    assert torch.equal(layers[1][20], layers[1][4])
    engine.close()
    pool.close()


def test_kv_on_a_second_device_never_touches_the_first() -> None:
    """A tensor-parallel rank on device 1, called from a thread whose current device is 0:
    every CUDA call kvcache makes (its queue threads, the pinning thread, submission and
    completion on the caller's thread) runs with device 1 current, and the caller's device is
    left as it was."""
    layers = kv(4)
    pool = HostChunkPool(8, 2 * PAGE, pin=False)
    cuda = TorchCuda((1,))
    assert fake().get_device() == 0
    assert pin(pool, background=True, device=1)
    assert pool.wait_pinned(HANG_S)["state"] == "pinned"
    engine = engine_on_fake(layers, pool, device=1, cuda=cuda)
    jobs = [engine.store([2], [0])]
    engine.wait(jobs)  # stores and loads are on different queues: no order between them
    jobs += [engine.load([0], [7]), engine.load([0], [8], expedited=True)]
    engine.wait(jobs)
    assert sorted(results(engine)) == [(j, True) for j in jobs]
    assert torch.equal(layers[0][7], layers[0][2])
    engine.close()
    pool.close()
    assert fake().get_device() == 0
    assert fake().touched_devices() == {1}
    assert fake().count("cross_device_calls") == 0


@pytest.mark.parametrize(("mode", "index"), [(1, 0), (2, 3)])
def test_a_failed_batched_call_is_reported_once_and_the_job_still_moves_its_bytes(
    caplog: pytest.LogCaptureFixture, mode: int, index: int
) -> None:
    layers = kv(5)
    pool = HostChunkPool(8, 2 * PAGE, pin=False)
    pin(pool)
    engine = engine_on_fake(layers, pool)
    fake().fail_batch(mode, index)
    scattered = engine.plan(store=True, gpu_block_ids=[3, 9, 1, 20], chunk_ids=[0, 7, 2, 5])
    copies = len(scattered)
    del scattered
    with caplog.at_level(logging.DEBUG, logger="kvcache"):
        first = engine.store([3, 9, 1, 20], [0, 7, 2, 5])
        engine.wait([first])
        second = engine.store([5], [1])
        engine.wait([second])
        assert results(engine) == [(first, True), (second, True)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    (warning,) = warnings
    # The driver's own name for the error, and where it failed.
    assert "cuMemcpyBatchAsync failed on the store queue for job 0" in warning
    assert "CUDA_ERROR_INVALID_VALUE" in warning or "invalid argument" in warning
    where = f"copy {index} of {copies}" if mode == 2 else f"one of {copies} copies"
    assert where in warning
    assert torch.equal(pool.tensor()[7][:PAGE], layers[0][9])
    # What ran, not what was meant: both jobs went one copy per run, and the engine says so.
    assert engine.jobs_by_method == {"dma-batched": 0, "dma-per-run": 2, "kernel": 0}
    assert engine.describe()["dma"].startswith("per-run (")
    assert fake().count("batch_failed") == 1  # the queue stopped trying after the first
    engine.close()
    pool.close()


def test_a_failed_copy_reports_the_job_with_its_cause_once_the_stream_is_done(
    caplog: pytest.LogCaptureFixture,
) -> None:
    layers = kv(6)
    pool = HostChunkPool(8, 2 * PAGE, pin=False)
    pin(pool)
    engine = engine_on_fake(layers, pool, batch=False, log_failures=True)
    fake().fail_memcpy(2, 1)  # cudaErrorInvalidValue on the second copy: not sticky
    with caplog.at_level(logging.ERROR):
        job = engine.load([3], [10])
        engine.wait([job])
        (result,) = engine.poll_results()
    assert (result.job_id, result.success, result.store) == (job, False, False)
    assert "cudaMemcpyAsync failed" in str(result.error)
    assert "after 1 of 2 runs" in str(result.error)
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert f"job {job}" in record.getMessage()
    assert "load, host -> device" in record.getMessage()
    # Not sticky: the engine goes on.
    again = engine.load([3], [11])
    engine.wait([again])
    assert results(engine) == [(again, True)]
    engine.close()
    pool.close()


def test_a_sticky_fault_fails_the_job_and_the_engine_refuses_every_later_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fault after the engine has run: the job in flight when the context is lost fails,
    and every later submission is refused, naming the cause."""
    layers = kv(7)
    pool = HostChunkPool(8, 2 * PAGE, pin=False)
    pin(pool)
    engine = engine_on_fake(layers, pool)
    # One job first: the store queue's thread binds its device when it starts, and a fault
    # that beats it there marks the queue lost before any submission (then the store below
    # is refused, not failed); on a busy machine that start can come late.
    first = engine.store([0], [0])
    engine.wait([first])
    assert results(engine) == [(first, True)]
    ok_before = fake().count("batch_ok")
    with caplog.at_level(logging.ERROR):
        fake().fault(ILLEGAL_ADDRESS)  # something on the device faulted: the context is gone
        job = engine.store([1], [1])
        engine.wait([job])
        (result,) = engine.poll_results()
        assert not result.success
        with pytest.raises(TransferError, match="refuses new jobs"):
            engine.load([1], [2])
    assert engine._backend.lost is not None
    assert any("the CUDA context is lost" in r.getMessage() for r in caplog.records)
    assert fake().count("batch_ok") == ok_before
    engine.close()
    pool.close()


def odd_chunk_engine(kernel_cutoff: int, copy: str = "auto") -> tuple[TransferEngine, Any, Any]:
    """Pages of 64 bytes but chunks of 8 * 64 + 4 bytes: every address of chunk 0 is
    aligned, and no chunk after it is."""
    layers = kv(8, page=64)
    pool = HostChunkPool(8, 2 * 4 * 64 + 4, pin=False)
    pin(pool)
    engine = engine_on_fake(
        layers,
        pool,
        copy=copy,
        kernel_max_run_bytes=kernel_cutoff,
        kernel_min_runs=1,
        blocks_per_chunk=4,
        groups=[[(0, 64), (1, 64)]],
        offsets=[0, 4 * 64],
    )
    return engine, pool, layers


def test_a_chunk_size_off_word_alignment_never_reaches_the_kernel() -> None:
    """Each tensor's geometry is aligned, the chunk size is not: the kernel would form
    misaligned addresses for every chunk but the first (a fault that loses the context), so
    neither a job nor the self-check's method list may use it."""
    engine, pool, _layers = odd_chunk_engine(kernel_cutoff=1 << 20)
    backend = engine._backend
    assert backend.check_methods() == (("dma",), ("dma",))
    assert "chunk size" in engine.describe()["kernel"]
    job = engine.load([1, 3], [8, 2, 30, 4, 10, 12, 14, 16], group_sizes=[8], block_indices=[0])
    engine.wait([job])
    assert results(engine) == [(job, True)]
    assert engine.jobs_by_method["kernel"] == 0
    assert fake().sticky() == 0
    engine.close()
    pool.close()
    with pytest.raises(InvalidArgumentError, match="chunk size"):
        odd_chunk_engine(kernel_cutoff=1 << 20, copy="kernel")


def test_the_kernel_runs_small_loads_and_its_bytes_are_right() -> None:
    layers = kv(10, page=64)
    pool = HostChunkPool(8, 2 * 4 * 64, pin=False)
    pin(pool)
    engine = engine_on_fake(
        layers, pool, copy="auto", kernel_max_run_bytes=1024, kernel_min_runs=1, blocks_per_chunk=4
    )
    assert engine._backend.check_methods() == (("dma",), ("dma", "kernel"))
    store = engine.store([0, 1, 2, 3], [2])
    engine.wait([store])
    load = engine.load([2], [9, 20, 11, 5])
    engine.wait([load])
    assert results(engine) == [(store, True), (load, True)]
    assert engine.jobs_by_method == {"dma-batched": 1, "dma-per-run": 0, "kernel": 1}
    for t in layers:
        assert torch.equal(t[[9, 20, 11, 5]], t[[0, 1, 2, 3]])
    engine.close()
    pool.close()


def test_a_kernel_fault_is_reported_as_what_it_is_never_a_fallback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """If a kernel faults anyway (here: the pool is unregistered under it, so its host side
    is pageable), the job fails naming the fault, and the engine refuses later jobs rather
    than "falling back" to DMA on a lost context."""
    layers = kv(11, page=64)
    pool = HostChunkPool(8, 2 * 4 * 64, pin=False)
    pin(pool)
    engine = engine_on_fake(
        layers, pool, copy="kernel", kernel_max_run_bytes=1024, blocks_per_chunk=4
    )
    assert fake().host_unregister(pool.address) == 0  # the kernel's host side is now pageable
    with caplog.at_level(logging.ERROR):
        job = engine.load([2], [9, 20, 11, 5])
        engine.wait([job])
        (result,) = engine.poll_results()
        assert not result.success
        with pytest.raises(TransferError, match="refuses new jobs"):
            engine.store([1, 2, 3, 4], [1])
    assert fake().sticky() == ILLEGAL_ADDRESS
    assert "copy kernel of job" in str(engine._backend.lost)
    assert any("CUDA context is lost" in r.getMessage() for r in caplog.records)
    assert engine.jobs_by_method["dma-batched"] == 0
    engine.close()  # returns: every call fails at once on a lost context
    pool.close()


def test_an_expedited_load_overtakes_a_regular_load_stuck_in_its_submission() -> None:
    layers = kv(12)
    pool = HostChunkPool(8, 2 * PAGE, pin=False)
    pin(pool)
    engine = engine_on_fake(layers, pool)
    backend = engine._backend
    engine.wait([engine.store([0, 1], [0, 1])])
    engine.poll_results()
    load_stream = backend._streams["load"].cuda_stream
    fake().hold_memcpy(load_stream, True)  # the regular queue's thread is stuck in the driver
    try:
        regular = engine.load([0], [10])
        wait_until(fake().holding, "the load queue's thread held in the driver")
        assert fake().holding() == 1
        expedited = engine.load([1], [11], expedited=True)
        engine.wait([expedited])
        assert results(engine) == [(expedited, True)]
        assert engine.in_flight == 1
        assert all(torch.equal(t[11], t[1]) for t in layers)
    finally:
        fake().hold_memcpy(load_stream, False)
    engine.wait([regular])
    assert results(engine) == [(regular, True)]
    engine.close()
    pool.close()


def test_the_kernel_needs_a_pinned_pool() -> None:
    layers = kv(13, page=64)
    pool = HostChunkPool(8, 2 * 4 * 64, pin=False)
    with pytest.raises(InvalidArgumentError, match="pin"):
        engine_on_fake(layers, pool, copy="kernel", blocks_per_chunk=4)
    pool.close()
