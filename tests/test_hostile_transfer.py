"""Hostile input to ``kvcache.transfer`` (CPU tensors): every bad size, id or argument raises a
``kvcache.KvCacheError`` that is also the builtin the transfer API documents (``IndexError`` for
an id out of range, ``ValueError`` for a bad value or length, ``TypeError`` for a bad type,
``MemoryError`` when the system refuses the mapping, ``RuntimeError`` for a busy pool), and
changes nothing: the pool's bytes, the layers, the jobs in flight and the next job id.

The exact subclasses belong to the transfer API's own hierarchy; these cases assert the two
classes every caller relies on.
"""

from __future__ import annotations

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


def case(
    name: str, call: Callable[..., object], builtin: type[BaseException], *, ctor: bool = False
) -> None:
    CASES.append(pytest.param(call, builtin, ctor, id=name))


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


def test_the_catalogue_covers_every_entry_point() -> None:
    assert len(CASES) >= 60
