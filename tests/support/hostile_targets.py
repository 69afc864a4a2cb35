"""The targets of the hostile-input tests: a populated policy, manager (kvcache's, or its
vLLM-shaped front), chunk or eviction result over the keys ``K``, each built fresh per case
(``TARGETS``), with the exact error classes the cases expect."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kvcache
from tests.support.hostile import ready
from tests.support.keys import make_key

K = [make_key(i) for i in range(10)]

IKE = kvcache.InvalidKeyError
ITE = kvcache.InvalidTypeError
ICE = kvcache.InvalidChunkError
IAE = kvcache.InvalidArgumentError
ISE = kvcache.InvalidStateError
KNF = kvcache.KeyNotFoundError
DKE = kvcache.DuplicateKeyError
NEE = kvcache.NotEvictableError


class Boom(Exception):
    """A user's own exception, raised from Python code kvcache runs."""


# --- targets ----------------------------------------------------------------------------------


class CtypesChunk(ctypes.Structure):
    """vLLM's ChunkStatus layout, without importing vLLM."""

    _fields_ = [("ref_cnt", ctypes.c_int32), ("chunk_id", ctypes.c_int64)]


@dataclass
class Env:
    """What a case runs against: ``obj`` (whose state must not change) and a request context
    that knows the positions of every key in ``K``."""

    obj: Any
    ctx: kvcache.ReqContext
    extra: Any = None


def positions_ctx(name: str = "r") -> kvcache.ReqContext:
    ctx = kvcache.ReqContext(name)
    for i, key in enumerate(K):
        ctx.set_offload_key_position(key, 16 * (i + 1))
    return ctx


def policy_env(cls: type) -> Env:
    """K0, K1 idle; K2 pinned (ref_cnt 1); K3.. absent. vLLM 0.33's protocol, which has
    touch (under 0.34's, touch refuses before it reads its keys)."""
    policy = cls(4, vllm_semantics="0.33")
    ctx = positions_ctx()
    for i in range(3):
        policy.insert(K[i], ready(i), ctx)
    policy.get(K[2]).ref_cnt = 1
    if cls is kvcache.LRUCachePolicy:
        policy.mark_non_evictable(K[2])
    return Env(policy, ctx)


def populate_manager(manager: Any) -> kvcache.ReqContext:
    """K0 loading (pinned), K1 idle, K2 pending store; K3.. absent."""
    ctx = positions_ctx()
    manager.on_new_request(ctx)
    out = manager.prepare_store(K[:2], ctx)
    manager.complete_store(out.keys_to_store, ctx)
    manager.prepare_store(K[2:3], ctx)
    manager.prepare_load(K[:1], ctx)
    manager.take_events()
    return ctx


def manager_env(policy: str) -> Env:
    manager = kvcache.OffloadingManager(4, policy, enable_events=True, vllm_semantics="0.33")
    return Env(manager, populate_manager(manager))


def vllm_manager_env(policy: str) -> Env:
    from kvcache.vllm import CPUOffloadingManager

    manager = CPUOffloadingManager(num_chunks=4, cache_policy=policy, enable_events=True)
    return Env(manager, populate_manager(manager))


def chunk_env() -> Env:
    return Env(ready(5), positions_ctx())


def evicted_env() -> Env:
    manager = kvcache.OffloadingManager(2)
    ctx = positions_ctx()
    out = manager.prepare_store(K[:2], ctx)
    manager.complete_store(out.keys_to_store, ctx)
    out = manager.prepare_store(K[2:4], ctx)
    assert sorted(out.evicted_keys) == K[:2]
    return Env(out.evicted_keys, ctx)


TARGETS: dict[str, Callable[[], Env | None]] = {
    "lru": functools.partial(policy_env, kvcache.LRUCachePolicy),
    "arc": functools.partial(policy_env, kvcache.ARCCachePolicy),
    "turn": functools.partial(policy_env, kvcache.TurnCachePolicy),
    "m-lru": functools.partial(manager_env, "lru"),
    "m-arc": functools.partial(manager_env, "arc"),
    "m-turn": functools.partial(manager_env, "turn"),
    "vm-lru": functools.partial(vllm_manager_env, "lru"),
    "vm-arc": functools.partial(vllm_manager_env, "arc"),
    "vm-turn": functools.partial(vllm_manager_env, "turn"),
    "chunk": chunk_env,
    "evicted": evicted_env,
    "new": lambda: None,  # constructors: nothing exists before the call
}
POLICIES = ["lru", "arc", "turn"]
MANAGERS = ["m-lru", "m-arc", "m-turn", "vm-lru", "vm-arc", "vm-turn"]
#: vLLM 0.33's manager has touch, and so has kvcache.vllm's there; 0.34's has none (read from
#: the installed vLLM's metadata: collecting the cases imports no vLLM).
VLLM_HAS_TOUCH = kvcache._semantics.default_semantics() == "0.33"
