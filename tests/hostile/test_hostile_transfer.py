"""Hostile input to ``kvcache.transfer`` (CPU tensors): every bad size, id or argument raises
exactly the ``kvcache`` class its case names, and changes nothing: the pool's bytes, the layers,
the jobs in flight and the next job id.

Each class is also the builtin a caller of the transfer API catches: ``OutOfRangeError`` an
``IndexError`` (an id out of range), ``InvalidArgumentError`` a ``ValueError`` (a bad value or
length), ``InvalidTypeError`` a ``TypeError`` (a bad type), ``InvalidStateError`` a
``ValueError`` (a closed engine, a pool set up twice), ``PoolClosedError`` also a
``BufferError`` (anything asked of a closed pool), ``OutOfMemoryError`` a ``MemoryError`` (the
system refuses the mapping) and ``TransferError`` a ``RuntimeError`` (a busy pool).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvcache
from kvcache import (
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    OutOfMemoryError,
    OutOfRangeError,
    PoolClosedError,
    TransferError,
)
from tests.support.hostile import raises_exactly

torch = pytest.importorskip("torch")

from kvcache.transfer import HostChunkPool, TransferEngine  # noqa: E402

NUM_CHUNKS, PAGE, BLOCKS = 4, 32, 8


def make_engine() -> tuple[TransferEngine, HostChunkPool, list[Any]]:
    pool = HostChunkPool(NUM_CHUNKS, 2 * PAGE, pin=False)
    layers = [
        torch.arange(BLOCKS * PAGE, dtype=torch.int32).to(torch.uint8).view(BLOCKS, PAGE),
        torch.full((BLOCKS, PAGE), 7, dtype=torch.uint8),
    ]
    np.frombuffer(pool, dtype=np.uint8)[:] = np.arange(pool.nbytes, dtype=np.uint8)
    return TransferEngine(layers, pool), pool, layers


def snapshot(engine: TransferEngine, pool: HostChunkPool, layers: list[Any]) -> Any:
    engine.wait()
    return (
        bytes(memoryview(pool)),
        [bytes(t.numpy().tobytes()) for t in layers],
        engine.in_flight,
        pool.closed,
    )


CASES: list[Any] = []
# The entry points the cases call ("Class" for a constructor, "Class.method").
COVERED: set[str] = set()
# A case's entry point, from its name's prefix when it names none itself.
ENTRY_OF_PREFIX = {
    "pool": "HostChunkPool",
    "engine": "TransferEngine",
    "store": "TransferEngine.store",
    "load": "TransferEngine.load",
    "plan": "TransferEngine.plan",
    "wait": "TransferEngine.wait",
    "pointers": "TransferEngine.block_ids_from_pointers",
    "close": "HostChunkPool.close",
}


def case(
    name: str,
    call: Callable[..., object],
    expected: type[BaseException],
    *,
    ctor: bool = False,
    covers: str | None = None,
    marks: Any = (),
) -> None:
    assert issubclass(expected, kvcache.KvCacheError), f"{name}: {expected} is not ours"
    COVERED.add(covers or ENTRY_OF_PREFIX[name.split("-")[0]])
    CASES.append(pytest.param(call, expected, ctor, id=name, marks=marks))


# --- HostChunkPool ----------------------------------------------------------------------------

for name, args, expected in [
    ("zero-chunks", (0, 16), InvalidArgumentError),
    ("negative-chunks", (-1, 16), InvalidArgumentError),
    ("zero-bytes", (4, 0), InvalidArgumentError),
    ("negative-bytes", (4, -16), InvalidArgumentError),
    ("float-chunks", (1.5, 16), InvalidTypeError),
    ("bool-chunks", (True, 16), InvalidTypeError),
    ("str-chunks", ("4", 16), InvalidTypeError),
    ("none-chunks", (None, 16), InvalidTypeError),
    ("float-bytes", (4, 16.0), InvalidTypeError),
    ("chunks-2**70", (2**70, 16), InvalidArgumentError),
    ("bytes-2**70", (4, 2**70), InvalidArgumentError),
    ("product-overflows", (2**40, 2**40), InvalidArgumentError),
    ("mapping-refused", (2**20, 2**40), OutOfMemoryError),
]:
    case(
        f"pool-{name}",
        lambda *_, a=args: HostChunkPool(*a, pin=False),
        expected,
        ctor=True,
    )


def _mapped(n: int) -> Any:
    import mmap

    return mmap.mmap(-1, n)


for name, buffer, expected in [
    ("read-only", lambda: bytes(8192), InvalidArgumentError),
    ("too-small", lambda: _mapped(4096), InvalidArgumentError),
    ("not-a-buffer", lambda: object(), InvalidTypeError),
    ("not-page-aligned", lambda: memoryview(_mapped(3 * 4096))[1:], InvalidArgumentError),
    ("not-contiguous", lambda: memoryview(_mapped(4 * 4096))[::2], InvalidArgumentError),
]:
    case(
        f"pool-buffer-{name}",
        lambda *_, b=buffer: HostChunkPool(2, 4096, pin=False, buffer=b()),
        expected,
        ctor=True,
    )
for name, pin in [("str", "yes"), ("none", None), ("int", 1), ("float", 0.0)]:
    case(
        f"pool-pin-{name}",
        lambda *_, p=pin: HostChunkPool(4, 16, pin=p),
        InvalidArgumentError,
        ctor=True,
    )


# --- TransferEngine construction --------------------------------------------------------------


def layers_of(*shapes: tuple[int, ...]) -> list[Any]:
    return [torch.zeros(shape, dtype=torch.uint8) for shape in shapes]


for name, make, expected in [
    ("no-layers", lambda pool: TransferEngine([], pool), InvalidArgumentError),
    ("tensor-not-list", lambda pool: TransferEngine(torch.zeros(8, 64), pool), InvalidTypeError),
    ("int-layer", lambda pool: TransferEngine([5], pool), InvalidTypeError),
    ("scalar-layer", lambda pool: TransferEngine([torch.tensor(3)], pool), InvalidArgumentError),
    ("empty-layer", lambda pool: TransferEngine(layers_of((0, 64)), pool), InvalidArgumentError),
    ("empty-pages", lambda pool: TransferEngine(layers_of((8, 0)), pool), InvalidArgumentError),
    (
        "strided-pages",
        lambda pool: TransferEngine([torch.zeros(8, 128, dtype=torch.uint8)[:, ::2]], pool),
        InvalidArgumentError,
    ),
    ("page-mismatch", lambda pool: TransferEngine(layers_of((8, 32)), pool), InvalidArgumentError),
    ("pool-object", lambda pool: TransferEngine(layers_of((8, 64)), object()), InvalidTypeError),
    (
        "blocks_per_chunk-0",
        lambda pool: TransferEngine(layers_of((8, 64)), pool, blocks_per_chunk=0),
        InvalidArgumentError,
    ),
    (
        "blocks_per_chunk-2",
        lambda pool: TransferEngine(layers_of((8, 64)), pool, blocks_per_chunk=2),
        InvalidArgumentError,
    ),
    (
        "blocks_per_chunk-bool",
        lambda pool: TransferEngine(layers_of((8, 64)), pool, blocks_per_chunk=True),
        InvalidTypeError,
    ),
    (
        "copy-mode",
        lambda pool: TransferEngine(layers_of((8, 64)), pool, copy="fast"),
        InvalidArgumentError,
    ),
    (
        "kernel_programs-0",
        lambda pool: TransferEngine(layers_of((8, 64)), pool, kernel_programs=0),
        InvalidArgumentError,
    ),
    # torch's own errors (a nested tensor has no sizes) before: no pages to copy.
    (
        "nested-layer",
        lambda pool: TransferEngine([torch.nested.nested_tensor([torch.zeros(2)])], pool),
        InvalidArgumentError,
    ),
    (
        "sparse-layer",
        lambda pool: TransferEngine([torch.zeros(8, 16).to_sparse()], pool),
        InvalidArgumentError,
    ),
]:
    case(f"engine-{name}", lambda *_, make=make: make(HostChunkPool(4, 64, pin=False)), expected)


def closed_pool_engine(*_: Any) -> object:
    pool = HostChunkPool(4, 64, pin=False)
    pool.close()
    return TransferEngine(layers_of((8, 64)), pool)


case("engine-closed-pool", closed_pool_engine, PoolClosedError)


def pool_over_closed_pool(*_: Any) -> object:
    pool = HostChunkPool(1, 4096, pin=False)
    pool.close()
    return HostChunkPool(1, 4096, pin=False, buffer=pool)


# It raised InvalidTypeError ("buffer must export bytes"), hiding why.
case("pool-buffer-closed-pool", pool_over_closed_pool, PoolClosedError, ctor=True)


# The CPU copier the engine drives: pyo3's own errors (OverflowError, TypeError) before.
def copier_submit(job_id: Any, plan: Any) -> Callable[[TransferEngine], object]:
    def call(e: TransferEngine) -> object:
        from kvcache import _core

        copier = _core.CpuCopier()
        try:
            made = plan(e) if callable(plan) else plan
            return copier.submit(job_id, made)
        finally:
            copier.shutdown()

    return call


def a_plan(e: TransferEngine) -> object:
    return e.plan(store=True, gpu_block_ids=[0], chunk_ids=[0])


case("copier-negative-id", copier_submit(-1, a_plan), InvalidArgumentError, covers="CpuCopier")
case("copier-id-2**64", copier_submit(2**64, a_plan), InvalidArgumentError, covers="CpuCopier")
case("copier-float-id", copier_submit(1.0, a_plan), InvalidTypeError, covers="CpuCopier")
case("copier-not-a-plan", copier_submit(0, "plan"), InvalidTypeError, covers="CpuCopier")


# The layout the engine builds, called directly: pyo3's own errors before.
DEVICE_LAYER = (1 << 40, 64, 64, 8, 0)


def layout(e: TransferEngine, *, pool: Any = None, layer: Any = DEVICE_LAYER) -> Any:
    from kvcache import _core

    return _core.TransferLayout(e.pool if pool is None else pool, [layer], 1)


for name, call, expected in [
    ("negative-base", lambda e: layout(e, layer=(-1, 64, 64, 8, 0)), InvalidArgumentError),
    ("base-2**64", lambda e: layout(e, layer=(2**64, 64, 64, 8, 0)), InvalidArgumentError),
    ("float-stride", lambda e: layout(e, layer=(1 << 40, 64.0, 64, 8, 0)), InvalidTypeError),
    (
        "negative-segment",
        lambda e: layout(e, layer=(np.zeros((8, 64), np.uint8), -1)),
        InvalidArgumentError,
    ),
    ("pool-object", lambda e: layout(e, pool=object()), InvalidTypeError),
    ("plan-store-int", lambda e: layout(e).plan(1, [0], [0]), InvalidTypeError),
    ("group_refs-negative", lambda e: layout(e).group_refs(-1), InvalidArgumentError),
    ("kernel_problem-2**64", lambda e: layout(e).kernel_problem(2**64), InvalidArgumentError),
]:
    case(f"layout-{name}", call, expected, covers="TransferLayout")


# --- ids --------------------------------------------------------------------------------------

ID_CASES: list[tuple[str, Any, Any, type[BaseException]]] = [
    ("chunk-out-of-range", [0], [NUM_CHUNKS], OutOfRangeError),
    ("block-out-of-range", [BLOCKS], [0], OutOfRangeError),
    ("negative-block", [-1], [0], OutOfRangeError),
    ("negative-chunk", [0], [-1], OutOfRangeError),
    ("block-beyond-int64", [2**70], [0], OutOfRangeError),
    ("chunk-beyond-int64", [0], [2**63], OutOfRangeError),
    ("uint64-beyond-int64", np.array([2**63], dtype=np.uint64), [0], OutOfRangeError),
    ("float-ids", [0.5], [0], InvalidTypeError),
    ("bool-ids", [True], [0], InvalidTypeError),
    ("str-ids", ["0"], [0], InvalidTypeError),
    ("object-ids", [0, None], [0, 1], InvalidTypeError),
    ("length-mismatch", [0], [0, 1], InvalidArgumentError),
    ("two-d-ids", [[0]], [[0]], InvalidArgumentError),
    ("scalar-ids", 0, [0], InvalidTypeError),
    ("none-ids", None, [0], InvalidTypeError),
    ("zero-d-array-ids", np.array(0), [0], InvalidTypeError),
    ("two-d-array-ids", np.zeros((1, 1), dtype=np.int64), [0], InvalidArgumentError),
]
for name, blocks, chunks, expected in ID_CASES:
    case(f"store-{name}", lambda e, b=blocks, c=chunks: e.store(b, c), expected)
    case(f"load-{name}", lambda e, b=blocks, c=chunks: e.load(c, b), expected)
case("store-repeated-destination", lambda e: e.store([0, 1], [2, 2]), InvalidArgumentError)
case("load-repeated-destination", lambda e: e.load([0, 1], [3, 3]), InvalidArgumentError)
case(
    "plan-out-of-range",
    lambda e: e.plan(store=True, gpu_block_ids=[9], chunk_ids=[0]),
    OutOfRangeError,
)
case("wait-never-issued", lambda e: e.wait([99]), InvalidArgumentError)
case("wait-negative", lambda e: e.wait([-1]), InvalidArgumentError)
case("wait-str", lambda e: e.wait(["0"]), InvalidTypeError)
case("wait-bool", lambda e: e.wait([True]), InvalidTypeError)


# --- device pointers (vLLM 0.34's form of a job's device side) ---------------------------------


def pointers(
    e: TransferEngine,
    blocks: list[int],
    *,
    change: Callable[[Any, Any], tuple[Any, Any]] = lambda p, z: (p, z),
    counts: Any = None,
    refs: Any = (2,),
) -> object:
    """``block_ids_from_pointers`` for the pointers vLLM would resolve for ``blocks`` (one
    group: both layers, whole pages), after ``change(ptrs, sizes)``."""
    layers = e._layers
    ptrs = np.array(
        [t.data_ptr() + b * t.stride(0) for t in layers for b in blocks], dtype=np.uint64
    )
    sizes = np.full(len(ptrs), PAGE, dtype=np.uint64)
    ptrs, sizes = change(ptrs, sizes)
    return e.block_ids_from_pointers(
        ptrs,
        sizes,
        group_block_counts=(len(blocks),) if counts is None else counts,
        group_data_ref_counts=refs,
    )


def moved(i: int, by: int) -> Callable[[Any, Any], tuple[Any, Any]]:
    def change(p: Any, z: Any) -> tuple[Any, Any]:
        p = p.copy()
        p[i] = np.uint64(int(p[i]) + by)
        return p, z

    return change


def pointers_after_close(e: TransferEngine) -> object:
    e.close()
    return pointers(e, [0])


for name, call, expected in [
    ("past-the-last-block", lambda e: pointers(e, [1, BLOCKS]), OutOfRangeError),
    ("before-the-layer", lambda e: pointers(e, [0], change=moved(0, -PAGE)), OutOfRangeError),
    ("null-pointer", lambda e: pointers(e, [0], change=lambda p, z: (p * 0, z)), OutOfRangeError),
    ("misaligned", lambda e: pointers(e, [2, 3], change=moved(1, 8)), InvalidArgumentError),
    # The second layer's pointer moved to another of its blocks: the references disagree.
    (
        "references-disagree",
        lambda e: pointers(e, [2, 3], change=moved(3, PAGE)),
        InvalidArgumentError,
    ),
    (
        "wrong-size",
        lambda e: pointers(e, [2], change=lambda p, z: (p, z - np.uint64(1))),
        InvalidArgumentError,
    ),
    ("block-count", lambda e: pointers(e, [2, 3], counts=(1,)), InvalidArgumentError),
    ("reference-count", lambda e: pointers(e, [2], refs=(1,)), InvalidArgumentError),
    ("two-groups", lambda e: pointers(e, [2], counts=(1, 0), refs=(2, 2)), InvalidArgumentError),
    ("negative-count", lambda e: pointers(e, [2], counts=(-1,)), InvalidArgumentError),
    ("float-count", lambda e: pointers(e, [2], counts=(1.0,)), InvalidTypeError),
    ("none-counts", lambda e: pointers(e, [2], counts=None, refs=None), InvalidTypeError),
    (
        "int64-pointers",
        lambda e: pointers(e, [2], change=lambda p, z: (p.astype(np.int64), z)),
        InvalidTypeError,
    ),
    (
        "byte-swapped-pointers",
        lambda e: pointers(e, [2], change=lambda p, z: (p.astype(">u8"), z)),
        InvalidTypeError,
    ),
    (
        "list-pointers",
        lambda e: pointers(e, [2], change=lambda p, z: (p.tolist(), z)),
        InvalidTypeError,
    ),
    (
        "two-d-pointers",
        lambda e: pointers(e, [2], change=lambda p, z: (p.reshape(1, -1), z)),
        InvalidTypeError,
    ),
    (
        "float-sizes",
        lambda e: pointers(e, [2], change=lambda p, z: (p, z.astype(np.float64))),
        InvalidTypeError,
    ),
    ("after-close", pointers_after_close, InvalidStateError),
]:
    case(f"pointers-{name}", call, expected)


def test_pointers_name_their_blocks_strided_or_not() -> None:
    """The block ids come back for every layer's pointers, also read from a strided view
    (copied, not read in place) and across two groups; the same call with a changed pointer
    fails, so the check is not vacuous."""
    engine, pool, _ = make_engine()
    try:
        assert pointers(engine, [5, 0, 5, 7]).tolist() == [5, 0, 5, 7]
        strided = lambda p, z: (np.repeat(p, 2)[::2], np.repeat(z, 2)[::2])  # noqa: E731
        assert pointers(engine, [3, 1], change=strided).tolist() == [3, 1]
        with pytest.raises(InvalidArgumentError):
            pointers(engine, [3, 1], change=moved(2, PAGE))
    finally:
        engine.close()
        pool.close()


def store_after_close(e: TransferEngine) -> object:
    e.close()
    return e.store([0], [0])


def close_busy_pool(e: TransferEngine) -> object:
    e.keep = e.plan(store=True, gpu_block_ids=[0], chunk_ids=[0])  # holds the pool open
    return e.pool.close()


case("store-after-close", store_after_close, InvalidStateError)
case("close-pool-with-a-plan-pending", close_busy_pool, TransferError)


# --- groups and offsets -----------------------------------------------------------------------

for name, kwargs, expected in [
    ("groups-int", {"groups": 5}, InvalidTypeError),
    ("groups-str", {"groups": "ab"}, InvalidTypeError),
    ("groups-str-layer", {"groups": [[("x", 64)]]}, InvalidTypeError),
    ("groups-float-layer", {"groups": [[(0.9, 64)]]}, InvalidTypeError),  # never truncated to 0
    ("groups-bool-layer", {"groups": [[(True, 64)]]}, InvalidTypeError),
    ("groups-float-bytes", {"groups": [[(0, 64.0)]]}, InvalidTypeError),
    ("groups-triple", {"groups": [[(0, 64, 1)]]}, InvalidArgumentError),
    ("groups-single", {"groups": [[(0,)]]}, InvalidArgumentError),
    ("groups-int-ref", {"groups": [[0]]}, InvalidTypeError),
    ("groups-negative-layer", {"groups": [[(-1, 64)]]}, InvalidArgumentError),
    ("groups-layer-2**70", {"groups": [[(2**70, 64)]]}, InvalidArgumentError),
    ("groups-negative-bytes", {"groups": [[(0, -64)]]}, InvalidArgumentError),
    ("groups-bytes-2**70", {"groups": [[(0, 2**70)]]}, InvalidArgumentError),
    ("groups-layer-out-of-range", {"groups": [[(3, 64)]]}, InvalidArgumentError),
    ("offsets-int", {"offsets": 5}, InvalidTypeError),
    ("offsets-str", {"offsets": ["x"]}, InvalidTypeError),
    ("offsets-float", {"offsets": [0.0]}, InvalidTypeError),
    ("offsets-negative", {"offsets": [-64]}, InvalidArgumentError),
    ("offsets-2**70", {"offsets": [2**70]}, InvalidArgumentError),
    ("blocks_per_chunk-2**64", {"blocks_per_chunk": 2**64}, InvalidArgumentError),
]:
    case(
        f"engine-{name}",
        lambda *_, kw=kwargs: TransferEngine(
            layers_of((8, 64)), HostChunkPool(4, 64, pin=False), **kw
        ),
        expected,
    )


# --- the pool's methods -----------------------------------------------------------------------

for name, timeout, expected in [
    ("str", "x", InvalidTypeError),
    ("none", None, InvalidTypeError),
    ("bool", True, InvalidTypeError),
    ("nan", float("nan"), InvalidArgumentError),
    ("inf", float("inf"), InvalidArgumentError),
    ("2**2000", 2**2000, InvalidArgumentError),
]:
    case(
        f"wait_pinned-{name}",
        lambda e, t=timeout: e.pool.wait_pinned(t),
        expected,
        covers="HostChunkPool.wait_pinned",
    )
# Only the argument's type and range: how many threads actually start is bounded by
# `populate` itself (tests/transfer/test_transfer_populate.py).
for name, threads, expected in [
    ("str", "x", InvalidTypeError),
    ("float", 1.5, InvalidTypeError),
    ("negative", -1, InvalidArgumentError),
    ("2**70", 2**70, InvalidArgumentError),
]:
    case(
        f"populate-{name}",
        lambda e, t=threads: e.pool.populate(t),
        expected,
        covers="HostChunkPool.populate",
    )
case(
    "init-again",
    lambda e: e.pool.__init__(4, 64, pin=False),
    InvalidStateError,
    covers="HostChunkPool.__init__",
)


def tensor_of_closed_pool(*_: Any) -> object:
    pool = HostChunkPool(4, 64, pin=False)
    pool.close()
    return pool.tensor()


case("tensor-closed-pool", tensor_of_closed_pool, PoolClosedError, covers="HostChunkPool.tensor")


# --- a plan's methods -------------------------------------------------------------------------


def with_plan(call: Callable[[Any], object]) -> Callable[[TransferEngine], object]:
    return lambda e: call(e.plan(store=True, gpu_block_ids=[0], chunk_ids=[0]))


I64 = np.zeros(3, dtype=np.int64)
for name, call, expected in [
    ("num_pieces-negative", lambda p: p.num_pieces(-1), InvalidArgumentError),
    ("num_pieces-str", lambda p: p.num_pieces("x"), InvalidTypeError),
    ("num_pieces-float", lambda p: p.num_pieces(1.0), InvalidTypeError),
    ("num_pieces-2**64", lambda p: p.num_pieces(2**64), InvalidArgumentError),
    ("write_runs-list", lambda p: p.write_runs([1, 2, 3]), InvalidTypeError),
    ("write_runs-int32", lambda p: p.write_runs(np.zeros(3, dtype=np.int32)), InvalidTypeError),
    ("write_runs-short", lambda p: p.write_runs(np.zeros(1, dtype=np.int64)), InvalidArgumentError),
    ("write_runs-negative-pieces", lambda p: p.write_runs(I64.copy(), -1), InvalidArgumentError),
    (
        "write_block_table-negative",
        lambda p: p.write_block_table(-1, I64.copy()),
        InvalidArgumentError,
    ),
    ("write_block_table-str", lambda p: p.write_block_table("0", I64.copy()), InvalidTypeError),
    (
        "write_block_table-out-of-range",
        lambda p: p.write_block_table(5, I64.copy()),
        OutOfRangeError,
    ),
    ("write_block_table-list", lambda p: p.write_block_table(0, [0, 0, 0]), InvalidTypeError),
    (
        "write_block_table-short",
        lambda p: p.write_block_table(0, np.zeros(1, np.int64)),
        InvalidArgumentError,
    ),
]:
    case(f"plan.{name}", with_plan(call), expected, covers="Plan." + name.split("-")[0])


@pytest.mark.parametrize(("call", "expected", "ctor"), CASES)
def test_bad_transfer_input_is_typed_and_changes_nothing(
    call: Callable[..., object], expected: type[BaseException], ctor: bool
) -> None:
    if ctor:
        raises_exactly(call, expected)
        return
    engine, pool, layers = make_engine()
    first = engine.store([0], [1])  # one job before: the next id must follow it
    before = snapshot(engine, pool, layers)
    raises_exactly(lambda: call(engine), expected)
    if not engine.closed:
        assert snapshot(engine, pool, layers) == before
        assert engine.store([2], [3]) == first + 1, "a failed call consumed a job id"


def public_entry_points() -> set[str]:
    """Constructors and public methods that take an argument, of the transfer API's classes
    (and of the plans ``TransferEngine.plan`` returns)."""
    from kvcache import _core

    entry_points = {"HostChunkPool", "HostChunkPool.__init__", "TransferEngine"}
    for cls in (HostChunkPool, TransferEngine, _core.Plan):
        for name in dir(cls):
            attr = inspect.getattr_static(cls, name)
            if name.startswith("_") or isinstance(attr, property) or not callable(attr):
                continue
            params = inspect.signature(getattr(cls, name)).parameters
            if [p for p in params if p != "self"]:
                entry_points.add(f"{cls.__name__}.{name}")
    return entry_points


def test_the_catalogue_covers_every_entry_point() -> None:
    missing = public_entry_points() - COVERED
    assert not missing, f"no hostile case calls {sorted(missing)}"
    assert "Plan.write_runs" in public_entry_points(), "the entry points were not found"


def test_integer_types_other_than_int_are_read_exactly() -> None:
    """numpy integers in ``groups`` and ``offsets`` are integers (``__index__``); only bools
    and floats are refused."""
    pool = HostChunkPool(4, 64, pin=False)
    engine = TransferEngine(
        layers_of((8, 64)),
        pool,
        groups=[[(np.int64(0), np.int32(64))]],
        offsets=np.array([0], dtype=np.int64),
    )
    assert engine.num_groups == 1
    engine.close()
