"""Nothing leaks: reference cycles through kvcache objects are collected, and long runs with a
stable working set do not grow.

Cycles: a chunk that references its policy, and a result object (one of the manager's
``_result_types``) that references its manager, are cycles through Rust objects, which the
garbage collector can only break if the policy and the manager report what they hold
(``__traverse__``) and can drop it (``__clear__``); a transfer engine its own layers and pool
reference is collected too. A chunk table (``chunk_table()``) is a copy that references no
manager, so keeping one closes no cycle. Weak references show the collection.

Leaks: 10**5 calls per workload (stores, loads, evictions, request contexts that come and
go, errors raised and caught), in a fresh interpreter: after a warm-up, resident memory and
Python allocations (``tracemalloc``) must not grow in proportion to the calls. The bounds are
generous (megabytes for hundreds of thousands of calls): they catch a leak per call, not
allocator noise. No timing is asserted.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import gc
import weakref

import pytest

import kvcache
from tests.support.hostile import Isolated, run_isolated
from tests.support.keys import make_key


class Chunk(ctypes.Structure):
    """vLLM's ChunkStatus layout (a Python subclass: it takes attributes and weak references)."""

    _fields_ = [("ref_cnt", ctypes.c_int32), ("chunk_id", ctypes.c_int64)]


@pytest.mark.parametrize("cls", list(kvcache.POLICY_KINDS.values()))
def test_a_chunk_that_references_its_policy_is_collected(cls: type) -> None:
    policy = cls(4)
    chunk = Chunk(0, 0)
    chunk.owner = policy
    policy.insert(make_key(0), chunk)
    dead = weakref.ref(chunk)
    del policy, chunk
    gc.collect()
    assert dead() is None, "the policy and its chunk were never collected"


@pytest.mark.parametrize("cls", list(kvcache.POLICY_KINDS.values()))
def test_a_policy_without_a_cycle_is_freed_at_once(cls: type) -> None:
    policy = cls(4)
    chunk = Chunk(0, 0)
    policy.insert(make_key(0), chunk)
    dead = weakref.ref(chunk)
    del chunk
    assert dead() is not None, "the policy keeps its chunk alive"
    del policy
    assert dead() is None


@pytest.mark.parametrize("cls", list(kvcache.POLICY_KINDS.values()))
def test_a_policy_reachable_only_from_its_own_chunks_is_collected(cls: type) -> None:
    """Many chunks, each referencing the policy (every chunk closes a cycle)."""
    policy = cls(64)
    chunks = [Chunk(0, i) for i in range(32)]
    for i, chunk in enumerate(chunks):
        chunk.owner = policy
        policy.insert(make_key(i), chunk)
    dead = [weakref.ref(c) for c in chunks]
    del policy, chunks, chunk
    gc.collect()
    assert all(d() is None for d in dead)


@pytest.mark.parametrize("cls", list(kvcache.POLICY_KINDS.values()))
def test_a_policy_can_be_weakly_referenced(cls: type) -> None:
    policy = cls(4)
    ref = weakref.ref(policy)
    assert ref() is policy
    del policy
    assert ref() is None


def our_manager() -> kvcache.OffloadingManager:
    return kvcache.OffloadingManager(4)


def vllm_manager() -> object:
    from kvcache.vllm import CPUOffloadingManager

    return CPUOffloadingManager(num_chunks=4)


class Holder:
    """A result object that can refer back to the manager that returns it."""


@pytest.mark.parametrize("base", [kvcache.OffloadingManager, "vllm"], ids=["ours", "vllm"])
def test_a_manager_whose_result_objects_reference_it_is_collected(base: object) -> None:
    """The manager holds its result types in Rust: a result that refers back to the manager
    closes a cycle only the manager's traversal can show the collector."""
    from types import SimpleNamespace

    if base == "vllm":
        from kvcache.vllm import CPUOffloadingManager as base
    assert isinstance(base, type)
    miss = Holder()
    types = SimpleNamespace(**{**vars(base._result_types), "miss": miss})
    manager = type("Patched", (base,), {"_result_types": types})(4)
    del types
    assert manager.lookup(make_key(0)) is miss
    miss.manager = manager
    dead = weakref.ref(manager)
    del manager, miss
    gc.collect()
    assert dead() is None, "the manager and its result object were never collected"


