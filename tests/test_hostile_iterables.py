"""Every binding that reads a caller's iterable, given one that never ends, too long or lying
about its length: each case runs in a fresh interpreter under a memory watchdog, so an abort
(a failed Rust allocation) fails its case instead of the test run.

An endless iterable, one of ``MAX_ITEMS + 1`` items, the same under an address-space limit a
few MiB above what the process holds, and one that raises Ctrl-C while it is read: each must
raise (``InvalidArgumentError``, ``InvalidArgumentError``, ``OutOfMemoryError``,
``KeyboardInterrupt`` within a few thousand items) and leave the object as it was. The cases
name every entry point listed beside ``conversion::Drain`` in the bindings.
"""

from __future__ import annotations

import pytest

from tests.hostile import run_isolated

HEADER = """
import _thread, ctypes, itertools, resource, signal
from operator import itemgetter
import numpy as np
import kvcache
from kvcache import _core

MAX = getattr(_core, "MAX_ITEMS", 1 << 22)  # also runs against builds from before the bound
K = [bytes([i]) * 32 for i in range(8)]
LAYER = (1 << 40, 64, 64, 4, 0)  # a device layer: base, block stride, page bytes, blocks, segment

class Liar:  # a sequence that claims 2**40 items and holds a few
    def __init__(self, items):
        self.items = items
    def __len__(self):
        return 1 << 40
    def __getitem__(self, i):
        return self.items[i]

def chunk(i):
    c = kvcache.ChunkStatus(i)
    c.ref_cnt = 0
    return c

def policy(cls, **kw):
    p = cls(8, **kw)
    ctx = kvcache.ReqContext("r0")
    for i in range(4):
        ctx.set_offload_key_position(K[i], 16 * (i + 1))
        p.insert(K[i], chunk(i), ctx)
    return p, ctx

def manager(policy="lru", **kw):
    m = kvcache.OffloadingManager(8, policy, **kw)
    ctx = kvcache.ReqContext("r0")
    m.prepare_store(K[:4], ctx)
    m.complete_store(K[:2])
    m.prepare_load(K[:1], ctx)
    return m, ctx

obj = None
{setup}

def state():
    if isinstance(obj, kvcache.BaseCachePolicy):
        obj.validate()
        return obj._debug_state(), len(obj)
    if isinstance(obj, kvcache.OffloadingManager):
        obj.validate()
        return (obj._debug_state(), len(obj), obj.num_evictable, obj.num_write_pending,
                obj.num_requests, bytes(memoryview(obj.chunk_table())))
    if isinstance(obj, _core.CpuCopier):
        return obj.in_flight(), obj.poll()
    return None

def vm_size():
    return status("VmSize")

# Runs `run()` with the address space limited to `headroom` bytes above its size now. Large
# blocks are always mapped and unmapped (glibc's M_MMAP_THRESHOLD, fixed), so that memory
# freed by an earlier call does not sit in the heap, unseen by the limit.
def limited(headroom, run):
    ctypes.CDLL(None).mallopt(-3, 128 << 10)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + headroom, hard))
    try:
        return run()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

def attempt(items):
    before = state()
    try:
        call(items)
        outcome, message = "returned", ""
    except BaseException as exc:
        outcome, message = type(exc).__name__, str(exc)
    return {"outcome": outcome, "message": message, "unchanged": state() == before}

"""

# Each endless-iterable case: {setup} defines `obj` (or None), `call(items)` and the `ITEM`
# the hostile iterables repeat.
ITERABLE = (
    HEADER
    + """
signal.signal(signal.SIGINT, signal.default_int_handler)
results = {}
results["memory"] = limited(4 << 20, lambda: attempt(itertools.repeat(ITEM)))
results["endless"] = attempt(itertools.repeat(ITEM))
results["long"] = attempt([ITEM] * (MAX + 1))
# Ctrl-C while an iterator written in C is read (no bytecode runs, so Python never looks at
# the pending signal): interrupt_main marks SIGINT pending, without handling it, per item.
counter = itertools.count()
interrupting = map(itemgetter(1), zip(
    map(_thread.interrupt_main, itertools.repeat(signal.SIGINT)), itertools.repeat(ITEM), counter
))
try:
    results["interrupt"] = attempt(interrupting)
except KeyboardInterrupt:  # handled only after the call returned: the drain did not look
    results["interrupt"] = {"outcome": "late KeyboardInterrupt", "unchanged": None}
results["interrupt"]["read"] = next(counter)
FINISH
"""
)

# One call, with the address space limited when LIMIT is not None.
ONE_CALL = (
    HEADER
    + """
signal.signal(signal.SIGINT, signal.default_int_handler)
run = lambda: attempt(ARG)
results = {"call": run() if LIMIT is None else limited(LIMIT, run)}
FINISH
"""
)

