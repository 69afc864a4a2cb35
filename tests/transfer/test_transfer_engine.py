"""TransferEngine on the CPU path: byte-exact round trips, coalescing, validation with no
partial effect, several jobs in flight, close/GC behaviour."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.transfer import HostChunkPool, TransferEngine


def random_layers(
    rng: np.random.Generator,
    num_layers: int,
    num_blocks: int,
    page_shape: tuple[int, ...],
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Layers filled with random bytes (any dtype, so NaN payloads are exercised too)."""
    out = []
    for _ in range(num_layers):
        raw = rng.integers(0, 256, size=(num_blocks, *page_shape, dtype.itemsize), dtype=np.uint8)
        out.append(torch.from_numpy(raw).view(dtype).reshape(num_blocks, *page_shape))
    return out


def page_bytes(layer: torch.Tensor) -> torch.Tensor:
    """The (blocks, page bytes) uint8 view of a layer (copy if strided)."""
    return layer.contiguous().view(torch.uint8).reshape(layer.shape[0], -1)


def expected_chunk(layers: Sequence[torch.Tensor], blocks: Sequence[int]) -> torch.Tensor:
    """The layer-major chunk layout: every layer's pages of ``blocks``, layer after layer."""
    ids = torch.as_tensor(list(blocks))
    return torch.cat([page_bytes(layer)[ids].reshape(-1) for layer in layers])


def chunk_bytes_for(layers: Sequence[torch.Tensor], bpc: int) -> int:
    return bpc * sum(layer[0].numel() * layer.element_size() for layer in layers)


