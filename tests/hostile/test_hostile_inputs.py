"""Hostile input over the scheduler-side API: every bad argument raises one exact exception
type and leaves the whole state unchanged.

Each case names its target (a populated LRU or ARC policy, a manager of ours or vLLM's shape,
a chunk, a result, or nothing for constructors), the call, and the exact exception expected:

- kvcache's own errors for bad input (``InvalidKeyError``, ``InvalidTypeError``,
  ``InvalidArgumentError`` ...), never a bare builtin and never an ``OverflowError``;
- a user's own exception, unchanged, when Python code the user passed in (a key generator, a
  request context's method, a set's ``__contains__``) raises it;
- the builtin a ``list`` raises for the sequence protocol of result containers (decided: they
  stand in for vLLM's lists, so ``IndexError``/``TypeError``/``ValueError`` as a list has them).

"Unchanged" is everything the object exposes (``tests.support.hostile.state_of``), and
``validate()`` passes before and after. Cases that fail today are strict ``xfail`` with the bug
class as the reason, so each fix turns them into XPASS (a failure) until its marker is dropped.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import kvcache
from tests.support.hostile import raises_exactly, raises_unchanged, ready, state_of
from tests.support.hostile_targets import (
    DKE,
    IAE,
    ICE,
    IKE,
    ISE,
    ITE,
    KNF,
    MANAGERS,
    NEE,
    POLICIES,
    TARGETS,
    VLLM_HAS_TOUCH,
    Boom,
    Env,
    K,
    positions_ctx,
)

CASES: list[Any] = []
CASE_IDS: set[str] = set()


def case(
    target: str,
    name: str,
    call: Callable[[Env | None], object],
    expected: type[BaseException],
    xfail: str | None = None,
) -> None:
    case_id = f"{target}-{name}"
    assert case_id not in CASE_IDS, f"duplicate case {case_id}"
    CASE_IDS.add(case_id)
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    CASES.append(pytest.param(target, call, expected, id=case_id, marks=marks))


# --- bad keys ---------------------------------------------------------------------------------

BAD_KEYS: dict[str, Any] = {
    "str": "k",
    "bytearray": bytearray(K[0]),
    "memoryview": memoryview(K[0]),
    "int": 1,
    "none": None,
    "float": 1.5,
    "list": [K[0]],
    "tuple": (K[0],),
    "object": object(),
}

SINGLE_KEY_POLICY_CALLS: dict[str, Callable[[Env, Any], object]] = {
    "get": lambda e, k: e.obj.get(k),
    "contains": lambda e, k: k in e.obj,
    "insert": lambda e, k: e.obj.insert(k, ready(9), e.ctx),
    "insert-2arg": lambda e, k: e.obj.insert(k, ready(9)),
    "remove": lambda e, k: e.obj.remove(k),
    "mark_evictable": lambda e, k: e.obj.mark_evictable(k),
    "mark_non_evictable": lambda e, k: e.obj.mark_non_evictable(k),
}

for target in POLICIES:
    for method, call in SINGLE_KEY_POLICY_CALLS.items():
        for kname, bad in BAD_KEYS.items():
            case(target, f"{method}-key-{kname}", functools.partial(call, k=bad), IKE)
for target in MANAGERS:
    for kname, bad in BAD_KEYS.items():
        case(target, f"lookup-key-{kname}", lambda e, bad=bad: e.obj.lookup(bad, e.ctx), IKE)


# --- bad key collections ----------------------------------------------------------------------


def gen_of(*items: Any) -> Callable[[], Iterator[Any]]:
    """A factory of fresh generators (a generator can be consumed once)."""
    return lambda: (item for item in items)


BAD_KEY_COLLECTIONS: dict[str, Callable[[], Any]] = {
    "int": lambda: 5,
    "none": lambda: None,
    "bytes": lambda: K[3],
    "str": lambda: "abc",
    "list-none": lambda: [K[3], None],
    "tuple-int": lambda: (K[3], 1),
    "list-bytearray": lambda: [bytearray(K[3])],
    "list-nested": lambda: [K[3], [K[4]]],
    "set-int": lambda: {K[3], 5},
    "dict-int-key": lambda: {K[3]: 1, 5: 2},
    "gen-str": gen_of(K[3], "x"),
    "gen-none-first": gen_of(None, K[3]),
}

COLLECTION_POLICY_CALLS: dict[str, Callable[[Env, Any], object]] = {
    "touch": lambda e, ks: e.obj.touch(ks, e.ctx),
    "on_store_miss": lambda e, ks: e.obj.on_store_miss(ks, e.ctx),
    "evict-protected": lambda e, ks: e.obj.evict(1, ks),
    "finish-group": lambda e, ks: e.obj.on_request_finished([[K[0]], ks], set(), set(), e.ctx),
}
COLLECTION_MANAGER_CALLS: dict[str, Callable[[Env, Any], object]] = {
    "prepare_load": lambda e, ks: e.obj.prepare_load(ks, e.ctx),
    "prepare_store": lambda e, ks: e.obj.prepare_store(ks, e.ctx),
    "touch": lambda e, ks: e.obj.touch(ks, e.ctx),
    "complete_load": lambda e, ks: e.obj.complete_load(ks, e.ctx),
    "complete_store": lambda e, ks: e.obj.complete_store(ks, e.ctx),
    "complete_store-fail": lambda e, ks: e.obj.complete_store(ks, e.ctx, False),
}


def with_collection(
    call: Callable[[Env, Any], object], make: Callable[[], Any]
) -> Callable[[Env], object]:
    return lambda e: call(e, make())


for target in POLICIES:
    calls = dict(COLLECTION_POLICY_CALLS)
    if target == "lru":  # ARC ignores on_request_access entirely, as vLLM's does
        calls["on_request_access"] = lambda e, ks: e.obj.on_request_access(ks, e.ctx)
    for method, call in calls.items():
        for cname, make in BAD_KEY_COLLECTIONS.items():
            case(target, f"{method}-keys-{cname}", with_collection(call, make), IKE)
for target in MANAGERS:
    for method, call in COLLECTION_MANAGER_CALLS.items():
        if method == "touch" and target.startswith("vm-") and not VLLM_HAS_TOUCH:
            continue  # kvcache.vllm's manager has no touch where vLLM's has none
        for cname, make in BAD_KEY_COLLECTIONS.items():
            case(target, f"{method}-keys-{cname}", with_collection(call, make), IKE)

# key_groups itself: not an iterable of key collections.
for target in POLICIES:
    for name, groups, expected in [
        ("int", 5, ITE),
        ("none", None, ITE),
        ("float", 1.5, ITE),
        ("bytes", K[0], IKE),  # iterates as ints: each "group" is an int
        ("str", "ab", IKE),
        ("list-of-bytes", [K[0]], IKE),  # a lone key is not a group
        ("list-of-int", [5], IKE),
    ]:
        case(
            target,
            f"finish-groups-{name}",
            lambda e, g=groups: e.obj.on_request_finished(g, set(), set(), e.ctx),
            expected,
        )


# --- bad chunks -------------------------------------------------------------------------------


def read_only_array() -> np.ndarray:
    arr = np.zeros(4, dtype=np.int32)
    arr.flags.writeable = False
    return arr


def released_view() -> memoryview:
    view = memoryview(bytearray(16))
    view.release()
    return view


BAD_CHUNKS: dict[str, tuple[Callable[[], Any], str | None]] = {
    "none": (lambda: None, None),
    "int": (lambda: 5, None),
    "str": (lambda: "x" * 16, None),
    "object": (object, None),
    "8-bytes": (lambda: bytearray(8), None),
    "15-bytes": (lambda: bytearray(15), None),
    "17-bytes": (lambda: bytearray(17), None),
    "32-bytes": (lambda: bytearray(32), None),
    "c-int32": (ctypes.c_int32, None),
    "non-contiguous": (lambda: np.zeros(32, dtype=np.int8)[::2], None),
    "released-view": (released_view, None),
    "bytes-16": (lambda: bytes(16), None),
    "readonly-view-16": (lambda: memoryview(bytearray(16)).toreadonly(), None),
    "readonly-array-16": (read_only_array, None),
}
for target in POLICIES:
    for cname, (make, xfail) in BAD_CHUNKS.items():
        case(
            target,
            f"insert-chunk-{cname}",
            lambda e, make=make: e.obj.insert(K[5], make(), e.ctx),
            ICE,
            xfail,
        )


# --- counts and capacities --------------------------------------------------------------------

BAD_COUNTS: dict[str, tuple[Any, type[BaseException]]] = {
    "minus-1": (-1, IAE),
    "minus-2**63": (-(2**63), IAE),
    "minus-2**70": (-(2**70), IAE),
    "float": (1.0, ITE),
    "str": ("1", ITE),
    "none": (None, ITE),
    "true": (True, ITE),
    "false": (False, ITE),
    "list": ([1], ITE),
    "bytes": (b"\x01", ITE),
}
for target in POLICIES:
    for name, (n, expected) in BAD_COUNTS.items():
        case(target, f"evict-n-{name}", lambda e, n=n: e.obj.evict(n, set()), expected)

BAD_CAPACITIES: dict[str, tuple[Any, type[BaseException]]] = {
    "minus-1": (-1, IAE),
    "minus-2**70": (-(2**70), IAE),
    "2**64": (2**64, IAE),
    "2**70": (2**70, IAE),
    "float": (1.5, ITE),
    "str": ("4", ITE),
    "none": (None, ITE),
    "true": (True, ITE),
    "list": ([4], ITE),
}
for cls in kvcache.POLICY_KINDS.values():
    for name, (cap, expected) in BAD_CAPACITIES.items():
        case("new", f"{cls.__name__}-capacity-{name}", lambda e, c=cls, v=cap: c(v), expected)
    for name, call in {
        "no-args": lambda e, c=cls: c(),
        "two-args": lambda e, c=cls: c(4, 5),
        "unknown-kwarg": lambda e, c=cls: c(capacity=4),
    }.items():
        case("new", f"{cls.__name__}-{name}", call, TypeError)
case("new", "BaseCachePolicy", lambda e: kvcache.BaseCachePolicy(), TypeError)


# --- state-dependent errors -------------------------------------------------------------------

for target in POLICIES:
    case(target, "insert-duplicate", lambda e: e.obj.insert(K[0], ready(9), e.ctx), DKE)
    case(target, "insert-duplicate-2arg", lambda e: e.obj.insert(K[1], ready(9)), DKE)
    case(target, "remove-absent", lambda e: e.obj.remove(K[7]), KNF)
    case(target, "mark_evictable-absent", lambda e: e.obj.mark_evictable(K[7]), KNF)
    case(target, "mark_non_evictable-absent", lambda e: e.obj.mark_non_evictable(K[7]), KNF)
case("lru", "mark_non_evictable-pinned", lambda e: e.obj.mark_non_evictable(K[2]), NEE)


def kept_alive(e: Env) -> kvcache.ReqContext:
    """A context the manager never saw, alive until the test ends (a dead context's state is
    let go at the next call, which would hide a state left behind)."""
    e.extra = positions_ctx("new")
    return e.extra


for target in MANAGERS:
    case(target, "prepare_load-absent", lambda e: e.obj.prepare_load([K[1], K[7]], e.ctx), KNF)
    case(target, "prepare_load-pending", lambda e: e.obj.prepare_load([K[1], K[2]], e.ctx), ISE)
    case(target, "complete_load-idle", lambda e: e.obj.complete_load([K[0], K[1]], e.ctx), ISE)
    case(target, "complete_load-absent", lambda e: e.obj.complete_load([K[0], K[7]], e.ctx), KNF)
    case(target, "prepare_store-repeat", lambda e: e.obj.prepare_store([K[5], K[5]], e.ctx), IAE)
    # A context the manager never saw: the failing call must not leave a request state behind.
    case(
        target,
        "prepare_load-absent-new-request",
        lambda e: e.obj.prepare_load([K[7]], kept_alive(e)),
        KNF,
        None,
    )
    case(
        target,
        "prepare_store-repeat-new-request",
        lambda e: e.obj.prepare_store([K[5], K[5]], kept_alive(e)),
        IAE,
        None,
    )
    # vLLM's annotation says bool; anything else is refused (not read as a truth value).
    for name, value in {"str": "yes", "none": None}.items():
        case(
            target,
            f"complete_store-success-{name}",
            lambda e, v=value: e.obj.complete_store([K[2]], e.ctx, v),
            ITE,
            None,
        )


# --- request contexts -------------------------------------------------------------------------


class PositionsOnly:
    """Has get_offload_key_position, no get_state/set_state."""

    def get_offload_key_position(self, key: bytes) -> int | None:
        return 16


class StateOnly:
    """Has get_state/set_state, no get_offload_key_position."""

    def __init__(self) -> None:
        self.state: dict[type, Any] = {}

    def get_state(self, cls: type) -> Any:
        return self.state.get(cls)

    def set_state(self, value: Any) -> None:
        self.state[type(value)] = value


class MethodContext(StateOnly):
    """A Python-method context whose positions come from ``position(key)``."""

    def __init__(self, position: Callable[[bytes], Any]) -> None:
        super().__init__()
        self.position = position

    def get_offload_key_position(self, key: bytes) -> Any:
        return self.position(key)


class ForeignState(MethodContext):
    """get_state returns something that is not kvcache's request state."""

    def get_state(self, cls: type) -> Any:
        return 5