FINISH = """
if isinstance(obj, _core.CpuCopier):
    obj.shutdown()
report(**results)
"""

POLICY = "obj, ctx = policy(kvcache.TurnCachePolicy)"
MANAGER = "obj, ctx = manager(vllm_semantics='0.33')"

# (id, setup, the item the hostile iterable repeats, the call that passes it as `items`).
CASES = [
    (
        "policy.touch",
        "obj, ctx = policy(kvcache.LRUCachePolicy, vllm_semantics='0.33')",
        "K[0]",
        "obj.touch(items)",
    ),
    ("policy.on_store_miss", POLICY, "K[0]", "obj.on_store_miss(items)"),
    ("policy.on_request_access", POLICY, "K[5]", "obj.on_request_access(items, ctx)"),
    (
        "policy.on_request_finished.key_groups",
        POLICY,
        "[]",
        "obj.on_request_finished(items, set(), set(), ctx)",
    ),
    (
        "policy.on_request_finished.one_group",
        POLICY,
        "K[0]",
        "obj.on_request_finished([K[:2], items], set(), set(), ctx)",
    ),
    ("policy.evict.protected", POLICY, "K[0]", "obj.evict(1, items)"),
    (
        "order_request_keys",
        "ctx = kvcache.ReqContext('r0')",
        "[K[0]]",
        "kvcache.order_request_keys(items, ctx)",
    ),
    ("manager.prepare_load", MANAGER, "K[0]", "obj.prepare_load(items, ctx)"),
    ("manager.prepare_store", MANAGER, "K[6]", "obj.prepare_store(items, ctx)"),
    ("manager.touch", MANAGER, "K[0]", "obj.touch(items)"),
    ("manager.complete_load", MANAGER, "K[0]", "obj.complete_load(items)"),
    ("manager.complete_store", MANAGER, "K[2]", "obj.complete_store(items)"),
    # vLLM 0.34's primary tier (tiering).
    ("manager.prepare_read", MANAGER, "K[0]", "obj.prepare_read(items)"),
    ("manager.defer_write_release", MANAGER, "K[2]", "obj.defer_write_release(items)"),
    # (release_deferred_write reads no more ids than chunks are deferred: an endless
    # iterable is refused after one item more, tests/test_tiering_conformance.py.)
    (
        "manager._hint_next_uses.keys",
        "obj, ctx = manager('belady')",
        "K[0]",
        "obj._hint_next_uses(items, [1])",
    ),
    (
        "manager._hint_next_uses.next_uses",
        "obj, ctx = manager('belady')",
        "1",
        "obj._hint_next_uses([K[0]], items)",
    ),
    ("LoadStoreSpec.block_ids", "", "1", "kvcache.LoadStoreSpec(items)"),
    (
        "TransferLayout.layers",
        "pool = _core.HostChunkPool(4, 64)",
        "LAYER",
        "_core.TransferLayout(pool, items, 1)",
    ),
    (
        "TransferLayout.groups",
        "pool = _core.HostChunkPool(4, 64)",
        "[]",
        "_core.TransferLayout(pool, [LAYER], 1, items)",
    ),
    (
        "TransferLayout.groups.pairs",
        "pool = _core.HostChunkPool(4, 64)",
        "(0, 64)",
        "_core.TransferLayout(pool, [LAYER], 1, [items])",
    ),
    (
        "TransferLayout.offsets",
        "pool = _core.HostChunkPool(4, 64)",
        "0",
        "_core.TransferLayout(pool, [LAYER], 1, None, items)",
    ),
    ("CpuCopier.wait.job_ids", "obj = _core.CpuCopier()", "7", "obj.wait(items)"),
]


def _script(template: str, setup: str, call: str, **values: str) -> str:
    head = "\n".join([setup, *(f"{k} = {v}" for k, v in values.items())])
    head += f"\ndef call(items):\n    {call}\n"
    return template.replace("{setup}", head).replace("FINISH", FINISH)


