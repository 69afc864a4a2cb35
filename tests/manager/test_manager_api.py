"""The Python surface of ``kvcache.OffloadingManager``: results, the chunk table export, memory
accounting, request state lifetime, and typed errors that leave the manager unchanged."""

from __future__ import annotations

import contextlib
import ctypes
import gc

import numpy as np
import pytest

import kvcache
from tests.support.keys import make_key

KEYS = [make_key(i) for i in range(8)]


def stored(manager: kvcache.OffloadingManager, keys: list[bytes]) -> kvcache.ReqContext:
    ctx = kvcache.ReqContext("r")
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, 16 * (i + 1))
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    return ctx


@pytest.mark.parametrize("policy", list(kvcache.POLICY_KINDS))
def test_store_load_evict_round_trip(policy: str) -> None:
    m = kvcache.OffloadingManager(4, policy, enable_events=True)
    ctx = kvcache.ReqContext("r")
    m.on_new_request(ctx)
    assert m.lookup(KEYS[0], ctx) is kvcache.LookupResult.MISS
    out = m.prepare_store(KEYS[:3], ctx)
    assert out.keys_to_store == KEYS[:3]
    assert out.evicted_keys == []
    assert out.store_spec.block_ids.dtype == np.int32
    assert out.store_spec.block_ids.tolist() == [0, 1, 2]
    assert m.lookup(KEYS[0], ctx) is kvcache.LookupResult.HIT_PENDING
    m.complete_store(KEYS[:3], ctx)
    assert m.lookup(KEYS[0], ctx) is kvcache.LookupResult.HIT
    assert m.prepare_load(KEYS[:1], ctx).block_ids.tolist() == [0]
    out = m.prepare_store(KEYS[3:6], ctx)  # 1 free chunk: evicts 2 idle ones, never KEYS[0]
    assert len(out.evicted_keys) == 2
    assert KEYS[0] not in out.evicted_keys
    m.complete_load(KEYS[:1], ctx)
    m.on_request_finished(ctx)
    events = m.take_events()
    assert [(e.removed, len(e.keys)) for e in events] == [(False, 3), (True, 2)]
    assert m.take_events() == []
    stats = m.get_stats()
    assert stats.allocation_sizes == [3, 3]
    assert stats.stores_skipped is None
    m.validate()


def test_chunk_table_is_a_read_only_numpy_snapshot() -> None:
    m = kvcache.OffloadingManager(4)
    stored(m, KEYS[:2])
    ctx = kvcache.ReqContext("failing")
    assert m.prepare_store(KEYS[2:3], ctx) is not None
    m.complete_store(KEYS[2:3], ctx, success=False)
    table = np.asarray(m.chunk_table())
    assert table.dtype.names == ("ref_cnt", "chunk_id")
    # One record per id handed out (ids 0..2); id 2's store failed, so its slot is free.
    assert table["chunk_id"].tolist() == [0, 1, 2]
    assert table["ref_cnt"].tolist() == [0, 0, -2]
    assert len(m.chunk_table()) == 3
    assert not table.flags.writeable
    with pytest.raises(TypeError):
        memoryview(m.chunk_table()).cast("B")[0:1] = b"\x00"
    with pytest.raises(TypeError, match="not writable"):
        (ctypes.c_char * 16).from_buffer(m.chunk_table())
    ctx = kvcache.ReqContext("load")
    m.prepare_load(KEYS[:1], ctx)
    assert table["ref_cnt"].tolist()[0] == 0, "a copy: later calls do not change it"
    assert np.asarray(m.chunk_table())["ref_cnt"].tolist()[0] == 1
    del m
    gc.collect()
    assert table["chunk_id"].tolist() == [0, 1, 2], "the copy outlives the manager"


def test_empty_manager_table_and_zero_chunks() -> None:
    m = kvcache.OffloadingManager(0)
    assert np.asarray(m.chunk_table()).shape == (0,)
    ctx = kvcache.ReqContext("r")
    assert m.prepare_store(KEYS[:1], ctx) is None
    assert m.get_stats().usage == 0.0


def test_request_state_is_released_with_its_context() -> None:
    m = kvcache.OffloadingManager(8, "lru")
    ctx = stored(m, KEYS[:3])
    assert m.num_requests == 1
    del ctx
    gc.collect()
    assert m.num_requests == 0
    m.validate()


def test_memory_usage_is_reported_per_structure() -> None:
    m = kvcache.OffloadingManager(1024, "arc")
    stored(m, KEYS)
    usage = m.memory_usage()
    assert usage["resident_chunks"] == len(KEYS)
    # The chunk table grows with the chunk ids handed out, not with num_chunks.
    assert len(KEYS) * 16 <= usage["table"] < 1024 * 16
    assert usage["total"] == sum(usage[k] for k in ("policy", "table", "tracker", "requests"))