def returning(value: Any) -> Callable[[], MethodContext]:
    return lambda: MethodContext(lambda key: value)


def raising() -> MethodContext:
    def position(key: bytes) -> Any:
        raise Boom("position")

    return MethodContext(position)


def state_raising() -> MethodContext:
    ctx = MethodContext(lambda key: 16)
    ctx.get_state = functools.partial(_raise, Boom("get_state"))  # type: ignore[method-assign]
    return ctx


def set_state_raising() -> MethodContext:
    ctx = MethodContext(lambda key: 16)
    ctx.set_state = functools.partial(_raise, Boom("set_state"))  # type: ignore[method-assign]
    return ctx


def _raise(exc: BaseException, *args: Any) -> Any:
    raise exc


def recorded(value: Any) -> Callable[[], kvcache.ReqContext]:
    """kvcache's own ReqContext (read directly by the policies) with a bad recorded value."""

    def make() -> kvcache.ReqContext:
        ctx = positions_ctx("bad")
        for key in K:
            ctx.set_offload_key_position(key, value)
        return ctx

    return make


# Each bad context with the exception it must raise wherever it is read.
BAD_CONTEXTS: dict[str, tuple[Callable[[], Any], type[BaseException]]] = {
    "int": (lambda: 5, ITE),
    "str": (lambda: "ctx", ITE),
    "object": (object, ITE),
    "state-only": (StateOnly, ITE),
    "position-str": (returning("16"), ITE),
    "position-float": (returning(16.0), ITE),
    "position-bool": (returning(True), ITE),
    "position-bytes": (returning(b"\x10"), ITE),
    "position-2**63": (returning(2**63), IAE),
    "position-minus-2**70": (returning(-(2**70)), IAE),
    "position-raises": (raising, Boom),
    "recorded-str": (recorded("16"), ITE),
    "recorded-float": (recorded(16.5), ITE),
    "recorded-bool": (recorded(True), ITE),
    "recorded-2**64": (recorded(2**64), IAE),
}
# Contexts whose state methods are broken: wherever a request state is read or made.
BAD_STATE_CONTEXTS: dict[str, tuple[Callable[[], Any], type[BaseException]]] = {
    "none": (lambda: None, ITE),
    "int": (lambda: 5, ITE),
    "positions-only": (PositionsOnly, ITE),
    "foreign-state": (lambda: ForeignState(lambda key: 16), ITE),
    "get_state-raises": (state_raising, Boom),
    "set_state-raises": (set_state_raising, Boom),
}

