"""The Python surface of the policies: ChunkStatus through the buffer protocol, the protocol's
call shapes, request state ownership, and typed errors that leave state unchanged."""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys

import numpy as np
import pytest

import kvcache
from tests.support.keys import make_key

POLICIES = list(kvcache.POLICY_KINDS.values())


class CtypesChunk(ctypes.Structure):
    """vLLM's ChunkStatus layout, without importing vLLM."""

    _fields_ = [("ref_cnt", ctypes.c_int32), ("chunk_id", ctypes.c_int64)]


def snapshot(policy: kvcache.BaseCachePolicy) -> dict:
    policy.validate()
    return policy._debug_state()


def ready(chunk_id: int) -> kvcache.ChunkStatus:
    chunk = kvcache.ChunkStatus(chunk_id)
    chunk.ref_cnt = 0
    return chunk


# --- ChunkStatus ------------------------------------------------------------------------------


def test_chunk_status_starts_pending_and_exposes_vllm_layout() -> None:
    chunk = kvcache.ChunkStatus(7)
    assert (chunk.ref_cnt, chunk.chunk_id, chunk.is_ready) == (-1, 7, False)
    view = memoryview(chunk)
    assert (view.nbytes, view.itemsize, view.readonly) == (16, 16, False)
    raw = view.cast("B")
    assert int.from_bytes(raw[0:4], "little", signed=True) == -1
    assert int.from_bytes(raw[8:16], "little", signed=True) == 7
    chunk.ref_cnt = 3
    assert int.from_bytes(raw[0:4], "little", signed=True) == 3
    assert chunk.is_ready


def test_chunk_status_is_writable_through_numpy_and_ctypes() -> None:
    chunk = kvcache.ChunkStatus(5)
    record = np.asarray(memoryview(chunk))
    assert record.dtype.names == ("ref_cnt", "chunk_id")
    assert record.dtype.itemsize == 16
    assert (int(record["ref_cnt"]), int(record["chunk_id"])) == (-1, 5)
    record["ref_cnt"] = 2
    assert chunk.ref_cnt == 2
    mirror = CtypesChunk.from_buffer(chunk)
    mirror.ref_cnt = 0
    assert chunk.ref_cnt == 0
    assert mirror.chunk_id == 5
    del mirror, record
    gc.collect()


def test_chunk_status_rejects_out_of_range_values() -> None:
    chunk = kvcache.ChunkStatus(1)
    with pytest.raises(kvcache.InvalidArgumentError, match="32-bit"):
        chunk.ref_cnt = 2**31
    with pytest.raises(kvcache.InvalidTypeError):
        chunk.ref_cnt = "1"
    with pytest.raises(kvcache.InvalidTypeError):
        chunk.ref_cnt = True
    with pytest.raises(kvcache.InvalidArgumentError, match="64-bit"):
        kvcache.ChunkStatus(2**70)
    with pytest.raises(AttributeError):
        chunk.chunk_id = 3
    assert chunk.ref_cnt == -1


# --- protocol shapes ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", POLICIES)
def test_get_and_evict_return_the_inserted_objects_of_either_chunk_type(cls: type) -> None:
    policy = cls(cache_capacity=4)
    ours, foreign = ready(1), CtypesChunk(0, 2)
    policy.insert(make_key(1), ours)
    policy.insert(make_key(2), foreign, kvcache.ReqContext())
    assert policy.get(make_key(1)) is ours
    assert policy.get(make_key(2)) is foreign
    assert policy.get(make_key(3)) is None
    assert len(policy) == 2
    assert make_key(2) in policy
    # vLLM's manager pins by writing ref_cnt in place; the policy must see it.
    foreign.ref_cnt = 1
    if cls is kvcache.LRUCachePolicy:
        policy.mark_non_evictable(make_key(2))
    evicted = policy.evict(1, set())
    assert evicted == [(make_key(1), ours)]
    assert evicted[0][1] is ours
    assert policy.evict(1, set()) is None
    foreign.ref_cnt = 0
    if cls is kvcache.LRUCachePolicy:
        policy.mark_evictable(make_key(2))
    [(key, chunk)] = policy.evict(1, set())
    assert key == make_key(2)
    assert chunk is foreign
    assert policy.cache_capacity == 4