def test_store_threshold_skips_first_offers() -> None:
    """Under vLLM 0.33 every offer counts; under 0.34 a key counts once per request, so the
    same request offering it again is neither a store nor another skipped store, and a
    second request's offer stores it."""
    old = kvcache.OffloadingManager(
        8, store_threshold=2, max_tracker_size=16, vllm_semantics="0.33"
    )
    ctx = kvcache.ReqContext("r")
    assert old.prepare_store(KEYS[:2], ctx).keys_to_store == []
    assert old.prepare_store(KEYS[:2], ctx).keys_to_store == KEYS[:2]
    assert old.get_stats().stores_skipped == 2

    new = kvcache.OffloadingManager(
        8, store_threshold=2, max_tracker_size=16, vllm_semantics="0.34"
    )
    ctx = kvcache.ReqContext("r")
    assert new.prepare_store(KEYS[:2], ctx).keys_to_store == []
    assert new.prepare_store(KEYS[:2], ctx).keys_to_store == []
    assert new.get_stats().stores_skipped == 2
    assert new.prepare_store(KEYS[:3], kvcache.ReqContext("s")).keys_to_store == KEYS[:2]
    assert new.get_stats().stores_skipped == 1  # KEYS[2]: that request's first offer
    new.validate()


def test_stored_events_carry_the_request_under_vllm_034() -> None:
    for semantics in ("0.33", "0.34"):
        m = kvcache.OffloadingManager(8, enable_events=True, vllm_semantics=semantics)
        ctx = kvcache.ReqContext("r")
        out = m.prepare_store(KEYS[:2], ctx)
        m.complete_store(out.keys_to_store, ctx)
        m.complete_store(m.prepare_store(KEYS[2:3], ctx).keys_to_store, ctx, success=False)
        stored, failed = m.take_events()
        assert (stored.removed, failed.removed, failed.metadata_only) == (False, True, True)
        assert stored.removal_expected is (semantics == "0.34")
        assert stored.req_context is (ctx if semantics == "0.34" else None)
        assert failed.removal_expected is False
        assert failed.req_context is None
        with (
            pytest.raises(kvcache.UnsupportedOperationError)
            if semantics == "0.34"
            else (contextlib.nullcontext())
        ):
            m.touch(KEYS[:1], ctx)


def test_constructor_is_keyword_only_and_validates() -> None:
    with pytest.raises(TypeError):
        kvcache.OffloadingManager(8, "lru", True)
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.OffloadingManager(8, "fifo")
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.OffloadingManager(-1)
    with pytest.raises(kvcache.InvalidTypeError):
        kvcache.OffloadingManager("8")


def snapshot(m: kvcache.OffloadingManager) -> dict:
    m.validate()
    return m._debug_state()


BAD_CALLS = [
    ("load absent", lambda m, c: m.prepare_load([make_key(99)], c), kvcache.KeyNotFoundError),
    ("load pending", lambda m, c: m.prepare_load([KEYS[5]], c), kvcache.InvalidStateError),
    ("unload idle", lambda m, c: m.complete_load([KEYS[0]], c), kvcache.InvalidStateError),
    ("unload absent", lambda m, c: m.complete_load([make_key(99)], c), kvcache.KeyNotFoundError),
    ("store twice", lambda m, c: m.prepare_store([KEYS[6], KEYS[6]], c),
     kvcache.InvalidArgumentError),
    ("store mixed", lambda m, c: m.prepare_store([KEYS[6], 3], c), kvcache.InvalidKeyError),
    ("store no context", lambda m, c: m.prepare_store([KEYS[6]], None), kvcache.InvalidTypeError),
    ("lookup int", lambda m, c: m.lookup(1, c), kvcache.InvalidKeyError),
    ("touch str", lambda m, c: m.touch("abc", c), kvcache.InvalidKeyError),
    ("load after finish", lambda m, c: m.prepare_load([KEYS[7]], c), kvcache.InvalidStateError),
]  # fmt: skip


@pytest.mark.parametrize("policy", list(kvcache.POLICY_KINDS))
@pytest.mark.parametrize(
    ("last", "error"),
    [
        (KEYS[0], kvcache.InvalidStateError),  # pinned once, unpinned twice
        (KEYS[3], kvcache.InvalidStateError),  # never pinned
        (make_key(99), kvcache.KeyNotFoundError),
    ],
    ids=["twice", "idle", "absent"],
)
def test_failed_complete_load_undoes_the_unpins_before_it(
    policy: str, last: bytes, error: type
) -> None:
    m = kvcache.OffloadingManager(8, policy)
    stored(m, KEYS[:5])
    ctx = kvcache.ReqContext("load")
    m.prepare_load(KEYS[:2], ctx)
    before = snapshot(m)
    with pytest.raises(error):
        m.complete_load([KEYS[0], KEYS[1], last], ctx)
    assert snapshot(m) == before
    m.complete_load(KEYS[:2], ctx)
    assert m.num_evictable == 5