# Calls that read token positions from their context.
POSITION_CALLS: dict[str, dict[str, Callable[[Env, Any], object]]] = {
    "lru": {
        "insert": lambda e, c: e.obj.insert(K[5], ready(9), c),
        "on_request_access": lambda e, c: e.obj.on_request_access([K[0], K[1]], c),
        "on_request_finished": lambda e, c: e.obj.on_request_finished(
            [[K[0], K[1]]], set(), set(), c
        ),
    },
    "arc": {
        "on_request_finished": lambda e, c: e.obj.on_request_finished(
            [[K[0], K[1]]], set(), {K[1]}, c
        ),
    },
    "m-lru": {
        "prepare_store": lambda e, c: e.obj.prepare_store([K[5]], c),
        "prepare_load": lambda e, c: e.obj.prepare_load([K[1]], c),
    },
}
POSITION_CALLS["vm-lru"] = POSITION_CALLS["m-lru"]

# Calls that read (or create) the request state on their context.
STATE_CALLS: dict[str, dict[str, Callable[[Env, Any], object]]] = {
    "lru": {
        "insert": lambda e, c: e.obj.insert(K[5], ready(9), c),
        "on_request_access": lambda e, c: e.obj.on_request_access([K[0]], c),
    },
}
for target in MANAGERS:
    STATE_CALLS[target] = {
        "prepare_store": lambda e, c: e.obj.prepare_store([K[5]], c),
        "prepare_load": lambda e, c: e.obj.prepare_load([K[1]], c),
        "on_new_request": lambda e, c: e.obj.on_new_request(c),
    }

