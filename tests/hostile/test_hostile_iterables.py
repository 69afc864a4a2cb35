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

from tests.support.hostile import run_isolated

HEADER = """
import _thread, ctypes, itertools, resource, signal
from operator import itemgetter
import numpy as np
import kvcache
from kvcache import _core

MAX = getattr(_core, "MAX_ITEMS", 1 << 22)  # also runs against builds from before the bound
K = [bytes([i]) * 32 for i in range(8)]
LAYER = (1 << 40, 64, 64, 4, 0)  # a device layer: base, block stride, page bytes, blocks, segment

class Liar:  # a sequence that claims `n` items and holds `items`; counts the items read
    read = 0
    def __init__(self, items, n=1 << 40):
        self.items, self.n = items, n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        Liar.read += 1
        return self.items[i]

class Endless(Liar):  # claims a few items and never ends (the old sequence protocol)
    def __getitem__(self, i):
        Liar.read += 1
        return self.items[0]

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
    # iterable is refused after one item more, tests/tiering/test_tiering_conformance.py.)
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


# What an argument says it holds is checked against the bound before anything is read: a
# sequence whose `__len__` claims 2**40 items once sized pyo3's vectors ("memory allocation of
# 8796093022208 bytes failed") and then was read item by item, and `range(2**25)` as transfer
# ids was converted whole (+1.5 GiB, 3.8 s) before it was refused, and a negative `__len__`
# surfaced as a bare ValueError. Each is refused now with no item read; a length that claims a
# few items and never ends stops one past the bound.
LENGTHS = (
    HEADER
    + """
signal.signal(signal.SIGINT, signal.default_int_handler)
results = {}
for name, make in [
    ("liar", lambda: Liar([ITEM] * 3)),
    ("range", lambda: range(1 << 25)),
    ("range-past-an-index", lambda: range(1 << 70)),
    ("negative-length", lambda: Liar([ITEM] * 3, -1)),
]:
    Liar.read = 0
    results[name] = attempt(make())
    results[name]["read"] = Liar.read
Liar.read = 0
results["endless"] = attempt(Endless([ITEM], 3))
results["endless"]["read"] = Liar.read
FINISH
"""
)


@pytest.mark.parametrize(
    ("setup", "item", "call"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_length_is_checked_before_anything_is_read(setup: str, item: str, call: str) -> None:
    report = run_isolated(_script(LENGTHS, setup, call, ITEM=item), max_rss=1536 << 20).check()
    for mode in ("liar", "range", "range-past-an-index"):
        assert report[mode]["outcome"] == "InvalidArgumentError", (mode, report[mode])
        assert "most kvcache reads" in report[mode]["message"], (mode, report[mode])
        assert report[mode]["read"] == 0, (mode, report[mode])
        assert report[mode]["unchanged"], (mode, report[mode])
    # A negative `__len__` is Python's ValueError inside len(): a length that cannot be true,
    # refused as the argument's, with nothing read.
    negative = report["negative-length"]
    assert negative["outcome"] == "InvalidArgumentError", negative
    assert "length cannot be read" in negative["message"], negative
    assert negative["read"] == 0, negative
    assert negative["unchanged"], negative
    endless = report["endless"]
    assert endless["outcome"] == "InvalidArgumentError", endless
    assert endless["read"] <= (1 << 22) + 1, endless
    assert endless["unchanged"], endless
    # Nothing the size of the arguments was made: 2**25 ints are 256 MiB as int64 alone.
    assert report["rss_peak"] < 320 << 20, report


# Arguments with a bound of their own (a layout's groups, the deferred chunks) refuse a
# longer length before reading too.
OWN_BOUNDS = [
    (
        "TransferLayout.plan.group_sizes",
        "pool = _core.HostChunkPool(4, 64); layout = _core.TransferLayout(pool, [LAYER], 1)",
        "layout.plan(True, [0], [0], items, [0])",
    ),
    (
        "manager.release_deferred_write",
        MANAGER,
        "obj.release_deferred_write(items)",
    ),
]


@pytest.mark.parametrize(
    ("setup", "call"), [c[1:] for c in OWN_BOUNDS], ids=[c[0] for c in OWN_BOUNDS]
)
def test_a_length_past_an_arguments_own_bound_is_refused_unread(setup: str, call: str) -> None:
    script = _script(ONE_CALL, setup, call, ARG="Liar([0] * 3)", LIMIT="None")
    report = run_isolated(script.replace("report(**results)", "report(read=Liar.read, **results)"))
    report = report.check()
    assert report["call"]["outcome"] == "InvalidArgumentError", report
    assert report["read"] == 0, report


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


# Block and chunk ids that are not an int64 or int32 array are converted in Python
# (`kvcache.transfer._checks.as_ids`), under the same rules: `range(2**25)` was converted
# whole (+1.5 GiB) and `[range(2**25)]` expanded by numpy before either was refused, a length
# of 2**40 ended in a bare `MemoryError`, and a sequence that claims 3 items and never ends was
# read until memory ran out (49 s, 4.6 GiB).
IDS = [
    ("length-2**40", "Liar([0] * 3)", "None", "InvalidArgumentError"),
    ("range-2**25", "range(1 << 25)", "None", "InvalidArgumentError"),
    ("range-past-an-index", "range(1 << 70)", "None", "InvalidArgumentError"),
    ("claims-3-never-ends", "Endless([0], 3)", "None", "InvalidArgumentError"),
    ("nested-range", "[range(1 << 25)]", "None", "InvalidArgumentError"),
    ("generator", "(i for i in itertools.count())", "None", "InvalidTypeError"),
    ("list-within-the-bound-out-of-memory", "IDS", "4 << 20", "OutOfMemoryError"),
]


@pytest.mark.parametrize(
    ("arg", "limit", "expected"), [c[1:] for c in IDS], ids=[c[0] for c in IDS]
)
def test_hostile_python_ids_raise_before_they_are_read_whole(
    arg: str, limit: str, expected: str
) -> None:
    setup = PLAN + ("; IDS = [0] * MAX" if arg == "IDS" else "")
    script = _script(ONE_CALL, setup, "layout.plan(True, items, [0])", ARG=arg, LIMIT=limit)
    script = script.replace("report(**results)", "report(read=Liar.read, **results)")
    report = run_isolated(script, max_rss=1536 << 20).check()
    assert report["call"]["outcome"] == expected, report
    assert report["read"] <= (1 << 22) + 1 if arg.startswith("Endless") else report["read"] == 0
    if arg != "IDS":
        assert report["rss_peak"] < 320 << 20, report


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
read = 0
class Liar:  # claims 2**40 items
    def __len__(self):
        return 1 << 40
    def __getitem__(self, i):
        global read
        read += 1
        return 0
before = (bytes(memoryview(pool)), layer.clone(), engine.poll())
reset_peak()
try:
    {call}
    outcome = "returned"
except BaseException as exc:
    outcome = type(exc).__name__
after = (bytes(memoryview(pool)), layer, engine.poll())
unchanged = before[0] == after[0] and torch.equal(before[1], after[1]) and after[2] == []
report(outcome=outcome, unchanged=unchanged, read=read)
"""

