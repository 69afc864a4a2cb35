"""Hostile retention hints never fail, slow or grow a request: each case runs in a fresh
interpreter (``tests/support/hostile.py``), watched for memory, through kvcache's manager (turn and
LRU), kvcache's turn policy under the policy protocol and, for a few cases, the manager vLLM
loads (``kvcache.vllm``) with vLLM's own ``ReqContext``.

Three requests carry the same hostile hint. Every call must return normally, the manager
must count each request's hint once (as a hint, an ignored hint, or nothing: a request field
that is not kvcache's), the mistake must be logged once whatever the number of requests,
reading must stay bounded (hostile iterables count what was pulled from them, and the
address space reserved while the requests run must stay small), and every invariant must
hold afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcache._hints import MAX_ACTIONS, MAX_FIELDS
from tests.support.hostile import run_isolated

MiB = 1 << 20
#: Address space the requests may reserve (the hostile objects are built, and every path
#: warmed up, before the measurement starts; the interpreter's own noise is a few hundred KiB,
#: and copying a million-action list alone would take 8 MiB).
RESERVED_BOUND = 4 * MiB

PRELUDE = """
import gc, itertools, logging
from collections.abc import Mapping
from types import SimpleNamespace
import kvcache
from kvcache._hints import retention_params

messages = []

class Collect(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())

hint_log = logging.getLogger("kvcache.hints")
hint_log.addHandler(Collect())
hint_log.setLevel(logging.WARNING)
hint_log.propagate = False

pulled = [0]

def action(retention="ends", version="1", kind="kvcache.retention"):
    return SimpleNamespace(
        action_id="a", action_type=kind, action_version=version, payload={"retention": retention}
    )

class Raising:
    def __getattr__(self, name):
        raise RuntimeError(name)

class RaisingDict(dict):
    def get(self, *args):
        raise RuntimeError("get")
    def __getitem__(self, key):
        raise RuntimeError("getitem")
    def __iter__(self):
        raise RuntimeError("iter")
    def __contains__(self, key):
        raise RuntimeError("contains")
    def keys(self):
        raise RuntimeError("keys")

class EvilStr(str):
    def __hash__(self):
        return hash(str(self))
    def __eq__(self, other):
        raise RuntimeError("eq")
    def __ne__(self, other):
        raise RuntimeError("ne")

class EndlessMapping(Mapping):
    def __getitem__(self, key):
        raise KeyError(key)
    def __iter__(self):
        for i in itertools.count():
            pulled[0] += 1
            yield f"field{i}"
    def __len__(self):
        return 1

class EndlessActions(list):
    def __iter__(self):
        while True:
            pulled[0] += 1
            yield action(kind="someone.else")

class Recursing(dict):
    def get(self, *args):
        return self.get(*args)

class OutOfMemory(dict):
    def get(self, *args):
        raise MemoryError

class RaisingContextMixin:
    @property
    def kv_transfer_params(self):
        raise RuntimeError("kv_transfer_params")
    @kv_transfer_params.setter
    def kv_transfer_params(self, value):
        pass

def deep(depth):
    value = "ends"
    for _ in range(depth):
        value = [value]
    return value