for target, calls in POSITION_CALLS.items():
    for method, call in calls.items():
        for cname, (make, expected) in BAD_CONTEXTS.items():
            if target.startswith(("m-", "vm-")) and cname in ("int", "str", "object"):
                continue  # covered below: without a state the manager fails earlier
            case(
                target,
                f"{method}-ctx-{cname}",
                lambda e, call=call, make=make: call(e, make()),
                expected,
            )
for target, calls in STATE_CALLS.items():
    for method, call in calls.items():
        for cname, (make, expected) in BAD_STATE_CONTEXTS.items():
            if (target, method, cname) == ("lru", "insert", "none"):
                continue  # the two-argument form: no context is fine
            case(
                target,
                f"{method}-state-{cname}",
                lambda e, call=call, make=make: call(e, make()),
                expected,
            )
for target in POLICIES:
    for cname in ("int", "object"):
        make = BAD_CONTEXTS[cname][0]
        case(
            target,
            f"finish-ctx-{cname}",
            lambda e, make=make: e.obj.on_request_finished([[K[0]]], set(), set(), make()),
            ITE,
        )


class FlipContext(MethodContext):
    """Positions are good until ``bad`` is set: a request the manager tracks, then finishes
    with positions it cannot use."""

    def __init__(self) -> None:
        self.bad: Any = None
        super().__init__(lambda key: 16 * (K.index(key) + 1) if self.bad is None else self.bad)