def round_trip(
    rng: np.random.Generator,
    layers: list[torch.Tensor],
    bpc: int,
    num_chunks: int,
    job_chunks: int,
) -> None:
    """Store random blocks to random chunks, check the pool, load them back elsewhere."""
    num_blocks = layers[0].shape[0]
    with HostChunkPool(num_chunks, chunk_bytes_for(layers, bpc), pin=False) as pool:
        engine = TransferEngine(layers, pool, blocks_per_chunk=bpc)
        chunks = rng.permutation(num_chunks)[:job_chunks]
        blocks = rng.permutation(num_blocks)[: job_chunks * bpc]
        job = engine.store(blocks, chunks)
        engine.wait([job])
        assert engine.poll() == [(job, True)]
        host = pool.tensor()
        for j, c in enumerate(chunks):
            assert torch.equal(host[c], expected_chunk(layers, blocks[j * bpc : (j + 1) * bpc]))
        untouched_chunks = np.setdiff1d(np.arange(num_chunks), chunks)
        assert not host[torch.as_tensor(untouched_chunks)].any()

        dst = [torch.zeros_like(layer) for layer in layers]
        loader = TransferEngine(dst, pool, blocks_per_chunk=bpc)
        targets = rng.permutation(num_blocks)[: job_chunks * bpc]
        job = loader.load(chunks, targets)
        loader.wait()
        assert loader.poll() == [(job, True)]
        untouched = torch.as_tensor(np.setdiff1d(np.arange(num_blocks), targets))
        for src, out in zip(layers, dst, strict=True):
            s, d = page_bytes(src), page_bytes(out)
            assert torch.equal(d[torch.as_tensor(targets)], s[torch.as_tensor(blocks)])
            assert not d[untouched].any(), "a load wrote blocks it was not asked for"
        del host
        engine.close()
        loader.close()


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float64]
)
@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_round_trip_is_byte_exact(dtype: torch.dtype, num_layers: int, bpc: int) -> None:
    rng = np.random.default_rng([num_layers, bpc, dtype.itemsize])
    layers = random_layers(rng, num_layers, 40, (2, 3, 4), dtype)
    round_trip(rng, layers, bpc, num_chunks=12, job_chunks=6)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_layers=st.integers(1, 4),
    bpc=st.integers(1, 4),
    page_elems=st.integers(1, 9),
    gap=st.integers(0, 2),
    dtype=st.sampled_from([torch.uint8, torch.float16, torch.float32, torch.int64]),
)
def test_round_trip_random_geometry(
    seed: int, num_layers: int, bpc: int, page_elems: int, gap: int, dtype: torch.dtype
) -> None:
    """Odd page sizes and blocks strided apart (a layer as a view of a wider tensor)."""
    rng = np.random.default_rng(seed)
    num_blocks = 4 * bpc + 3
    wide = random_layers(rng, num_layers, num_blocks, (page_elems + gap,), dtype)
    layers = [w[:, :page_elems] for w in wide]
    num_chunks = 5
    job = int(rng.integers(0, num_chunks + 1))
    round_trip(rng, layers, bpc, num_chunks=num_chunks, job_chunks=min(job, num_blocks // bpc))


def test_kv_split_layers_and_cross_layer_layout() -> None:
    """vLLM-style (2, blocks, ...) K/V tensors passed as two layers, and a cross-layer tensor
    (blocks, layers, page) whose chunks coalesce into one run each."""
    rng = np.random.default_rng(7)
    kv = random_layers(rng, 1, 2 * 16, (4, 8), torch.float16)[0].reshape(2, 16, 4, 8)
    round_trip(rng, [kv[0], kv[1]], bpc=2, num_chunks=6, job_chunks=4)

    cross = random_layers(rng, 1, 16, (3, 64), torch.uint8)[0]  # 16 blocks x 3 layers
    layers = [cross[:, i] for i in range(3)]
    with HostChunkPool(8, 3 * 64, pin=False) as pool:
        engine = TransferEngine(layers, pool)
        plan = engine.plan(store=True, gpu_block_ids=[5, 6, 9], chunk_ids=[2, 3, 7])
        # Blocks 5 and 6 are adjacent, as are chunks 2 and 3: one run; then chunk 7.
        assert (len(plan), plan.num_pages, plan.nbytes) == (2, 9, 3 * 3 * 64)
        del plan
    round_trip(rng, layers, bpc=1, num_chunks=8, job_chunks=5)


def test_coalescing_merges_runs_contiguous_on_both_sides() -> None:
    layers = [torch.zeros(64, 256, dtype=torch.uint8) for _ in range(2)]
    with HostChunkPool(16, 4 * 2 * 256, pin=False) as pool:
        engine = TransferEngine(layers, pool, blocks_per_chunk=4)
        plan = engine.plan(store=False, gpu_block_ids=range(8, 16), chunk_ids=[3, 4])
        assert len(plan) == 4
        assert plan.max_run_bytes == 4 * 256
        del plan
        scattered = [8, 20, 9, 33, 1, 2, 40, 60]
        plan = engine.plan(store=False, gpu_block_ids=scattered, chunk_ids=[3, 4])
        assert len(plan) == 2 * (4 + 3)  # per layer: no pair in chunk 3, (1, 2) in chunk 4
        assert plan.num_pages == 16
        del plan
    single = [torch.zeros(64, 512, dtype=torch.uint8)]
    with HostChunkPool(32, 512, pin=False) as pool:
        engine = TransferEngine(single, pool)
        plan = engine.plan(store=True, gpu_block_ids=range(10, 30), chunk_ids=range(5, 25))
        assert len(plan) == 1
        assert plan.nbytes == 20 * 512
        del plan


@pytest.mark.parametrize(
    "as_given",
    [
        list,
        tuple,
        lambda ids: np.array(ids, dtype=np.int32),
        lambda ids: np.array(ids, dtype=np.uint16),
        lambda ids: np.array(ids, dtype=">i8"),  # not native byte order
        lambda ids: np.repeat(np.array(ids, dtype=np.int64), 2)[::2],  # a strided view
        lambda ids: torch.tensor(ids),
    ],
    ids=["list", "tuple", "int32", "uint16", "big-endian", "strided", "tensor"],
)
def test_any_integer_sequence_plans_as_an_int64_array(as_given: Any) -> None:
    """numpy int64/int32 ids are read in place; every other form is converted first, and
    plans exactly the same copies."""
    layers = [torch.zeros(16, 64, dtype=torch.uint8)]
    gpu, chunks = [9, 2, 5, 14], [3, 0, 6, 1]
    with HostChunkPool(8, 64, pin=False) as pool:
        engine = TransferEngine(layers, pool)
        want = engine.plan(store=True, gpu_block_ids=np.array(gpu), chunk_ids=np.array(chunks))
        got = engine.plan(store=True, gpu_block_ids=as_given(gpu), chunk_ids=as_given(chunks))
        out = [np.zeros(3 * len(want), dtype=np.int64) for _ in range(2)]
        want.write_runs(out[0])
        got.write_runs(out[1])
        assert len(got) == len(want) == 4
        assert np.array_equal(out[0], out[1])
        with pytest.raises(TypeError, match="native-order"):
            got.write_runs(np.zeros(3 * len(got), dtype=">i8"))
        with pytest.raises(ValueError, match="1-d"):
            engine.plan(store=True, gpu_block_ids=np.array([gpu]), chunk_ids=np.array(chunks))
        del want, got
        engine.close()


def snapshot(pool: HostChunkPool, layers: Sequence[torch.Tensor]) -> list[bytes]:
    return [bytes(memoryview(pool))] + [page_bytes(t).numpy().tobytes() for t in layers]


BAD_REQUESTS = [
    # (direction, gpu ids, chunk ids, exception)
    ("store", [0, 1, 2], [0, 1], ValueError),  # 3 blocks for 2 chunks of 2
    ("load", [0, 1], [], ValueError),
    ("store", [0, 1, 2, 3], [0, 8], IndexError),  # chunk 8 of 8
    ("store", [0, 1, 2, 3], [0, -1], IndexError),
    ("load", [0, 1, 2, 16], [0, 1], IndexError),  # block 16 of 16
    ("load", [0, -5, 2, 3], [0, 1], IndexError),
    ("store", [0, 1, 2, 3], [2**70, 1], IndexError),
    ("store", [0, 1, 2, 3], np.array([2**63, 1], dtype=np.uint64), IndexError),
    ("store", [0, 1, 2, 3], [1, 1], ValueError),  # a store writes each chunk once
    ("load", [4, 5, 6, 4], [0, 1], ValueError),  # a load writes each block once
    ("store", [0.0, 1.0], [0], TypeError),
    ("store", [True, False], [0], TypeError),
    ("store", ["0", "1"], [0], TypeError),
    ("store", [[0, 1]], [[0]], ValueError),
    ("load", [0, 1], [None], TypeError),
]


@pytest.mark.parametrize(("direction", "gpu_ids", "chunk_ids", "exc"), BAD_REQUESTS)
def test_bad_requests_fail_before_any_copy(
    direction: str, gpu_ids: object, chunk_ids: object, exc: type
) -> None:
    rng = np.random.default_rng(0)
    layers = random_layers(rng, 2, 16, (8,), torch.float32)
    with HostChunkPool(8, chunk_bytes_for(layers, 2), pin=False) as pool:
        memoryview(pool)[:] = bytes(rng.integers(0, 256, pool.nbytes, dtype=np.uint8))
        engine = TransferEngine(layers, pool, blocks_per_chunk=2)
        before = snapshot(pool, layers)
        submit = engine.store if direction == "store" else engine.load
        args = (gpu_ids, chunk_ids) if direction == "store" else (chunk_ids, gpu_ids)
        with pytest.raises(exc):
            submit(*args)
        engine.wait()
        assert engine.poll() == []
        assert engine.in_flight == 0
        assert snapshot(pool, layers) == before
        # The engine still works afterwards, and numbering did not skip.
        assert engine.store([0, 1], [0]) == 0
        engine.close()


@pytest.mark.parametrize(
    ("make_layers", "chunk_bytes", "exc"),
    [
        (lambda: [torch.zeros(8, 16)], 63, ValueError),  # chunk_bytes != 1 x 64
        (lambda: [], 64, ValueError),
        (lambda: torch.zeros(8, 16), 64, TypeError),  # a tensor, not a list of layers
        (lambda: [np.zeros((8, 16))], 64, TypeError),
        (lambda: [torch.zeros(8, 16, device="meta")], 64, ValueError),
        (lambda: [torch.zeros(())], 64, ValueError),
        (lambda: [torch.zeros(0, 16)], 64, ValueError),
        (lambda: [torch.zeros(16, 8).t()], 64, ValueError),  # pages not contiguous
        (lambda: [torch.zeros(1, 16).expand(8, 16)], 64, ValueError),  # blocks overlap
    ],
)
def test_bad_engine_construction(make_layers: object, chunk_bytes: int, exc: type) -> None:
    with HostChunkPool(4, chunk_bytes, pin=False) as pool, pytest.raises(exc):
        TransferEngine(make_layers(), pool)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"blocks_per_chunk": 0}, ValueError),
        ({"blocks_per_chunk": True}, TypeError),
        ({"blocks_per_chunk": 2}, ValueError),  # 2 x 64 != 64
        ({"copy": "fast"}, ValueError),
        ({"kernel_programs": 0}, ValueError),
    ],
)
def test_bad_engine_options(kwargs: dict, exc: type) -> None:
    with HostChunkPool(4, 64, pin=False) as pool, pytest.raises(exc):
        TransferEngine([torch.zeros(8, 16)], pool, **kwargs)
    with pytest.raises(TypeError):
        TransferEngine([torch.zeros(8, 16)], memoryview(bytearray(256)))  # type: ignore[arg-type]