@pytest.mark.parametrize("cls", list(kvcache.POLICY_KINDS.values()))
def test_a_collected_cycle_never_clears_a_live_exporter(cls: type) -> None:
    """A ``PickleBuffer``'s export is held by its ``bytearray``, not by the buffer itself: the
    policy owns one reference to each, and must report exactly those."""
    import pickle

    pb = pickle.PickleBuffer(bytearray(16))
    policy = cls(4)
    policy.insert(make_key(0), pb)
    cycle: list[object] = [policy]
    cycle.append(cycle)
    del policy, cycle
    gc.collect()
    assert pb.raw().nbytes == 16, "the collector released a buffer that is still in use"


@pytest.mark.parametrize("make", [our_manager, vllm_manager], ids=["ours", "vllm"])
def test_a_chunk_table_copy_outlives_its_manager_without_keeping_it(make: object) -> None:
    manager = make()
    table = manager.chunk_table()
    used = len(table)
    dead = weakref.ref(manager)
    del manager
    assert dead() is None, "the copy holds no reference to its manager"
    assert memoryview(table).nbytes == used * 16


def test_a_transfer_engine_referenced_from_its_layers_is_collected() -> None:
    torch = pytest.importorskip("torch")
    from kvcache.transfer import HostChunkPool, TransferEngine

    pool = HostChunkPool(4, 64, pin=False)
    layer = torch.zeros(8, 64, dtype=torch.uint8)
    engine = TransferEngine([layer], pool)
    layer.engine = engine
    pool.engine = engine
    dead = weakref.ref(engine)
    del engine, layer, pool
    gc.collect()
    assert dead() is None


# --- leaks ------------------------------------------------------------------------------------

LEAK_SCRIPT = """
import gc, tracemalloc
import kvcache

TARGET = {target!r}
UNIVERSE = [i.to_bytes(32, "big") + bytes(4) for i in range(1024)]


class Boom(Exception):
    pass


def bad_keys():
    yield UNIVERSE[0]
    raise Boom()


def policy_round(p, r, seq):
    ctx = kvcache.ReqContext(str(r))
    keys = [UNIVERSE[(r * 7 + j * 13) % len(UNIVERSE)] for j in range(8)]
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, 16 * (j + 1))
    p.on_request_access(keys, ctx)
    for k in keys:
        if k not in p:
            if len(p) >= p.cache_capacity:
                p.evict(1, keys)
            chunk = kvcache.ChunkStatus(next(seq))
            chunk.ref_cnt = 0
            p.insert(k, chunk, ctx)
    p.touch(keys, ctx)
    p.on_request_finished([keys], set(keys[:2]), set(keys[2:4]), ctx)
    if r % 16 == 0:
        for call in (lambda: p.touch([1]), lambda: p.evict(-1, ()), lambda: p.touch(bad_keys())):
            try:
                call()
            except (kvcache.KvCacheError, Boom):
                pass
    return 4 + 2 * len(keys)


def manager_round(m, r, seq):
    ctx = kvcache.ReqContext(str(r))
    keys = [UNIVERSE[(r * 7 + j * 13) % len(UNIVERSE)] for j in range(8)]
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, 16 * (j + 1))
    m.on_new_request(ctx)
    hits = [k for k in keys if m.lookup(k, ctx) is kvcache.LookupResult.HIT]
    if hits:
        m.prepare_load(hits, ctx)
        m.complete_load(hits, ctx)
    out = m.prepare_store(keys, ctx)
    if out is not None:
        list(out.evicted_keys)
        m.complete_store(out.keys_to_store, ctx, r % 10 != 0)
    m.touch(keys, ctx)
    m.on_request_finished(ctx)
    if r % 4 == 0:
        m.take_events()
    if r % 16 == 0:
        for call in (lambda: m.lookup(1), lambda: m.prepare_load([UNIVERSE[-1]] * 2, ctx),
                     lambda: m.prepare_store(bad_keys(), ctx)):
            try:
                call()
            except (kvcache.KvCacheError, Boom):
                pass
        m.get_stats()
    return 8 + len(keys)


if TARGET.startswith("policy"):
    # vLLM 0.33's protocol: the rounds touch.
    cls = kvcache.LRUCachePolicy if TARGET.endswith("lru") else kvcache.ARCCachePolicy
    obj = cls(256, vllm_semantics="0.33")
    one_round = policy_round
else:
    obj = kvcache.OffloadingManager(
        256, TARGET.split("-")[1], enable_events=True, vllm_semantics="0.33"
    )
    one_round = manager_round

import itertools
seq = itertools.count()
calls = 0
r = 0
while calls < {warmup}:
    calls += one_round(obj, r, seq)
    r += 1
gc.collect()
tracemalloc.start()
rss = status("VmRSS")
traced = tracemalloc.get_traced_memory()[0]
measured = 0
while measured < {calls}:
    measured += one_round(obj, r, seq)
    r += 1
gc.collect()
obj.validate()
report(
    calls=measured,
    rss_growth=status("VmRSS") - rss,
    traced_growth=tracemalloc.get_traced_memory()[0] - traced,
    resident=len(obj),
)
"""