def finish_with_bad_positions(e: Env, value: Any) -> object:
    ctx = e.extra
    ctx.bad = value
    return e.obj.on_request_finished(ctx)


for target in ("m-lru", "m-arc", "vm-lru", "vm-arc"):
    for name, value, expected in [
        ("str", "16", ITE),
        ("float", 16.0, ITE),
        ("2**63", 2**63, IAE),
    ]:

        def setup_and_finish(e: Env) -> object:
            ctx = FlipContext()
            e.obj.on_new_request(ctx)
            out = e.obj.prepare_store([K[6]], ctx)
            e.obj.complete_store(out.keys_to_store, ctx)
            e.extra = ctx
            return None

        CASES.append(
            pytest.param(
                target,
                (setup_and_finish, finish_with_bad_positions, value),
                expected,
                id=f"{target}-on_request_finished-positions-{name}",
            )
        )


# --- callbacks that raise: the user's exception, unchanged ------------------------------------


def boom_gen(*keys: bytes) -> Iterator[bytes]:
    yield from keys
    raise Boom("generator")


class BoomSet(set):
    def __contains__(self, key: object) -> bool:
        raise Boom("__contains__")


class BoomKey(bytes):
    """A key whose hash runs Python code (dict and set lookups call it)."""

    def __hash__(self) -> int:
        raise Boom("__hash__")


def interrupting_gen(*keys: bytes) -> Iterator[bytes]:
    yield from keys
    raise KeyboardInterrupt