def test_several_jobs_in_flight_are_each_reported_once() -> None:
    rng = np.random.default_rng(3)
    layers = random_layers(rng, 3, 64, (1024,), torch.uint8)
    with HostChunkPool(64, chunk_bytes_for(layers, 1), pin=False) as pool:
        engine = TransferEngine(layers, pool)
        order = rng.permutation(64)
        jobs = [engine.store(order[i : i + 8], range(i, i + 8)) for i in range(0, 64, 8)]
        assert jobs == list(range(8))
        engine.wait(jobs[:2])
        first = engine.poll()
        assert {0, 1} <= {j for j, _ in first}
        engine.wait()
        rest = engine.poll()
        assert sorted(first + rest) == [(j, True) for j in jobs]
        assert engine.poll() == []
        assert engine.in_flight == 0
        engine.wait(jobs)  # already reported: returns at once
        with pytest.raises(ValueError, match="not issued"):
            engine.wait([99])
        host = pool.tensor()
        for c in range(64):
            assert torch.equal(host[c], expected_chunk(layers, [order[c]]))
        # Jobs in one direction run in submission order: the last store to a chunk wins.
        engine.store([5], [0])
        engine.store([6], [0])
        engine.wait()
        assert torch.equal(host[0], expected_chunk(layers, [6]))
        del host
        engine.close()