ENGINE_CASES = [
    # The same valid id forever: a set of one id, filled without end (a hang).
    ("wait.job_ids", "engine.wait(itertools.repeat(job))", "InvalidArgumentError"),
    ("gpu_layers", "TransferEngine(itertools.repeat(layer), pool)", "InvalidArgumentError"),
    (
        "groups",
        "TransferEngine([layer], pool, groups=(g for g in itertools.repeat([])))",
        "InvalidArgumentError",
    ),
    (
        "offsets",
        "TransferEngine([layer], pool, offsets=iter(itertools.repeat(0)))",
        "InvalidArgumentError",
    ),
    # Lengths first: nothing is read.
    ("wait.job_ids.range", "engine.wait(range(1 << 25))", "InvalidArgumentError"),
    ("wait.job_ids.length", "engine.wait(Liar())", "InvalidArgumentError"),
    ("gpu_layers.length", "TransferEngine(Liar(), pool)", "InvalidArgumentError"),
    ("store.range", "engine.store(range(1 << 25), [0])", "InvalidArgumentError"),
    ("load.length", "engine.load(Liar(), [0])", "InvalidArgumentError"),
    # Memory the system refuses while the ids are listed: the typed error, not a bare one.
    (
        "wait.job_ids.out-of-memory",
        "limited(4 << 20, lambda: engine.wait(itertools.repeat(job)))",
        "OutOfMemoryError",
    ),
]


@pytest.mark.parametrize(
    ("call", "expected"), [c[1:] for c in ENGINE_CASES], ids=[c[0] for c in ENGINE_CASES]
)
def test_a_hostile_iterable_to_the_transfer_engine_raises(call: str, expected: str) -> None:
    pytest.importorskip("torch")
    report = run_isolated(ENGINE.replace("{call}", call), max_rss=1536 << 20).check()
    assert report["outcome"] == expected, report
    assert report["unchanged"], report
    assert report["read"] == 0, report
    # What the call itself may allocate, above what torch and the engine already hold.
    assert report["peak_growth"] < 128 << 20, report