for target in POLICIES:
    case(target, "touch-gen-raises", lambda e: e.obj.touch(boom_gen(K[0]), e.ctx), Boom)
    case(
        target,
        "touch-gen-interrupted",
        lambda e: e.obj.touch(interrupting_gen(K[0]), e.ctx),
        KeyboardInterrupt,
    )
    case(target, "miss-gen-raises", lambda e: e.obj.on_store_miss(boom_gen(K[5]), e.ctx), Boom)
    case(target, "evict-protected-raises", lambda e: e.obj.evict(1, boom_gen(K[0])), Boom)
    case(
        target,
        "finish-groups-gen-raises",
        lambda e: e.obj.on_request_finished(boom_gen([K[0]]), set(), set(), e.ctx),
        Boom,
    )
case(
    "lru",
    "on_request_access-gen-raises",
    lambda e: e.obj.on_request_access(boom_gen(K[0]), e.ctx),
    Boom,
)
case("lru", "insert-key-hash-raises", lambda e: e.obj.insert(BoomKey(K[5]), ready(9), e.ctx), Boom)
for where in ("insertion_only", "reused"):
    sets = {"insertion_only": (BoomSet(), set()), "reused": (set(), BoomSet())}[where]
    case(
        "arc",
        f"finish-{where}-contains-raises",
        lambda e, s=sets: e.obj.on_request_finished([[K[0], K[1]]], s[0], s[1], e.ctx),
        Boom,
    )
    case(
        "arc",
        f"finish-{where}-key-hash-raises",
        lambda e, w=where: e.obj.on_request_finished(
            [[K[0], BoomKey(K[1])]],
            {K[9]} if w == "insertion_only" else set(),
            {K[9]} if w == "reused" else set(),
            e.ctx,
        ),
        Boom,
    )
for target in MANAGERS:
    case(
        target,
        "prepare_store-gen-interrupted",
        lambda e: e.obj.prepare_store(interrupting_gen(K[5]), e.ctx),
        KeyboardInterrupt,
    )
    for method, call in COLLECTION_MANAGER_CALLS.items():
        if method == "touch" and target.startswith("vm-") and not VLLM_HAS_TOUCH:
            continue
        case(
            target,
            f"{method}-gen-raises",
            lambda e, call=call: call(e, boom_gen(K[1])),
            Boom,
        )


# --- ARC's key sets ---------------------------------------------------------------------------

for where in ("insertion_only", "reused"):
    for name, value in {"int": 5, "none": None, "float": 1.5, "object": object()}.items():
        sets = (value, set()) if where == "insertion_only" else (set(), value)
        case(
            "arc",
            f"finish-{where}-{name}",
            lambda e, s=sets: e.obj.on_request_finished([[K[0], K[1]]], s[0], s[1], e.ctx),
            ITE,
            None,
        )


# --- order_request_keys -----------------------------------------------------------------------


def order(groups: Any, ctx: Any) -> Callable[[Env | None], object]:
    return lambda e: kvcache.order_request_keys(groups() if callable(groups) else groups, ctx())


for name, groups, expected in [
    ("groups-int", 5, ITE),
    ("groups-none", None, ITE),
    ("groups-bytes", K[0], IKE),
    ("groups-str", "ab", IKE),
    ("group-bytes", [K[0]], IKE),
    ("group-int", [5], IKE),
    ("group-none-key", [[K[0], None]], IKE),
    ("group-str-key", [["a"]], IKE),
    ("groups-gen-raises", lambda: boom_gen([K[0]]), Boom),
]:
    case("new", f"order_request_keys-{name}", order(groups, positions_ctx), expected)
for cname, (make, expected) in BAD_CONTEXTS.items():
    case("new", f"order_request_keys-ctx-{cname}", order([[K[1], K[0]]], make), expected)


# --- ChunkStatus ------------------------------------------------------------------------------

for name, value, expected, xfail in [
    ("2**63", 2**63, IAE, None),
    ("2**70", 2**70, IAE, None),
    ("minus-2**63-1", -(2**63) - 1, IAE, None),
    ("float", 1.5, ITE, None),
    ("str", "1", ITE, None),
    ("none", None, ITE, None),
    ("bytes", b"\x01", ITE, None),
    ("list", [1], ITE, None),
    ("true", True, ITE, None),
    ("false", False, ITE, None),
]:
    case("new", f"ChunkStatus-{name}", lambda e, v=value: kvcache.ChunkStatus(v), expected, xfail)
case("new", "ChunkStatus-no-args", lambda e: kvcache.ChunkStatus(), TypeError)


