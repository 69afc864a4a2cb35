"""Hostile input at the edges of the scheduler-side API: the documented choices where kvcache
differs from vLLM (referenced chunks LRU skips, chunk layouts by size), and text, request
contexts and length hints that misbehave (lone surrogates, broken context dicts, methods patched
on the context class, an interrupt in ``__length_hint__``)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import kvcache
from tests.support.hostile import raises_exactly, raises_unchanged, ready
from tests.support.hostile_targets import (
    IAE,
    ITE,
    CtypesChunk,
    K,
)

# --- documented choices where kvcache differs from vLLM ---------------------------------------


def test_lru_skips_an_evictable_marked_chunk_that_is_still_referenced() -> None:
    """vLLM's LRU would assert; ours leaves the chunk and evicts the next idle one."""
    policy = kvcache.LRUCachePolicy(4)
    held, idle = CtypesChunk(1, 0), CtypesChunk(0, 1)
    policy.insert(K[0], held)  # ref_cnt 1 at insert: not evictable yet
    policy.insert(K[1], idle)
    policy.mark_evictable(K[0])  # marked evictable while ref_cnt is still 1
    policy.validate()
    before = policy._debug_state()
    assert policy.evict(2, set()) is None, "only one chunk is really idle"
    assert policy._debug_state() == before
    [(key, chunk)] = policy.evict(1, set())
    assert (key, chunk) == (K[1], idle)
    held.ref_cnt = 0
    [(key, chunk)] = policy.evict(1, set())
    assert (key, chunk) == (K[0], held)
    policy.validate()


def test_a_writable_sixteen_byte_chunk_layout_is_a_chunk() -> None:
    """vLLM's ctypes record, our own record's buffer and 16 raw bytes are accepted; evict
    returns the very object."""
    for make in (
        lambda: bytearray(16),
        lambda: (ctypes.c_char * 16)(),
        lambda: (ctypes.c_uint8 * 16)(),
        lambda: np.zeros(16, dtype=np.uint8),
        lambda: memoryview(bytearray(16)),
        lambda: CtypesChunk(0, 7),
    ):
        policy = kvcache.ARCCachePolicy(2)
        chunk = make()
        policy.insert(K[0], chunk)
        [(key, got)] = policy.evict(1, set())
        assert key == K[0]
        assert got is chunk


class SwappedChunk(ctypes.Structure):
    """16 bytes, but ``chunk_id`` first: read as vLLM's layout, its ``ref_cnt`` would be the
    low half of the chunk id."""

    _fields_ = [("chunk_id", ctypes.c_int64), ("ref_cnt", ctypes.c_int32)]


@pytest.mark.parametrize(
    "make",
    [
        lambda: SwappedChunk(0, 1),
        lambda: np.zeros(2, dtype=np.int64),
        lambda: np.zeros(4, dtype=np.int32),
        lambda: np.zeros(2, dtype=np.float64),
        lambda: (ctypes.c_int32 * 4)(),
    ],
    ids=["swapped-fields", "int64x2", "int32x4", "float64x2", "c-int32x4"],
)
def test_a_sixteen_byte_buffer_of_another_layout_is_refused(make: Callable[[], Any]) -> None:
    policy = kvcache.ARCCachePolicy(2)
    with pytest.raises(kvcache.InvalidChunkError, match="ref_cnt:<q:chunk_id"):
        policy.insert(K[0], make())
    assert len(policy) == 0
    policy.validate()


# --- text, request contexts and length hints --------------------------------------------------


def vllm_manager(*args: Any) -> Any:
    from kvcache.vllm import CPUOffloadingManager

    return CPUOffloadingManager(*args)


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (lambda: kvcache.OffloadingManager(4, "\ud800"), "cache_policy"),
        (lambda: vllm_manager(4, "\ud800"), "cache_policy"),
        (lambda: vllm_manager(4, "lru", "kvcache\ud800"), "cache_policy_module_path"),
    ],
    ids=["ours-policy", "vllm-policy", "vllm-module-path"],
)
def test_a_name_with_a_lone_surrogate_is_an_argument_error(
    make: Callable[[], object], argument: str
) -> None:
    error = raises_exactly(make, IAE)
    assert argument in str(error)


def manager_or_policy(kind: str) -> Any:
    return {
        "lru": lambda: kvcache.LRUCachePolicy(4, vllm_semantics="0.33"),
        "manager": lambda: kvcache.OffloadingManager(4, vllm_semantics="0.33"),
        "vllm-manager": lambda: vllm_manager(4),
    }[kind]()


def request_call(obj: Any, ctx: Any) -> object:
    if isinstance(obj, kvcache.BaseCachePolicy):
        return obj.on_request_access([K[0]], ctx)
    return obj.prepare_store([K[0]], ctx)


def vllm_context() -> Any:
    from vllm.v1.kv_offload.base import ReqContext

    return ReqContext("r")


@pytest.mark.parametrize("kind", ["lru", "manager", "vllm-manager"])
@pytest.mark.parametrize("attribute", ["_offload_key_positions", "_state"])
@pytest.mark.parametrize("make_ctx", [kvcache.ReqContext, vllm_context], ids=["ours", "vllm"])
@pytest.mark.parametrize("value", [None, [], "missing"])
def test_a_context_whose_dicts_are_broken_is_a_type_error(
    kind: str, attribute: str, make_ctx: Callable[[], Any], value: Any
) -> None:
    obj = manager_or_policy(kind)
    if isinstance(obj, kvcache.BaseCachePolicy):
        obj.insert(K[0], ready(0))
    ctx = make_ctx()
    if value == "missing":
        delattr(ctx, attribute)
    else:
        setattr(ctx, attribute, value)
    error = raises_unchanged(obj, lambda: request_call(obj, ctx), ITE)
    assert attribute in str(error)


@pytest.mark.parametrize("kind", ["lru", "manager"])
def test_a_method_patched_on_the_context_class_is_honoured(kind: str) -> None:
    """The fast path that reads a known context's position dict directly notices a class-level
    patch of ``get_offload_key_position`` made after it was taken."""
    obj = manager_or_policy(kind)
    if isinstance(obj, kvcache.BaseCachePolicy):
        obj.insert(K[0], ready(0))
    request_call(obj, kvcache.ReqContext())  # the type is cached now
    calls: list[bytes] = []

    def position(self: Any, key: bytes) -> int | None:
        calls.append(key)
        return None

    original = kvcache.ReqContext.get_offload_key_position
    kvcache.ReqContext.get_offload_key_position = position  # type: ignore[method-assign]
    try:
        request_call(obj, kvcache.ReqContext())
    finally:
        kvcache.ReqContext.get_offload_key_position = original  # type: ignore[method-assign]
    assert calls == [K[0]]


class InterruptedLength:
    def __iter__(self) -> Iterator[bytes]:
        return iter([K[0]])

    def __len__(self) -> int:
        raise KeyboardInterrupt


@pytest.mark.parametrize("kind", ["lru", "manager"])
def test_an_interrupt_in_a_length_hint_propagates(kind: str) -> None:
    obj = manager_or_policy(kind)
    raises_unchanged(obj, lambda: obj.touch(InterruptedLength()), KeyboardInterrupt)