@pytest.mark.parametrize("cls", POLICIES)
def test_evict_zero_and_protected_keys(cls: type) -> None:
    policy = cls(3)
    for i in range(3):
        policy.insert(make_key(i), ready(i))
    assert policy.evict(0, set()) == []
    before = snapshot(policy)
    assert policy.evict(3, {make_key(0)}) is None
    assert snapshot(policy) == before
    assert [k for k, _ in policy.evict(2, frozenset({make_key(0)}))] == [
        make_key(1),
        make_key(2),
    ]


def test_arc_exposes_its_adaptive_target() -> None:
    policy = kvcache.ARCCachePolicy(2)
    for i in range(2):
        policy.insert(make_key(i), ready(i))
    policy.evict(2, set())
    policy.on_store_miss([make_key(0)], None)
    assert policy.target_t1_size == 1.0


def test_order_request_keys_sorts_only_when_every_key_has_one_position() -> None:
    ctx = kvcache.ReqContext("r")
    a, b, c = make_key(1), make_key(2), make_key(3)
    ctx.set_offload_key_position(a, 32)
    ctx.set_offload_key_position(b, 16)
    assert kvcache.order_request_keys([[a], [b]], ctx) == [b, a]
    assert kvcache.order_request_keys([[a], [b, c]], ctx) == [a, b, c]  # c has none
    assert kvcache.order_request_keys([[a, b], [a]], ctx) == [a, b, a]  # a repeats


class _ContextWithDict(kvcache.ReqContext):
    """A ReqContext subclass whose instances have a ``__dict__`` (no ``__slots__``)."""


def test_positions_honour_a_method_shadowed_on_the_instance() -> None:
    # Known context classes have their position dict read directly, unless the instance
    # shadows get_offload_key_position: then the override is called.
    a, b = make_key(1), make_key(2)
    ctx = _ContextWithDict("r")
    ctx.set_offload_key_position(a, 16)
    ctx.set_offload_key_position(b, 32)
    assert kvcache.order_request_keys([[b, a]], ctx) == [a, b]
    ctx.get_offload_key_position = lambda key: {a: 32, b: 16}[key]  # type: ignore[method-assign]
    assert kvcache.order_request_keys([[a, b]], ctx) == [b, a]


def test_lru_request_state_belongs_to_each_policy_and_dies_with_the_context() -> None:
    first = kvcache.LRUCachePolicy(8, vllm_semantics="0.33")
    second = kvcache.LRUCachePolicy(8, vllm_semantics="0.33")
    ctx = kvcache.ReqContext("shared")
    key = make_key(1)
    ctx.set_offload_key_position(key, 16)
    first.insert(make_key(9), ready(9))  # a fresh rank: consumes rank 1 in `first` only
    first.insert(key, ready(1), ctx)
    second.insert(key, ready(1), ctx)
    assert first._debug_state()["ranks"][key] == (2, -16)
    assert second._debug_state()["ranks"][key] == (1, -16)
    first.touch([key], ctx)
    assert first._debug_state()["request_groups"] == 1
    del ctx
    gc.collect()
    first.evict(0, set())  # the policy releases dead requests at its next call
    assert first._debug_state()["request_groups"] == 0
    first.validate()


def test_lru_request_rank_does_not_outlive_clear() -> None:
    policy = kvcache.LRUCachePolicy(8)
    ctx = kvcache.ReqContext("r")
    for i in range(2):
        ctx.set_offload_key_position(make_key(i), 16 * (i + 1))
    policy.insert(make_key(0), ready(0), ctx)
    policy.clear()
    policy.insert(make_key(1), ready(1), ctx)
    assert policy._debug_state()["ranks"] == {make_key(1): (1, -32)}


def test_import_kvcache_imports_neither_vllm_nor_torch() -> None:
    code = "import sys, kvcache; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# --- bad input: typed errors, state unchanged ---------------------------------------------


def populated(cls: type) -> tuple[kvcache.BaseCachePolicy, kvcache.ReqContext]:
    policy = cls(4, vllm_semantics="0.33")  # touch exists only in vLLM 0.33's protocol
    ctx = kvcache.ReqContext("r")
    for i in range(3):
        ctx.set_offload_key_position(make_key(i), 16 * (i + 1))
        policy.insert(make_key(i), ready(i), ctx)
    return policy, ctx