@pytest.mark.parametrize(
    ("setup", "item", "call"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_hostile_iterable_raises_and_changes_nothing(setup: str, item: str, call: str) -> None:
    report = run_isolated(_script(ITERABLE, setup, call, ITEM=item), max_rss=1536 << 20).check()
    expected = {
        "endless": "InvalidArgumentError",
        "long": "InvalidArgumentError",
        "memory": "OutOfMemoryError",
        "interrupt": "KeyboardInterrupt",
    }
    for mode, outcome in expected.items():
        assert report[mode]["outcome"] == outcome, (mode, report[mode])
        assert report[mode]["unchanged"], (mode, report[mode])
    assert "most kvcache reads" in report["endless"]["message"]
    # The drain looks for signals every 2**14 items, long before the bound (2**22).
    assert report["interrupt"]["read"] <= 2 * (1 << 14), report["interrupt"]


# A sequence whose `__len__` claims 2**40 items sized pyo3's vectors ("memory allocation of
# 8796093022208 bytes failed"): each is now read as the three items it holds.
LIARS = [
    (
        "manager._hint_next_uses",
        "obj, ctx = manager('belady')",
        "obj._hint_next_uses(K[:3], items)",
        "Liar([1, 2, 3])",
    ),
    (
        "TransferLayout.layers",
        "pool = _core.HostChunkPool(4, 64)",
        "_core.TransferLayout(pool, items, 1)",
        "Liar([LAYER])",
    ),
    ("CpuCopier.wait", "obj = _core.CpuCopier()", "obj.wait(items)", "Liar([1, 2, 3])"),
    ("policy.evict", POLICY, "obj.evict(1, items)", "Liar([K[0]])"),
]


@pytest.mark.parametrize(
    ("setup", "call", "arg"), [c[1:] for c in LIARS], ids=[c[0] for c in LIARS]
)
def test_a_length_never_sizes_an_allocation(setup: str, call: str, arg: str) -> None:
    script = _script(ONE_CALL, setup, call, ARG=arg, LIMIT="None")
    report = run_isolated(script, max_rss=1536 << 20).check()
    assert report["call"]["outcome"] == "returned", report


# Block and chunk ids as a zero-stride numpy view: eight bytes that claim 2**40 ids. Their
# copy was sized by that count ("memory allocation of 8796093022208 bytes failed").
PLAN = "pool = _core.HostChunkPool(4, 64); layout = _core.TransferLayout(pool, [LAYER], 1)"
STRIDES = [
    ("int64", "np.broadcast_to(np.int64(0), (1 << 40,))", "None", "InvalidArgumentError"),
    ("int32", "np.broadcast_to(np.int32(0), (1 << 40,))", "None", "InvalidArgumentError"),
    (
        "uint64-via-as_ids",
        "np.broadcast_to(np.uint64(0), (1 << 40,))",
        "None",
        "InvalidArgumentError",
    ),
    (
        "int64-within-the-bound-out-of-memory",
        "np.broadcast_to(np.int64(0), (MAX,))",
        "4 << 20",
        "OutOfMemoryError",
    ),
]


@pytest.mark.parametrize(
    ("arg", "limit", "expected"), [c[1:] for c in STRIDES], ids=[c[0] for c in STRIDES]
)
def test_zero_stride_ids_raise(arg: str, limit: str, expected: str) -> None:
    script = _script(ONE_CALL, PLAN, "layout.plan(True, items, [0])", ARG=arg, LIMIT=limit)
    report = run_isolated(script, max_rss=1536 << 20).check()
    assert report["call"]["outcome"] == expected, report


# The transfer engine's Python methods read some arguments in Python first: the same bound.
ENGINE = """
import itertools, torch
import numpy as np
from kvcache.transfer import HostChunkPool, TransferEngine

pool = HostChunkPool(4, 64, pin=False)
np.frombuffer(pool, dtype=np.uint8)[:] = np.arange(pool.nbytes, dtype=np.uint8)
layer = torch.arange(64, dtype=torch.float32).reshape(4, 16)
engine = TransferEngine([layer], pool)
job = engine.load([0], [1])
engine.wait([job])
before = (bytes(memoryview(pool)), layer.clone(), engine.poll())
try:
    {call}
    outcome = "returned"
except BaseException as exc:
    outcome = type(exc).__name__
after = (bytes(memoryview(pool)), layer, engine.poll())
unchanged = before[0] == after[0] and torch.equal(before[1], after[1]) and after[2] == []
report(outcome=outcome, unchanged=unchanged)
"""

ENGINE_CASES = [
    # The same valid id forever: a set of one id, filled without end (a hang).
    ("wait.job_ids", "engine.wait(itertools.repeat(job))"),
    ("gpu_layers", "TransferEngine(itertools.repeat(layer), pool)"),
    ("groups", "TransferEngine([layer], pool, groups=(g for g in itertools.repeat([])))"),
    ("offsets", "TransferEngine([layer], pool, offsets=iter(itertools.repeat(0)))"),
]


@pytest.mark.parametrize("call", [c[1] for c in ENGINE_CASES], ids=[c[0] for c in ENGINE_CASES])
def test_an_endless_iterable_to_the_transfer_engine_raises(call: str) -> None:
    pytest.importorskip("torch")
    report = run_isolated(ENGINE.replace("{call}", call), max_rss=1536 << 20).check()
    assert report["outcome"] == "InvalidArgumentError", report
    assert report["unchanged"], report