LEAK_TARGETS = ["policy-lru", "policy-arc", "manager-lru", "manager-arc"]
LEAK_CALLS = 100_000


@functools.cache
def leak_runs() -> dict[str, Isolated]:
    """The four workloads, each in its own interpreter, run side by side (wall time)."""
    with concurrent.futures.ThreadPoolExecutor(len(LEAK_TARGETS)) as pool:
        runs = pool.map(
            lambda t: run_isolated(
                LEAK_SCRIPT.format(target=t, warmup=20_000, calls=LEAK_CALLS), timeout=300
            ),
            LEAK_TARGETS,
        )
        return dict(zip(LEAK_TARGETS, runs, strict=True))


@pytest.mark.parametrize("target", LEAK_TARGETS)
def test_a_stable_working_set_does_not_grow(target: str) -> None:
    report = leak_runs()[target].check()
    assert report["calls"] >= LEAK_CALLS
    # 4 MiB over 10**5 calls: a leak of 40 bytes per call would exceed it (measured here:
    # 0.2 MiB for the policies and nothing for the managers, the same for 4 x 10**5 calls).
    assert report["rss_growth"] < 4 << 20, report
    assert report["traced_growth"] < 1 << 20, report


# A pool over a caller's buffer holds that buffer's export (its memory must stay valid), so
# the exporter is alive for as long as the pool is. A cycle back to the pool through the
# exporter (an attribute of a numpy or mmap subclass), directly or through an engine over the
# pool, was never collected: the pool did not report the exporter to the collector. It does
# now, while no transfer uses the memory: a plan not yet run keeps both alive, and the
# export, until it is dropped, and a layout keeps its pool reachable.
POOL_CYCLE = """
import gc, mmap, weakref
import numpy as np
from kvcache import _core
from kvcache.transfer import HostChunkPool

class Array(np.ndarray):
    pass

class Mapping(mmap.mmap):
    pass

def owner(kind):
    if kind == "numpy-subclass":
        return np.frombuffer(mmap.mmap(-1, 8192), dtype=np.uint8).view(Array)
    return Mapping(-1, 8192)

results = {}
for kind in ("numpy-subclass", "mmap-subclass"):
    buf = owner(kind)
    pool = HostChunkPool(2, 4096, pin=False, buffer=buf)
    buf.pool = pool
    dead = weakref.ref(pool)
    del buf, pool
    gc.collect()
    results[kind] = dead() is None

# A plan holds the memory: the cycle stays, and the memory stays valid, until it is dropped.
buf = owner("numpy-subclass")
pool = HostChunkPool(2, 4096, pin=False, buffer=buf)
buf.pool = pool
buf[:] = 7
layout = _core.TransferLayout(pool, [(1 << 40, 4096, 4096, 4, 0)], 1)
plan = layout.plan(True, [0], [1])
dead = weakref.ref(pool)
del buf, pool, layout
gc.collect()
results["kept-while-planned"] = dead() is not None
results["memory-while-planned"] = bytes(memoryview(dead())[:4]) == bytes([7] * 4)
del plan
gc.collect()
results["collected-after"] = dead() is None

# Through an engine (its layout shares the pool's memory) after a finished job.
import torch
from kvcache.transfer import TransferEngine
buf = owner("numpy-subclass")
pool = HostChunkPool(8, 1024, pin=False, buffer=buf)
engine = TransferEngine([torch.zeros(8, 1024, dtype=torch.uint8)], pool)
engine.wait([engine.store([0], [1])])
buf.engine = engine
dead = weakref.ref(pool)
del buf, pool, engine
gc.collect()
results["through-an-engine"] = dead() is None

# A layout that can still plan keeps its pool, and the buffer, alive.
buf = owner("numpy-subclass")
pool = HostChunkPool(2, 4096, pin=False, buffer=buf)
buf.pool = pool
layout = _core.TransferLayout(pool, [(1 << 40, 4096, 4096, 4, 0)], 1)
dead = weakref.ref(pool)
del buf, pool
gc.collect()
results["kept-by-a-layout"] = dead() is not None and len(layout.plan(True, [0], [1])) == 1
report(**results)
"""


def test_a_pool_referenced_from_the_buffer_it_is_built_over_is_collected() -> None:
    report = run_isolated(POOL_CYCLE).check()
    del report["vm_peak"], report["rss_peak"]
    assert report == dict.fromkeys(report, True), report