"""

#: Each case: the code that defines ``make()`` (a fresh ``(kv_transfer_params, kv_hints)`` per
#: request), what the manager must count per request (``"hinted"``, ``"ignored"`` or None),
#: and the most items a hostile iterable may give up per request (None: none is involved).
CASES: dict[str, tuple[str, str | None, int | None]] = {
    # Wrong types.
    "params an int": ("make = lambda: (42, None)", None, None),
    "params text": ("make = lambda: ('kvcache', None)", None, None),
    "params a list": ("make = lambda: (['kvcache'], None)", None, None),
    "hint an int": ("make = lambda: ({'kvcache': 1}, None)", "ignored", None),
    "hint bytes": ("make = lambda: ({'kvcache': b'ends'}, None)", "ignored", None),
    "kv_hints an int": ("make = lambda: (None, 42)", "ignored", None),
    "kv_hints a dict": ("make = lambda: (None, {'actions': [action()]})", "ignored", None),
    "actions a string": ("make = lambda: (None, SimpleNamespace(actions='ends'))", "ignored", None),
    "payload an int": (
        "make = lambda: (None, SimpleNamespace(actions=[SimpleNamespace("
        "action_type='kvcache.retention', action_version='1', payload=5)]))",
        "ignored",
        None,
    ),
    # Unknown versions.
    "version 2": (
        "make = lambda: ({'kvcache': {'version': 2, 'retention': 'ends'}}, None)",
        "ignored",
        None,
    ),
    "version huge": (
        "make = lambda: ({'kvcache': {'version': 10**400, 'retention': 'ends'}}, None)",
        "ignored",
        None,
    ),
    "version a float": (
        "make = lambda: ({'kvcache': {'version': float('nan'), 'retention': 'ends'}}, None)",
        "ignored",
        None,
    ),
    "action version 2": (
        "make = lambda: (None, SimpleNamespace(actions=[action(version='2')]))",
        "ignored",
        None,
    ),
    "action version an int": (
        "make = lambda: (None, SimpleNamespace(actions=[action(version=1)]))",
        "ignored",
        None,
    ),
    # Huge.
    "params of a million keys": (
        "big = {f'k{i}': i for i in range(10**6)}\n"
        "big.update(retention_params('continues'))\n"
        "make = lambda: (big, None)",
        "hinted",
        None,
    ),
    "hint of a million fields": (
        "fields = {f'f{i}': i for i in range(10**6)}\nmake = lambda: ({'kvcache': fields}, None)",
        "ignored",
        None,
    ),
    "hint of endless fields": (
        "make = lambda: ({'kvcache': EndlessMapping()}, None)",
        "ignored",
        MAX_FIELDS + 1,
    ),
    "envelope of a million actions": (
        "actions = [action()] * 10**6\nmake = lambda: (None, SimpleNamespace(actions=actions))",
        "ignored",
        None,
    ),
    "envelope of endless actions": (
        "make = lambda: (None, SimpleNamespace(actions=EndlessActions()))",
        "ignored",
        MAX_ACTIONS + 1,
    ),
    "retention a huge string": (
        "text = 'e' * (64 << 20)\n"
        "make = lambda: ({'kvcache': {'version': 1, 'retention': text}}, None)",
        "ignored",
        None,
    ),
    # Deep.
    "retention nested 10**6 deep": (
        "value = deep(10**6)\n"
        "make = lambda: ({'kvcache': {'version': 1, 'retention': value}}, None)",
        "ignored",
        None,
    ),
    "foreign params nested 10**6 deep": (
        "value = deep(10**6)\nmake = lambda: ({'other': value}, None)",
        None,
        None,
    ),
    # Objects whose methods raise.
    "params whose methods raise": (
        "make = lambda: (RaisingDict(kvcache=1), None)",
        "ignored",
        None,
    ),
    "hint whose methods raise": (
        "make = lambda: ({'kvcache': RaisingDict(version=1)}, None)",
        "ignored",
        None,
    ),
    "key whose comparison raises": (
        "make = lambda: ({EvilStr('kvcache'): retention_params('ends')['kvcache']}, None)",
        "ignored",
        None,
    ),
    "retention a str subclass whose comparison raises": (
        "make = lambda: ({'kvcache': {'version': 1, 'retention': EvilStr('ends')}}, None)",
        "ignored",
        None,
    ),
    "field a str subclass whose comparison raises": (
        "make = lambda: ({'kvcache': {'version': 1, EvilStr('retention'): 'ends'}}, None)",
        "ignored",
        None,
    ),
    "envelope whose attributes raise": ("make = lambda: (None, Raising())", "ignored", None),
    "action whose attributes raise": (
        "make = lambda: (None, SimpleNamespace(actions=[Raising()]))",
        "ignored",
        None,
    ),
    "hint that recurses": ("make = lambda: (Recursing(kvcache=1), None)", "ignored", None),
    "hint out of memory": ("make = lambda: (OutOfMemory(kvcache=1), None)", "ignored", None),
    "context attribute that raises": ("make = None  # see RaisingContextMixin", "ignored", None),
    # Readable hints next to them, through the same paths.
    "a good hint": ("make = lambda: (retention_params('ends'), None)", "hinted", None),
    "a good envelope": (
        "make = lambda: (None, SimpleNamespace(actions=[action()]))",
        "hinted",
        None,
    ),
}

SCRIPT = """
{setup}
REQUESTS = 3

def key(i):
    return i.to_bytes(32, "big") + bytes(4)

def context(cls, r):
    if make is None:
        raising = type("RaisingContext", (RaisingContextMixin, cls), {{}})
        return raising(f"r{{r}}") if cls is kvcache.ReqContext else raising(req_id=f"r{{r}}")
    params, hints = make()
    if cls is kvcache.ReqContext:
        return cls(f"r{{r}}", params, hints)
    return cls(req_id=f"r{{r}}", kv_transfer_params=params, kv_hints=hints)