def test_empty_job_succeeds() -> None:
    with HostChunkPool(2, 64, pin=False) as pool:
        engine = TransferEngine([torch.zeros(4, 16)], pool)
        job = engine.load([], [])
        engine.wait()
        assert engine.poll() == [(job, True)]
        engine.close()


def test_close_and_collection_wait_for_jobs() -> None:
    rng = np.random.default_rng(5)
    layers = random_layers(rng, 1, 256, (64 * 1024,), torch.uint8)  # 16 MiB
    pool = HostChunkPool(256, 64 * 1024, pin=False)
    with TransferEngine(layers, pool) as engine:
        job = engine.store(range(256), rng.permutation(256))
    assert engine.closed
    assert engine.poll() == [(job, True)]  # results survive close
    with pytest.raises(ValueError, match="closed"):
        engine.store([0], [0])

    engine = TransferEngine(layers, pool)
    engine.load(range(256), rng.permutation(256))
    del engine
    gc.collect()
    pool.close()  # would raise if a job still held the pool
    assert pool.closed


def test_copier_guards_finish_on_shutdown_and_refuse_misuse() -> None:
    """The Rust worker behind the CPU path: runs a plan once, only host-memory plans, and
    finishes queued work on shutdown before refusing more."""
    from kvcache import _core

    with HostChunkPool(4, 64, pin=False) as pool:
        layer = torch.arange(64, dtype=torch.float32).reshape(4, 16)
        engine = TransferEngine([layer], pool)
        copier = _core.CpuCopier()
        plan = engine.plan(store=True, gpu_block_ids=[3], chunk_ids=[0])
        copier.submit(7, plan)
        copier.wait([7])
        with pytest.raises(ValueError, match="already executed"):
            copier.submit(8, plan)
        device_layout = _core.TransferLayout(pool, [(1 << 40, 64, 64, 4, 0)], 1)
        device_plan = device_layout.plan(True, np.array([1]), np.array([2]))
        with pytest.raises(ValueError, match="host-memory"):
            copier.submit(9, device_plan)
        copier.submit(10, engine.plan(store=True, gpu_block_ids=[2], chunk_ids=[1]))
        copier.shutdown()
        assert copier.in_flight() == 0
        done = sorted(copier.poll())
        assert [(j, ok, err) for j, ok, _, err in done] == [(7, True, None), (10, True, None)]
        assert all(seconds >= 0 for _, _, seconds, _ in done)
        with pytest.raises(RuntimeError, match="shut down"):
            copier.submit(11, engine.plan(store=True, gpu_block_ids=[1], chunk_ids=[2]))
        assert torch.equal(pool.tensor()[:2], layer[[3, 2]].view(torch.uint8))
        del plan, device_plan
        engine.close()


def test_groups_and_offsets_given_as_iterators_are_read_once() -> None:
    """Rust checks ``groups``/``offsets`` and the self-check's scratch copy reads them again:
    generators must not arrive empty the second time."""
    layers = [torch.zeros(16, 128, dtype=torch.uint8) for _ in range(2)]
    with HostChunkPool(8, 2 * 2 * 128, pin=False) as pool:
        engine = TransferEngine(
            layers,
            pool,
            blocks_per_chunk=2,
            groups=(iter([(i, 128)]) for i in (0, 1)),
            offsets=iter([0, 256]),
        )
        try:
            assert engine.self_check() is None
            assert engine.num_groups == 2
        finally:
            engine.close()