BAD_CALLS = [
    ("get", lambda p, c: p.get("not-bytes"), kvcache.InvalidKeyError, TypeError),
    ("insert key", lambda p, c: p.insert(1, ready(9)), kvcache.InvalidKeyError, TypeError),
    (
        "insert chunk",
        lambda p, c: p.insert(make_key(9), object()),
        kvcache.InvalidChunkError,
        TypeError,
    ),
    (
        "insert short buffer",
        lambda p, c: p.insert(make_key(9), bytearray(8)),
        kvcache.InvalidChunkError,
        TypeError,
    ),
    (
        "insert duplicate",
        lambda p, c: p.insert(make_key(0), ready(9), c),
        kvcache.DuplicateKeyError,
        ValueError,
    ),
    ("remove absent", lambda p, c: p.remove(make_key(9)), kvcache.KeyNotFoundError, KeyError),
    (
        "mark absent",
        lambda p, c: p.mark_evictable(make_key(9)),
        kvcache.KeyNotFoundError,
        KeyError,
    ),
    (
        "unmark absent",
        lambda p, c: p.mark_non_evictable(make_key(9)),
        kvcache.KeyNotFoundError,
        KeyError,
    ),
    ("evict n=-1", lambda p, c: p.evict(-1, set()), kvcache.InvalidArgumentError, ValueError),
    ("evict n=1.0", lambda p, c: p.evict(1.0, set()), kvcache.InvalidTypeError, TypeError),
    ("evict n=True", lambda p, c: p.evict(True, set()), kvcache.InvalidTypeError, TypeError),
    (
        "evict protected",
        lambda p, c: p.evict(1, {make_key(0), 5}),
        kvcache.InvalidKeyError,
        TypeError,
    ),
    (
        "touch mixed",
        lambda p, c: p.touch([make_key(0), None, make_key(1)], c),
        kvcache.InvalidKeyError,
        TypeError,
    ),
    ("touch bytes", lambda p, c: p.touch(make_key(0), c), kvcache.InvalidKeyError, TypeError),
    (
        "miss mixed",
        lambda p, c: p.on_store_miss([make_key(3), 7], c),
        kvcache.InvalidKeyError,
        TypeError,
    ),
    (
        "finish mixed",
        lambda p, c: p.on_request_finished([[make_key(2)], [b"x", 1]], set(), set(), c),
        kvcache.InvalidKeyError,
        TypeError,
    ),
]


@pytest.mark.parametrize("cls", POLICIES)
@pytest.mark.parametrize("n", [5, 2**63, 2**70])
def test_evicting_more_than_resident_returns_none_like_vllm(cls: type, n: int) -> None:
    policy, _ = populated(cls)
    before = snapshot(policy)
    assert policy.evict(n, set()) is None
    assert snapshot(policy) == before


@pytest.mark.parametrize("cls", POLICIES)
@pytest.mark.parametrize(
    ("name", "call", "error", "builtin"), BAD_CALLS, ids=[b[0] for b in BAD_CALLS]
)
def test_bad_input_raises_typed_errors_and_changes_nothing(
    cls: type, name: str, call, error: type, builtin: type
) -> None:
    policy, ctx = populated(cls)
    before = snapshot(policy)
    with pytest.raises(error) as info:
        call(policy, ctx)
    assert isinstance(info.value, builtin)
    assert isinstance(info.value, kvcache.KvCacheError)
    assert snapshot(policy) == before


def test_lru_mark_non_evictable_requires_an_evictable_key() -> None:
    policy, _ = populated(kvcache.LRUCachePolicy)
    policy.mark_non_evictable(make_key(0))
    before = snapshot(policy)
    with pytest.raises(kvcache.NotEvictableError) as info:
        policy.mark_non_evictable(make_key(0))
    assert isinstance(info.value, KeyError)
    assert snapshot(policy) == before


def test_lru_bad_positions_and_contexts_fail_before_any_change() -> None:
    policy, _ctx = populated(kvcache.LRUCachePolicy)
    before = snapshot(policy)

    class BadPositions:
        def get_offload_key_position(self, key: bytes) -> object:
            return "sixteen"

        def get_state(self, cls: type) -> None:
            return None

        def set_state(self, val: object) -> None:
            raise AssertionError("must not be reached")

    with pytest.raises(kvcache.InvalidTypeError):
        policy.on_request_access([make_key(0)], BadPositions())
    with pytest.raises(kvcache.InvalidTypeError):
        policy.insert(make_key(7), ready(7), BadPositions())
    with pytest.raises(kvcache.InvalidTypeError):
        policy.on_request_access([make_key(0)], object())
    big = kvcache.ReqContext("big")
    big.set_offload_key_position(make_key(0), 2**64)
    with pytest.raises(kvcache.InvalidArgumentError):
        policy.on_request_access([make_key(0)], big)
    assert snapshot(policy) == before