def through_manager(manager, cls):
    for r in range(REQUESTS):
        ctx = context(cls, r)
        keys = [key(8 * r + i) for i in range(4)]
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, 16 * (i + 1))
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
        manager.complete_store(out.keys_to_store, ctx)
        manager.prepare_load(keys[:2], ctx)
        manager.complete_load(keys[:2], ctx)
        manager.on_request_finished(ctx)
        manager.validate()

def through_policy(policy):
    for r in range(REQUESTS):
        ctx = context(kvcache.ReqContext, r)
        keys = [key(8 * r + i) for i in range(4)]
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, 16 * (i + 1))
            chunk = kvcache.ChunkStatus(8 * r + i)
            chunk.ref_cnt = 0
            policy.on_request_access(keys, ctx)
            policy.insert(k, chunk, ctx)
        policy.on_request_finished((tuple(keys),), set(keys), set(), ctx)
        policy.validate()

# Warm up every path with a readable hint first: the measurement is of the hostile reads.
hostile = make
make = lambda: (retention_params("ends"), None)
through_manager(kvcache.OffloadingManager(64, "turn"), kvcache.ReqContext)
through_manager(kvcache.OffloadingManager(64, "lru"), kvcache.ReqContext)
through_policy(kvcache.TurnCachePolicy(64))
make = hostile
results = {{}}
gc.collect()
peak = status("VmPeak")
for name, run in [
    ("turn manager", lambda: kvcache.OffloadingManager(64, "turn")),
    ("lru manager", lambda: kvcache.OffloadingManager(64, "lru")),
]:
    manager = run()
    pulled[0] = 0
    try:
        through_manager(manager, kvcache.ReqContext)
        stats = manager.get_stats()
        results[name] = [stats.hinted_requests, stats.ignored_hints, pulled[0]]
    except BaseException as exc:
        results[name] = f"{{type(exc).__name__}}: {{exc}}"
policy = kvcache.TurnCachePolicy(64)
pulled[0] = 0
try:
    through_policy(policy)
    results["turn policy"] = [None, None, pulled[0]]
except BaseException as exc:
    results["turn policy"] = f"{{type(exc).__name__}}: {{exc}}"
reserved = status("VmPeak") - peak  # measured before vLLM's import, which reserves plenty
if {with_vllm}:
    import kvcache.vllm
    from kvcache.vllm._metrics import HINTED_REQUESTS, IGNORED_HINTS
    from vllm.v1.kv_offload.base import ReqContext
    manager = kvcache.vllm.CPUOffloadingManager(64, "turn")
    pulled[0] = 0
    try:
        through_manager(manager, ReqContext)
        data = manager.get_stats().data["data"]
        counts = [data.get(n, {{}}).get((), 0) for n in (HINTED_REQUESTS, IGNORED_HINTS)]
        results["vllm manager"] = [*counts, pulled[0]]
    except BaseException as exc:
        results["vllm manager"] = f"{{type(exc).__name__}}: {{exc}}"
report(results=results, messages=messages, reserved=reserved)
"""

#: Cases also run through the manager vLLM loads, with vLLM's ReqContext (vLLM's import makes
#: each a few seconds long).
WITH_VLLM = (
    "envelope of a million actions",
    "hint whose methods raise",
    "retention nested 10**6 deep",
    "context attribute that raises",
    "a good envelope",
)


def case_params() -> list[Any]:
    return [pytest.param(name, name in WITH_VLLM, id=name) for name in CASES]


@pytest.mark.parametrize(("case", "with_vllm"), case_params())
def test_a_hostile_hint_is_ignored_counted_and_logged_once(case: str, with_vllm: bool) -> None:
    setup, counted, max_pulled = CASES[case]
    script = SCRIPT.format(setup=PRELUDE + setup, with_vllm=with_vllm)
    run = run_isolated(script, max_rss=(4 << 30) if with_vllm else (1 << 30), timeout=300)
    report = run.check()
    requests = 3
    expected = [
        requests if counted == "hinted" else 0,
        requests if counted == "ignored" else 0,
    ]
    results = report["results"]
    for target, outcome in results.items():
        assert isinstance(outcome, list), f"{target}: {outcome}"
        hinted, ignored, pulled = outcome
        if hinted is not None:
            assert [hinted, ignored] == expected, target
        if max_pulled is None:
            assert pulled == 0, target
        else:
            # Per request, once: the manager and the policy each read a request's hint once.
            assert 0 < pulled <= requests * max_pulled, target
    assert ("vllm manager" in results) == with_vllm
    # One line per kind of mistake, whatever the number of requests and readers.
    assert len(report["messages"]) == (1 if counted == "ignored" else 0), report["messages"]
    assert report["reserved"] < RESERVED_BOUND, (
        f"reading the hints reserved {report['reserved'] / MiB:.0f} MiB of address space"
    )
