"""Hostile input to ``kvcache.transfer`` (CPU tensors): every bad size, id or argument raises a
``kvcache.KvCacheError`` that is also the builtin the transfer API documents (``IndexError`` for
an id out of range, ``ValueError`` for a bad value or length, ``TypeError`` for a bad type,
``MemoryError`` when the system refuses the mapping, ``RuntimeError`` for a busy pool), and
changes nothing: the pool's bytes, the layers, the jobs in flight and the next job id.

The exact subclasses belong to the transfer API's own hierarchy; these cases assert the two
classes every caller relies on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvcache

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


def assert_typed(exc: BaseException, builtin: type[BaseException]) -> None:
    assert isinstance(exc, builtin), f"expected a {builtin.__name__}, got {exc!r}"
    assert isinstance(exc, kvcache.KvCacheError), f"not a KvCacheError: {exc!r}"


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
    "close": "HostChunkPool.close",
}


def case(
    name: str,
    call: Callable[..., object],
    builtin: type[BaseException],
    *,
    ctor: bool = False,
    covers: str | None = None,
    marks: Any = (),
) -> None:
    COVERED.add(covers or ENTRY_OF_PREFIX[name.split("-")[0]])
    CASES.append(pytest.param(call, builtin, ctor, id=name, marks=marks))


# --- HostChunkPool ----------------------------------------------------------------------------

for name, args, builtin in [
    ("zero-chunks", (0, 16), ValueError),
    ("negative-chunks", (-1, 16), ValueError),
    ("zero-bytes", (4, 0), ValueError),
    ("negative-bytes", (4, -16), ValueError),
    ("float-chunks", (1.5, 16), TypeError),
    ("bool-chunks", (True, 16), TypeError),
    ("str-chunks", ("4", 16), TypeError),
    ("none-chunks", (None, 16), TypeError),
    ("float-bytes", (4, 16.0), TypeError),
    ("chunks-2**70", (2**70, 16), ValueError),
    ("bytes-2**70", (4, 2**70), ValueError),
    ("product-overflows", (2**40, 2**40), ValueError),
    ("mapping-refused", (2**20, 2**40), MemoryError),
]:
    case(
        f"pool-{name}",
        lambda *_, a=args: HostChunkPool(*a, pin=False),
        builtin,
        ctor=True,
    )
for name, pin in [("str", "yes"), ("none", None), ("int", 1), ("float", 0.0)]:
    case(f"pool-pin-{name}", lambda *_, p=pin: HostChunkPool(4, 16, pin=p), ValueError, ctor=True)


# --- TransferEngine construction --------------------------------------------------------------


def layers_of(*shapes: tuple[int, ...]) -> list[Any]:
    return [torch.zeros(shape, dtype=torch.uint8) for shape in shapes]


for name, make, builtin in [
    ("no-layers", lambda pool: TransferEngine([], pool), ValueError),
    ("tensor-not-list", lambda pool: TransferEngine(torch.zeros(8, 64), pool), TypeError),
    ("int-layer", lambda pool: TransferEngine([5], pool), TypeError),
    ("scalar-layer", lambda pool: TransferEngine([torch.tensor(3)], pool), ValueError),
    ("empty-layer", lambda pool: TransferEngine(layers_of((0, 64)), pool), ValueError),
    ("empty-pages", lambda pool: TransferEngine(layers_of((8, 0)), pool), ValueError),
    (
        "strided-pages",
        lambda pool: TransferEngine([torch.zeros(8, 128, dtype=torch.uint8)[:, ::2]], pool),
        ValueError,
    ),
    ("page-mismatch", lambda pool: TransferEngine(layers_of((8, 32)), pool), ValueError),
    ("pool-object", lambda pool: TransferEngine(layers_of((8, 64)), object()), TypeError),
    (
        "blocks_per_chunk-0",
        lambda pool: TransferEngine(layers_of((8, 64)), pool, blocks_per_chunk=0),
        ValueError,
    ),
    (
        "blocks_per_chunk-2",
        lambda pool: TransferEngine(layers_of((8, 64)), pool, blocks_per_chunk=2),
        ValueError,
    ),
    (
        "blocks_per_chunk-bool",
        lambda pool: TransferEngine(layers_of((8, 64)), pool, blocks_per_chunk=True),
        TypeError,
    ),
    ("copy-mode", lambda pool: TransferEngine(layers_of((8, 64)), pool, copy="fast"), ValueError),
    (
        "kernel_programs-0",
        lambda pool: TransferEngine(layers_of((8, 64)), pool, kernel_programs=0),
        ValueError,
    ),
]:
    case(f"engine-{name}", lambda *_, make=make: make(HostChunkPool(4, 64, pin=False)), builtin)


def closed_pool_engine(*_: Any) -> object:
    pool = HostChunkPool(4, 64, pin=False)
    pool.close()
    return TransferEngine(layers_of((8, 64)), pool)


case("engine-closed-pool", closed_pool_engine, ValueError)


# --- ids --------------------------------------------------------------------------------------

ID_CASES: list[tuple[str, Any, Any, type[BaseException]]] = [
    ("chunk-out-of-range", [0], [NUM_CHUNKS], IndexError),
    ("block-out-of-range", [BLOCKS], [0], IndexError),
    ("negative-block", [-1], [0], IndexError),
    ("negative-chunk", [0], [-1], IndexError),
    ("block-beyond-int64", [2**70], [0], IndexError),
    ("chunk-beyond-int64", [0], [2**63], IndexError),
    ("uint64-beyond-int64", np.array([2**63], dtype=np.uint64), [0], IndexError),
    ("float-ids", [0.5], [0], TypeError),
    ("bool-ids", [True], [0], TypeError),
    ("str-ids", ["0"], [0], TypeError),
    ("object-ids", [0, None], [0, 1], TypeError),
    ("length-mismatch", [0], [0, 1], ValueError),
    ("two-d-ids", [[0]], [[0]], ValueError),
    ("scalar-ids", 0, [0], ValueError),
    ("none-ids", None, [0], ValueError),
]
for name, blocks, chunks, builtin in ID_CASES:
    case(f"store-{name}", lambda e, b=blocks, c=chunks: e.store(b, c), builtin)
    case(f"load-{name}", lambda e, b=blocks, c=chunks: e.load(c, b), builtin)
case("store-repeated-destination", lambda e: e.store([0, 1], [2, 2]), ValueError)
case("load-repeated-destination", lambda e: e.load([0, 1], [3, 3]), ValueError)
case(
    "plan-out-of-range", lambda e: e.plan(store=True, gpu_block_ids=[9], chunk_ids=[0]), IndexError
)
case("wait-never-issued", lambda e: e.wait([99]), ValueError)
case("wait-negative", lambda e: e.wait([-1]), ValueError)
case("wait-str", lambda e: e.wait(["0"]), TypeError)
case("wait-bool", lambda e: e.wait([True]), TypeError)


def store_after_close(e: TransferEngine) -> object:
    e.close()
    return e.store([0], [0])


def close_busy_pool(e: TransferEngine) -> object:
    e.keep = e.plan(store=True, gpu_block_ids=[0], chunk_ids=[0])  # holds the pool open
    return e.pool.close()


case("store-after-close", store_after_close, ValueError)
case("close-pool-with-a-plan-pending", close_busy_pool, RuntimeError)


# --- groups and offsets -----------------------------------------------------------------------

for name, kwargs, builtin in [
    ("groups-int", {"groups": 5}, TypeError),
    ("groups-str", {"groups": "ab"}, TypeError),
    ("groups-str-layer", {"groups": [[("x", 64)]]}, TypeError),
    ("groups-float-layer", {"groups": [[(0.9, 64)]]}, TypeError),  # never truncated to 0
    ("groups-bool-layer", {"groups": [[(True, 64)]]}, TypeError),
    ("groups-float-bytes", {"groups": [[(0, 64.0)]]}, TypeError),
    ("groups-triple", {"groups": [[(0, 64, 1)]]}, ValueError),
    ("groups-single", {"groups": [[(0,)]]}, ValueError),
    ("groups-int-ref", {"groups": [[0]]}, TypeError),
    ("groups-negative-layer", {"groups": [[(-1, 64)]]}, ValueError),
    ("groups-layer-2**70", {"groups": [[(2**70, 64)]]}, ValueError),
    ("groups-negative-bytes", {"groups": [[(0, -64)]]}, ValueError),
    ("groups-bytes-2**70", {"groups": [[(0, 2**70)]]}, ValueError),
    ("groups-layer-out-of-range", {"groups": [[(3, 64)]]}, ValueError),
    ("offsets-int", {"offsets": 5}, TypeError),
    ("offsets-str", {"offsets": ["x"]}, TypeError),
    ("offsets-float", {"offsets": [0.0]}, TypeError),
    ("offsets-negative", {"offsets": [-64]}, ValueError),
    ("offsets-2**70", {"offsets": [2**70]}, ValueError),
    ("blocks_per_chunk-2**64", {"blocks_per_chunk": 2**64}, ValueError),
]:
    case(
        f"engine-{name}",
        lambda *_, kw=kwargs: TransferEngine(
            layers_of((8, 64)), HostChunkPool(4, 64, pin=False), **kw
        ),
        builtin,
    )


# --- the pool's methods -----------------------------------------------------------------------

for name, timeout, builtin in [
    ("str", "x", TypeError),
    ("none", None, TypeError),
    ("bool", True, TypeError),
    ("nan", float("nan"), ValueError),
    ("inf", float("inf"), ValueError),
    ("2**2000", 2**2000, ValueError),
]:
    case(
        f"wait_pinned-{name}",
        lambda e, t=timeout: e.pool.wait_pinned(t),
        builtin,
        covers="HostChunkPool.wait_pinned",
    )
# Only the argument's type and range: how many threads actually start is bounded by
# `populate` itself (tests/test_transfer_populate.py).
for name, threads, builtin in [
    ("str", "x", TypeError),
    ("float", 1.5, TypeError),
    ("negative", -1, ValueError),
    ("2**70", 2**70, ValueError),
]:
    case(
        f"populate-{name}",
        lambda e, t=threads: e.pool.populate(t),
        builtin,
        covers="HostChunkPool.populate",
    )
case(
    "init-again",
    lambda e: e.pool.__init__(4, 64, pin=False),
    ValueError,
    covers="HostChunkPool.__init__",
)


def tensor_of_closed_pool(*_: Any) -> object:
    pool = HostChunkPool(4, 64, pin=False)
    pool.close()
    return pool.tensor()


case("tensor-closed-pool", tensor_of_closed_pool, BufferError, covers="HostChunkPool.tensor")


# --- a plan's methods -------------------------------------------------------------------------


def with_plan(call: Callable[[Any], object]) -> Callable[[TransferEngine], object]:
    return lambda e: call(e.plan(store=True, gpu_block_ids=[0], chunk_ids=[0]))


I64 = np.zeros(3, dtype=np.int64)
for name, call, builtin in [
    ("num_pieces-negative", lambda p: p.num_pieces(-1), ValueError),
    ("num_pieces-str", lambda p: p.num_pieces("x"), TypeError),
    ("num_pieces-float", lambda p: p.num_pieces(1.0), TypeError),
    ("num_pieces-2**64", lambda p: p.num_pieces(2**64), ValueError),
    ("write_runs-list", lambda p: p.write_runs([1, 2, 3]), TypeError),
    ("write_runs-int32", lambda p: p.write_runs(np.zeros(3, dtype=np.int32)), TypeError),
    ("write_runs-short", lambda p: p.write_runs(np.zeros(1, dtype=np.int64)), ValueError),
    ("write_runs-negative-pieces", lambda p: p.write_runs(I64.copy(), -1), ValueError),
    ("write_block_table-negative", lambda p: p.write_block_table(-1, I64.copy()), ValueError),
    ("write_block_table-str", lambda p: p.write_block_table("0", I64.copy()), TypeError),
    ("write_block_table-out-of-range", lambda p: p.write_block_table(5, I64.copy()), IndexError),
    ("write_block_table-list", lambda p: p.write_block_table(0, [0, 0, 0]), TypeError),
    (
        "write_block_table-short",
        lambda p: p.write_block_table(0, np.zeros(1, np.int64)),
        ValueError,
    ),
]:
    case(f"plan.{name}", with_plan(call), builtin, covers="Plan." + name.split("-")[0])


@pytest.mark.parametrize(("call", "builtin", "ctor"), CASES)
def test_bad_transfer_input_is_typed_and_changes_nothing(
    call: Callable[..., object], builtin: type[BaseException], ctor: bool
) -> None:
    if ctor:
        with pytest.raises(builtin) as info:
            call()
        assert_typed(info.value, builtin)
        return
    engine, pool, layers = make_engine()
    first = engine.store([0], [1])  # one job before: the next id must follow it
    before = snapshot(engine, pool, layers)
    with pytest.raises(builtin) as info:
        call(engine)
    if not engine.closed:
        assert snapshot(engine, pool, layers) == before
        assert engine.store([2], [3]) == first + 1, "a failed call consumed a job id"
    assert_typed(info.value, builtin)


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