def set_ref_cnt(e: Env, value: Any) -> None:
    e.obj.ref_cnt = value


for name, value, expected, xfail in [
    ("2**31", 2**31, IAE, None),
    ("minus-2**31-1", -(2**31) - 1, IAE, None),
    ("2**70", 2**70, IAE, None),
    ("float", 1.0, ITE, None),
    ("str", "1", ITE, None),
    ("none", None, ITE, None),
    ("true", True, ITE, None),
]:
    case(
        "chunk",
        f"ref_cnt-{name}",
        functools.partial(set_ref_cnt, value=value),
        expected,
        xfail,
    )


# --- manager constructors ---------------------------------------------------------------------


def ours(*args: Any, **kwargs: Any) -> Callable[[Env | None], object]:
    return lambda e: kvcache.OffloadingManager(*args, **kwargs)


def vllms(*args: Any, **kwargs: Any) -> Callable[[Env | None], object]:
    def make(e: Env | None) -> object:
        from kvcache.vllm import CPUOffloadingManager

        return CPUOffloadingManager(*args, **kwargs)

    return make


for flavour, make in (("ours", ours), ("vllm", vllms)):
    for name, value, expected, xfail in [
        ("minus-1", -1, IAE, None),
        ("2**32", 2**32, IAE, None),
        ("2**64", 2**64, IAE, None),
        ("2**70", 2**70, IAE, None),
        ("float", 4.0, ITE, None),
        ("str", "4", ITE, None),
        ("none", None, ITE, None),
        ("true", True, ITE, None),
    ]:
        case("new", f"{flavour}-num_chunks-{name}", make(value), expected, xfail)
    for name, value, expected, xfail in [
        ("unknown", "fifo", IAE, None),
        ("empty", "", IAE, None),
        ("upper", "LRU", IAE, None),
        ("int", 5, ITE, None),
        ("none", None, ITE, None),
        ("bytes", b"lru", ITE, None),
    ]:
        case("new", f"{flavour}-cache_policy-{name}", make(4, value), expected, xfail)
    for name, kwargs, expected, xfail in [
        ("enable_events-str", {"enable_events": "yes"}, ITE, None),
        ("enable_events-float", {"enable_events": 1.5}, ITE, None),
        ("store_threshold-2**70", {"store_threshold": 2**70}, IAE, None),
        ("store_threshold-minus-2**70", {"store_threshold": -(2**70)}, IAE, None),
        ("store_threshold-float", {"store_threshold": 2.0}, ITE, None),
        ("store_threshold-str", {"store_threshold": "2"}, ITE, None),
        ("store_threshold-none", {"store_threshold": None}, ITE, None),
        ("store_threshold-true", {"store_threshold": True}, ITE, None),
        ("max_tracker_size-minus-1", {"max_tracker_size": -1}, IAE, None),
        ("max_tracker_size-2**70", {"max_tracker_size": 2**70}, IAE, None),
        ("max_tracker_size-float", {"max_tracker_size": 1.5}, ITE, None),
        ("max_tracker_size-str", {"max_tracker_size": "64"}, ITE, None),
        ("max_tracker_size-true", {"max_tracker_size": True}, ITE, None),
    ]:
        case("new", f"{flavour}-{name}", make(4, **kwargs), expected, xfail)

# Unknown and misplaced arguments.
case("new", "ours-typo-kwarg", ours(4, cache_polcy="arc"), TypeError)
case("new", "ours-unknown-kwarg", ours(4, color="red"), TypeError)
case("new", "ours-info-kwarg", ours(4, info=None), TypeError)
case("new", "ours-module-path-kwarg", ours(4, cache_policy_module_path="x"), TypeError)
case("new", "ours-positional-options", ours(4, "lru", True), TypeError)
case("new", "ours-no-args", ours(), TypeError)
case("new", "vllm-typo-kwarg", vllms(4, cache_polcy="arc"), TypeError)
case("new", "vllm-unknown-kwarg", vllms(4, color="red"), TypeError)
case("new", "vllm-too-many-args", vllms(4, "lru", None, False, 1, 64, None, 0), TypeError)
case("new", "vllm-no-args", vllms(), TypeError)
case("new", "vllm-module-path-unknown", vllms(4, "lru", "some.module"), IAE)
case("new", "vllm-module-path-int", vllms(4, "lru", 5), ITE, None)


