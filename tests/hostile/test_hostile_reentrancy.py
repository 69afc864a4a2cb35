"""Reentrant calls: Python code that runs inside a policy or manager call (a key generator, a
request context's methods, a set subclass's ``__contains__``) and calls back into the same
object gets ``kvcache.ReentrantCallError`` (a ``KvCacheError`` and a ``RuntimeError``), raised
inside the callback. The inner call changes nothing:

- if the callback lets the error propagate, the outer call fails with that very error and the
  whole state is unchanged;
- if the callback swallows it, the outer call completes exactly as it would have without the
  callback's attempt (same result, same final state as a control run).

Calling into a *different* object from a callback is ordinary and works.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import kvcache
from tests.support.hostile import ready, require_error, state_of
from tests.support.keys import make_key

K = [make_key(i) for i in range(10)]


@dataclass
class Hook:
    """Runs ``inner`` (a call back into the object under test) the first time it is called,
    records what it raised, then re-raises it or swallows it."""

    inner: Callable[[], object] | None
    propagate: bool
    raised: list[BaseException] = field(default_factory=list)
    calls: int = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls > 1 or self.inner is None:
            return
        try:
            self.inner()
        except BaseException as exc:
            self.raised.append(exc)
            if self.propagate:
                raise
        else:
            self.raised.append(AssertionError("the reentrant call succeeded"))


# Every context of the running test: kept alive so that request states die at no moment a
# garbage collection happens to choose (which would make two runs differ).
ALIVE: list[Any] = []


@pytest.fixture(autouse=True)
def _contexts_live_for_the_test() -> Iterator[None]:
    yield
    ALIVE.clear()


class Context:
    """A Python-method request context (no fast path) whose methods run ``hook`` (set
    ``on`` to choose which)."""

    def __init__(self, hook: Hook, on: str) -> None:
        self.hook, self.on = hook, on
        ALIVE.append(self)  # request state must not die at a moment GC chooses
        self.state: dict[type, Any] = {}
        self.positions = {key: 16 * (i + 1) for i, key in enumerate(K)}

    def get_state(self, cls: type) -> Any:
        if self.on == "get_state":
            self.hook()
        return self.state.get(cls)

    def set_state(self, value: Any) -> None:
        if self.on == "set_state":
            self.hook()
        self.state[type(value)] = value

    def get_offload_key_position(self, key: bytes) -> int | None:
        if self.on == "position":
            self.hook()
        return self.positions.get(key)


def hooked_keys(hook: Hook, keys: list[bytes]) -> Iterator[bytes]:
    for i, key in enumerate(keys):
        if i == 0:
            hook()
        yield key


class HookedSet(set):
    hook: Hook

    def __contains__(self, key: object) -> bool:
        self.hook()
        return set.__contains__(self, key)


def hooked_set(hook: Hook, keys: set[bytes]) -> HookedSet:
    s = HookedSet(keys)
    s.hook = hook
    return s


# --- targets ----------------------------------------------------------------------------------


def plain_ctx() -> Context:
    return Context(Hook(None, False), "none")


def make_policy(kind: str) -> tuple[Any, Context]:
    # vLLM 0.33's protocol: the suites also call touch.
    policy = kvcache.POLICY_KINDS[kind](4, vllm_semantics="0.33")
    ctx = plain_ctx()
    for i in range(3):
        policy.insert(K[i], ready(i), ctx)
    return policy, ctx


def make_manager(kind: str) -> tuple[Any, Context]:
    flavour, policy = kind.split("-")
    if flavour == "m":
        manager = kvcache.OffloadingManager(4, policy, enable_events=True, vllm_semantics="0.33")
    else:
        from kvcache.vllm import CPUOffloadingManager

        manager = CPUOffloadingManager(num_chunks=4, cache_policy=policy, enable_events=True)
    ctx = plain_ctx()
    manager.on_new_request(ctx)
    out = manager.prepare_store(K[:2], ctx)
    manager.complete_store(out.keys_to_store, ctx)
    manager.prepare_store(K[2:3], ctx)
    return manager, ctx


# Outer calls: (target kinds, name, call(obj, ctx, hook) -> result).
Outer = Callable[[Any, Context, Hook], object]

POLICY_OUTER: dict[str, tuple[tuple[str, ...], Outer]] = {
    "touch-gen": (("lru", "arc", "turn"), lambda p, c, h: p.touch(hooked_keys(h, K[:2]), c)),
    "on_store_miss-gen": (
        ("lru", "arc", "turn"),
        lambda p, c, h: p.on_store_miss(hooked_keys(h, K[5:7]), c),
    ),
    "evict-protected-gen": (
        ("lru", "arc", "turn"),
        lambda p, c, h: p.evict(1, hooked_keys(h, K[:1])),
    ),
    "finish-groups-gen": (
        ("lru", "arc", "turn"),
        lambda p, c, h: p.on_request_finished(hooked_keys(h, [K[:2]]), set(), set(), c),
    ),
    "finish-position": (
        ("lru", "arc", "turn"),
        lambda p, c, h: p.on_request_finished([K[:2]], set(), set(), Context(h, "position")),
    ),
    "on_request_access-gen": (
        ("lru", "turn"),
        lambda p, c, h: p.on_request_access(hooked_keys(h, K[:2]), c),
    ),
    "insert-position": (
        ("lru",),
        lambda p, c, h: p.insert(K[5], ready(5), Context(h, "position")),
    ),
    "insert-get_state": (
        ("lru", "turn"),
        lambda p, c, h: p.insert(K[5], ready(5), Context(h, "get_state")),
    ),
    "insert-set_state": (
        ("lru", "turn"),
        lambda p, c, h: p.insert(K[5], ready(5), Context(h, "set_state")),
    ),
    "finish-insertion_only-contains": (
        ("arc", "turn"),
        lambda p, c, h: p.on_request_finished([K[:2]], hooked_set(h, {K[0]}), set(), c),
    ),
    "finish-reused-contains": (
        ("arc", "turn"),
        lambda p, c, h: p.on_request_finished([K[:2]], set(), hooked_set(h, {K[1]}), c),
    ),
}

#: vLLM 0.33's manager has touch, and so has kvcache.vllm's there; 0.34's has none (read from
#: the installed vLLM's metadata).
VLLM_HAS_TOUCH = kvcache._semantics.default_semantics() == "0.33"

MANAGER_OUTER: dict[str, tuple[tuple[str, ...], Outer]] = {
    "prepare_store-gen": (("*",), lambda m, c, h: m.prepare_store(hooked_keys(h, K[4:6]), c)),
    "prepare_load-gen": (("*",), lambda m, c, h: m.prepare_load(hooked_keys(h, K[:2]), c)),
    # kvcache.vllm's manager has touch only where vLLM's has (0.33).
    "touch-gen": (
        ("m-lru", "m-arc", "m-turn", *(("vm-lru", "vm-arc", "vm-turn") if VLLM_HAS_TOUCH else ())),
        lambda m, c, h: m.touch(hooked_keys(h, K[:2]), c),
    ),
    "complete_store-gen": (("*",), lambda m, c, h: m.complete_store(hooked_keys(h, K[2:3]), c)),
    "complete_store-fail-gen": (
        ("*",),
        lambda m, c, h: m.complete_store(hooked_keys(h, K[2:3]), c, False),
    ),
    "on_new_request-get_state": (("*",), lambda m, c, h: m.on_new_request(Context(h, "get_state"))),
    "on_new_request-set_state": (("*",), lambda m, c, h: m.on_new_request(Context(h, "set_state"))),
    "prepare_store-position": (
        ("m-lru", "vm-lru"),
        lambda m, c, h: m.prepare_store(K[4:6], Context(h, "position")),
    ),
    "prepare_store-get_state": (
        ("*",),
        lambda m, c, h: m.prepare_store(K[4:6], Context(h, "get_state")),
    ),
    "on_request_finished-position": (("*",), lambda m, c, h: finish_tracked(m, c, h)),
}


def finish_tracked(manager: Any, ctx: Context, hook: Hook) -> object:
    """Finishes the request ``build`` stored a key for; its position reads run the hook."""
    ctx.hook, ctx.on = hook, "position"
    return manager.on_request_finished(ctx)


# Inner calls: a call back into the same object, one that mutates and one that only reads
# (a lock taken at every entry refuses both; the manager's buffer export is its own path).
POLICY_INNER: dict[str, Callable[[Any], object]] = {
    "insert": lambda p: p.insert(K[9], ready(9)),
    "get": lambda p: p.get(K[0]),
}
MANAGER_INNER: dict[str, Callable[[Any], object]] = {
    "prepare_store": lambda m: m.prepare_store([K[9]], plain_ctx()),
    # memoryview: numpy.asarray would turn a refused export into an object scalar.
    "chunk_table": lambda m: memoryview(m.chunk_table()),
}


def cases() -> list[Any]:
    out = []
    for outer_name, (kinds, _) in POLICY_OUTER.items():
        for kind in kinds:
            for inner_name in POLICY_INNER:
                out.append((kind, outer_name, inner_name))
    for outer_name, (kinds, _) in MANAGER_OUTER.items():
        for kind in ("m-lru", "m-arc", "m-turn", "vm-lru", "vm-arc", "vm-turn"):
            if "*" in kinds or kind in kinds:
                # Every inner call on our managers, one on vLLM's shape.
                inner = MANAGER_INNER if kind.startswith("m-") else ["prepare_store"]
                for inner_name in inner:
                    out.append((kind, outer_name, inner_name))
    return [pytest.param(*c, id="-".join(c)) for c in out]


def build(kind: str, outer: str) -> tuple[Any, Context]:
    if kind in kvcache.POLICY_KINDS:
        return make_policy(kind)
    manager, ctx = make_manager(kind)
    if outer == "on_request_finished-position":
        ctx = plain_ctx()  # a request with an observed key, finished by the outer call
        manager.prepare_store(K[6:7], ctx)
    return manager, ctx


def outer_call(kind: str, name: str) -> Outer:
    table = POLICY_OUTER if kind in kvcache.POLICY_KINDS else MANAGER_OUTER
    return table[name][1]


def inner_call(kind: str, name: str) -> Callable[[Any], object]:
    return (POLICY_INNER if kind in kvcache.POLICY_KINDS else MANAGER_INNER)[name]


def normalise(result: object) -> object:
    """A comparable form of a call's result (chunks and specs are new objects each run)."""
    if result is None or isinstance(result, bool | int):
        return result
    if isinstance(result, list):
        return [normalise(r) for r in result]
    if isinstance(result, tuple):
        return tuple(normalise(r) if not isinstance(r, bytes) else r for r in result)
    if isinstance(result, bytes):
        return result
    if hasattr(result, "keys_to_store"):
        return (
            list(result.keys_to_store),
            np.asarray(result.store_spec.block_ids).tolist(),
            list(result.evicted_keys),
        )
    if hasattr(result, "block_ids"):
        return np.asarray(result.block_ids).tolist()
    if hasattr(result, "chunk_id"):
        return ("chunk", result.chunk_id)
    return type(result).__name__