@pytest.mark.parametrize("policy", list(kvcache.POLICY_KINDS))
@pytest.mark.parametrize(("name", "call", "error"), BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_calls_raise_typed_errors_and_change_nothing(
    policy: str, name: str, call, error: type
) -> None:
    m = kvcache.OffloadingManager(8, policy)
    ctx = stored(m, KEYS[:5])
    other = stored(m, KEYS[7:8])  # resident, never seen by `ctx`
    m.prepare_store([KEYS[5]], ctx)  # pending
    if name == "load after finish":
        m.on_request_finished(ctx)
    before = snapshot(m)
    with pytest.raises(error):
        call(m, ctx)
    assert snapshot(m) == before
    del other


def test_an_empty_manager_is_truthy() -> None:
    # vLLM builds its manager lazily with `if not self._manager:`; `__len__` must not make an
    # empty manager look absent.
    m = kvcache.OffloadingManager(4)
    assert len(m) == 0
    assert m


class _CountingContext(kvcache.ReqContext):
    """A ReqContext whose state methods are overridden: they must be called, not bypassed."""

    __slots__ = ("calls",)

    def __init__(self, req_id: str) -> None:
        super().__init__(req_id)
        self.calls = 0

    def get_state(self, cls):  # type: ignore[no-untyped-def]
        self.calls += 1
        return super().get_state(cls)

    def set_state(self, val):  # type: ignore[no-untyped-def]
        self.calls += 1
        super().set_state(val)


def test_overridden_state_methods_are_honoured() -> None:
    # Known ReqContext classes have their `_state` dict read directly; a subclass that
    # overrides get_state/set_state must still see its methods called.
    m = kvcache.OffloadingManager(8, "arc")
    ctx = _CountingContext("r")
    m.on_new_request(ctx)
    assert ctx.calls == 2  # get_state found nothing, set_state stored the manager's state
    plain = kvcache.ReqContext("p")
    m.on_new_request(plain)
    assert len(plain._state) == 1  # the direct path stores under the same key set_state uses
    (state,) = plain._state.values()
    assert plain.get_state(type(state)) is state
    m.validate()


def test_state_survives_many_interleaved_contexts() -> None:
    # More live requests than the manager's recent-context cache: each still maps to its own
    # request state, and finishing them in any order applies each one once.
    m = kvcache.OffloadingManager(256, "lru")
    ctxs = [kvcache.ReqContext(f"r{i}") for i in range(80)]
    for i, ctx in enumerate(ctxs):
        ctx.set_offload_key_position(KEYS[i % 8] + bytes([i]), 16)
        m.on_new_request(ctx)
        assert m.prepare_store([KEYS[i % 8] + bytes([i])], ctx) is not None
    assert m.num_requests == 80
    for ctx in reversed(ctxs):
        m.on_request_finished(ctx)
    del ctxs, ctx
    gc.collect()
    assert m.num_requests == 0
    m.validate()


@pytest.mark.parametrize("policy", list(kvcache.POLICY_KINDS))
def test_evicted_keys_is_a_read_only_sequence_of_bytes(policy: str) -> None:
    from collections.abc import Sequence

    m = kvcache.OffloadingManager(2, policy)
    stored(m, KEYS[:2])
    ctx = kvcache.ReqContext("evicting")
    m.on_new_request(ctx)
    out = m.prepare_store(KEYS[2:4], ctx)
    assert out is not None
    evicted = out.evicted_keys
    assert isinstance(evicted, Sequence)
    assert len(evicted) == 2
    assert bool(evicted)
    assert sorted(evicted) == sorted(KEYS[:2])
    assert evicted == list(evicted)
    assert evicted != KEYS[5:7]
    assert evicted[0] in evicted
    assert evicted[-1] == list(evicted)[-1]
    assert evicted[0:1] == [evicted[0]]
    assert evicted.index(evicted[1]) == 1
    assert evicted.count(evicted[0]) == 1
    assert list(reversed(evicted)) == list(evicted)[::-1]
    assert evicted[0] is evicted[0]  # made once, then kept
    assert repr(evicted) == repr(list(evicted))
    with pytest.raises(IndexError):
        evicted[2]
    with pytest.raises(TypeError):
        evicted[0] = b"x"  # type: ignore[index]
    with pytest.raises(TypeError):
        hash(evicted)
    none_evicted = m.prepare_store([], ctx)
    assert none_evicted is not None
    assert len(none_evicted.evicted_keys) == 0
    assert not none_evicted.evicted_keys
    assert none_evicted.evicted_keys == []