class _CoreSubclass(kvcache._core.OffloadingManager):
    """The Rust manager with result types, without the Python constructors' signatures."""

    _result_types = kvcache.OffloadingManager._result_types


case("new", "core-typo-kwarg", lambda e: _CoreSubclass(4, cache_polcy="arc"), TypeError)
case("new", "core-unknown-kwarg", lambda e: _CoreSubclass(4, color=1), TypeError)
case("new", "core-manager-direct", lambda e: kvcache._core.OffloadingManager(4), ITE, None)


# --- result types -----------------------------------------------------------------------------

# The sequence protocol of EvictedKeys: what a list raises (checked with isinstance).
for name, call, builtin in [
    ("index-99", lambda e: e.obj[99], IndexError),
    ("index-minus-99", lambda e: e.obj[-99], IndexError),
    ("index-str", lambda e: e.obj["0"], TypeError),
    ("index-float", lambda e: e.obj[0.0], TypeError),
    ("index-none", lambda e: e.obj[None], TypeError),
    ("find-absent", lambda e: e.obj.index(K[9]), ValueError),
    ("find-int", lambda e: e.obj.index(5), ValueError),
    ("count-no-args", lambda e: e.obj.count(), TypeError),
    ("hash", lambda e: hash(e.obj), TypeError),
    ("order-compare", lambda e: e.obj < [], TypeError),
]:
    CASES.append(pytest.param("evicted", call, ("isinstance", builtin), id=f"evicted-{name}"))
for cls in (kvcache.EvictedKeys, kvcache.PrepareStoreOutput, kvcache.OffloadingEvent):
    CASES.append(
        pytest.param(
            "new",
            lambda e, c=cls: c(),
            ("isinstance", TypeError),
            id=f"new-{cls.__name__}-not-constructible",
        )
    )

for name, value, expected, xfail in [
    ("str", "01", ITE, None),
    ("int", 5, ITE, None),
    ("none", None, ITE, None),
    ("float-item", [1.5], ITE, None),
    ("none-item", [None], ITE, None),
    ("bytes-item", [b"\x01"], ITE, None),
    ("2**70-item", [2**70], IAE, None),
    ("minus-2**70-item", [-(2**70)], IAE, None),
    ("true-item", [True], ITE, None),
]:
    spec = functools.partial(kvcache.LoadStoreSpec, value)
    case("new", f"LoadStoreSpec-{name}", lambda e, spec=spec: spec(), expected, xfail)


# --- the test ---------------------------------------------------------------------------------


def test_the_catalogue_is_large_and_distinct() -> None:
    assert len(CASES) >= 300
    assert len({p.id for p in CASES}) == len(CASES)


@pytest.mark.parametrize(("target", "call", "expected"), CASES)
def test_bad_input_raises_exactly_and_changes_nothing(
    target: str, call: Any, expected: Any
) -> None:
    env = TARGETS[target]()
    if isinstance(call, tuple):  # (setup, call, value): state is taken after the setup
        setup, then, value = call
        setup(env)
        call = functools.partial(then, value=value)
    if isinstance(expected, tuple):  # ("isinstance", builtin): the list protocol's errors
        _, builtin = expected
        before = state_of(env.obj) if env is not None else None
        with pytest.raises(builtin):
            call(env)
        if env is not None:
            assert state_of(env.obj) == before
        return
    if env is None:
        raises_exactly(lambda: call(env), expected)
        return
    raises_unchanged(env.obj, lambda: call(env), expected)


def test_every_error_class_is_a_kvcache_error_and_its_builtin() -> None:
    for cls, builtin in [
        (IKE, TypeError),
        (ITE, TypeError),
        (ICE, TypeError),
        (IAE, ValueError),
        (ISE, ValueError),
        (DKE, ValueError),
        (KNF, KeyError),
        (NEE, KeyError),
    ]:
        assert issubclass(cls, kvcache.KvCacheError)
        assert issubclass(cls, builtin)
    assert issubclass(IKE, ITE)
    assert issubclass(ICE, ITE)