@pytest.mark.parametrize(("kind", "outer", "inner"), cases())
def test_a_reentrant_call_that_propagates_fails_the_outer_call_and_changes_nothing(
    kind: str, outer: str, inner: str
) -> None:
    reentrant = require_error("ReentrantCallError", RuntimeError)
    obj, ctx = build(kind, outer)
    hook = Hook(functools.partial(inner_call(kind, inner), obj), propagate=True)
    before = state_of(obj)
    with pytest.raises(BaseException) as info:  # noqa: PT011 - the exact type is asserted
        outer_call(kind, outer)(obj, ctx, hook)
    assert hook.raised, "the callback never ran"
    assert type(hook.raised[0]) is reentrant, repr(hook.raised[0])
    assert info.value is hook.raised[0], "the outer call must fail with the inner error"
    assert state_of(obj) == before


@pytest.mark.parametrize(("kind", "outer", "inner"), cases())
def test_a_reentrant_call_that_is_swallowed_leaves_the_outer_call_as_it_was(
    kind: str, outer: str, inner: str
) -> None:
    reentrant = require_error("ReentrantCallError", RuntimeError)
    obj, ctx = build(kind, outer)
    control, control_ctx = build(kind, outer)
    hook = Hook(functools.partial(inner_call(kind, inner), obj), propagate=False)
    result = outer_call(kind, outer)(obj, ctx, hook)
    assert hook.raised, "the callback never ran"
    assert type(hook.raised[0]) is reentrant, repr(hook.raised[0])
    expected = outer_call(kind, outer)(control, control_ctx, Hook(None, False))
    assert normalise(result) == normalise(expected)
    assert state_of(obj) == state_of(control)