@pytest.mark.parametrize("cls", POLICIES)
def test_negative_capacity_is_refused(cls: type) -> None:
    with pytest.raises(kvcache.InvalidArgumentError):
        cls(-1)
    with pytest.raises(kvcache.InvalidTypeError):
        cls("8")


@pytest.mark.parametrize("cls", POLICIES)
def test_an_empty_policy_is_truthy(cls: type) -> None:
    policy = cls(4)
    assert len(policy) == 0
    assert policy


def test_arc_on_request_finished_honours_a_set_subclass_membership() -> None:
    """vLLM's sets are asked directly; a subclass's own ``__contains__`` is honoured."""

    class Nothing(set):
        def __contains__(self, key: object) -> bool:
            return False

    policy = kvcache.ARCCachePolicy(cache_capacity=4)
    ctx = kvcache.ReqContext("r")
    keys = [make_key(i) for i in range(2)]
    for i, k in enumerate(keys):
        policy.insert(k, ready(i))
    # Claiming no member, `reused` promotes nothing; as a plain set it promotes both keys to
    # T2, walked tail to head.
    policy.on_request_finished([keys], set(), Nothing(keys), ctx)
    assert policy._debug_state()["t2"] == []
    policy.on_request_finished([keys], set(), set(keys), ctx)
    assert policy._debug_state()["t2"] == keys[::-1]


@pytest.mark.parametrize("cls", POLICIES)
def test_touch_is_vllm_033_only_and_its_refusal_changes_nothing(cls: type) -> None:
    policy, ctx = populated(cls)
    policy.touch([make_key(0)], ctx)
    newer = cls(4, vllm_semantics="0.34")
    newer.insert(make_key(0), ready(0), ctx)
    before = snapshot(newer)
    with pytest.raises(kvcache.UnsupportedOperationError) as info:
        newer.touch([make_key(0)], ctx)
    assert isinstance(info.value, NotImplementedError)
    assert snapshot(newer) == before


def test_lru_store_miss_is_a_touch_under_vllm_033_only() -> None:
    """vLLM 0.33's protocol defaults on_store_miss to touch (LRU inherits it: a resident key
    named in a miss gets a fresh rank); 0.34's default does nothing."""
    ranks = {}
    for semantics in ("0.33", "0.34"):
        policy = kvcache.LRUCachePolicy(4, vllm_semantics=semantics)
        for i in range(2):
            policy.insert(make_key(i), ready(i))
        policy.on_store_miss([make_key(0)])
        ranks[semantics] = policy._debug_state()["ranks"][make_key(0)]
        assert policy.vllm_semantics == semantics
        policy.validate()
    assert ranks == {"0.33": (3, 0), "0.34": (1, 0)}


@pytest.mark.parametrize(
    ("installed", "expected"),
    [("0.33.0", "0.33"), ("0.34.0+cu129", "0.34"), ("0.35.0", "0.34"), (None, "0.34")],
)
def test_the_default_semantics_follow_the_installed_vllm(
    monkeypatch: pytest.MonkeyPatch, installed: str | None, expected: str
) -> None:
    import kvcache._semantics as semantics

    monkeypatch.setattr(semantics, "installed_vllm_version", lambda: installed)
    assert kvcache.LRUCachePolicy(4).vllm_semantics == expected
    assert kvcache.ARCCachePolicy(4).vllm_semantics == expected
    assert kvcache.OffloadingManager(4).vllm_semantics == expected


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("0.32", kvcache.InvalidArgumentError),
        ("", kvcache.InvalidArgumentError),
        (0.34, kvcache.InvalidTypeError),
        (b"0.34", kvcache.InvalidTypeError),
    ],
)
def test_a_bad_semantics_name_is_refused_typed(value: object, error: type) -> None:
    for make in (*kvcache.POLICY_KINDS.values(), kvcache.OffloadingManager):
        with pytest.raises(error):
            make(4, vllm_semantics=value)