# --- calls into other objects are fine --------------------------------------------------------


@pytest.mark.parametrize("kind", list(kvcache.POLICY_KINDS))
def test_a_callback_may_use_another_policy(kind: str) -> None:
    policy, ctx = make_policy(kind)
    other, _ = make_policy(kind)
    before = state_of(policy)

    def keys() -> Iterator[bytes]:
        other.insert(K[9], ready(9))
        yield K[5]

    policy.touch(keys(), ctx)  # K5 is not resident: nothing to move
    assert K[9] in other
    assert state_of(policy) == before
    policy.validate()
    other.validate()


@pytest.mark.parametrize("kind", ["m-lru", "m-arc"])
def test_a_callback_may_use_another_manager(kind: str) -> None:
    manager, ctx = make_manager(kind)
    other, _ = make_manager(kind)
    other_ctx = plain_ctx()

    def keys() -> Iterator[bytes]:
        other.prepare_store([K[9]], other_ctx)
        yield from K[4:6]

    out = manager.prepare_store(keys(), ctx)
    assert out.keys_to_store == K[4:6]
    assert other.lookup(K[9]) is kvcache.LookupResult.HIT_PENDING
    manager.validate()
    other.validate()


# --- finalizers that run inside a call --------------------------------------------------------


class DyingChunk(ctypes.Structure):
    """A chunk whose finalizer calls back into the policy holding it. ``remove`` and ``clear``
    drop the policy's reference inside the call, so the finalizer runs there."""

    _fields_ = [("ref_cnt", ctypes.c_int32), ("chunk_id", ctypes.c_int64)]

    def __del__(self) -> None:
        try:
            self.policy.insert(K[9], ready(9))
        except BaseException as exc:  # a finalizer cannot raise: record what it got
            self.raised.append(exc)
        else:
            self.raised.append(AssertionError("the reentrant call succeeded"))


@pytest.mark.parametrize("kind", list(kvcache.POLICY_KINDS))
@pytest.mark.parametrize("method", ["remove", "clear"])
def test_a_finalizer_that_calls_back_during_a_call_gets_reentrant_call_error(
    kind: str, method: str
) -> None:
    reentrant = require_error("ReentrantCallError", RuntimeError)
    raised: list[BaseException] = []
    policy, _ = make_policy(kind)
    control, _ = make_policy(kind)
    for p in (policy, control):
        chunk = DyingChunk(0, 7)
        chunk.policy, chunk.raised = (p, raised) if p is policy else (None, [])
        p.insert(K[5], chunk)
        del chunk
    if method == "remove":
        policy.remove(K[5])
    else:
        policy.clear()
    assert raised, "the finalizer never ran inside the call"
    assert type(raised[0]) is reentrant, repr(raised[0])
    if method == "remove":
        control.remove(K[5])
    else:
        control.clear()
    assert state_of(policy) == state_of(control)
