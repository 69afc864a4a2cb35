"""Policies side by side: vLLM 0.33.0's pure-Python LRU/ARC vs kvcache's, in one process.

Each benchmark holds ENTRIES resident, ready, evictable chunks (vLLM's ctypes ChunkStatus in
both, as vLLM's manager would pass) and times one batch operation; ``bench/summarize.py`` turns
the JSON into ns per key and speedups. Run with ``make bench-py``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

import kvcache
import kvcache.vllm

ENTRIES = 100_000
BATCH = 256
EVICT = 32


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\x00\x00\x00\x00"


def make_policy(impl: str, kind: str) -> tuple[Any, Any, Any]:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

    cls = {
        ("vllm", "lru"): LRUCachePolicy,
        ("vllm", "arc"): ARCCachePolicy,
        ("kvcache", "lru"): kvcache.LRUCachePolicy,
        ("kvcache", "arc"): kvcache.ARCCachePolicy,
    }[impl, kind]
    policy = cls(cache_capacity=ENTRIES)
    ctx = ReqContext(req_id="setup")
    for i in range(ENTRIES):
        store(policy, key(i), ChunkStatus(i), ctx)
    if kind == "arc":
        # Promote half to T2 so both lists are populated, as in steady state.
        policy.touch([key(i) for i in range(0, ENTRIES, 2)], ctx)
    return policy, ctx, ChunkStatus


def store(policy: Any, k: bytes, chunk: Any, ctx: Any) -> None:
    """As vLLM's manager stores a chunk: inserted pending, then ready and evictable."""
    policy.insert(k, chunk, ctx)
    chunk.ref_cnt = 0
    policy.mark_evictable(k)


IMPLS = ["vllm", "kvcache"]
KINDS = ["lru", "arc"]


@pytest.fixture(
    scope="module", params=[(i, k) for k in KINDS for i in IMPLS], ids=lambda p: f"{p[1]}-{p[0]}"
)
def setup(request: pytest.FixtureRequest) -> tuple[str, str, Any, Any, Any]:
    impl, kind = request.param
    policy, ctx, chunk_cls = make_policy(impl, kind)
    return impl, kind, policy, ctx, chunk_cls


def run(
    benchmark: Any, setup: tuple, op: str, per_call_keys: int, fn: Callable[[], object]
) -> None:
    impl, kind, *_ = setup
    benchmark.group = f"{kind} {op}"
    benchmark.extra_info.update(impl=impl, kind=kind, op=op, keys_per_call=per_call_keys)
    benchmark.pedantic(fn, rounds=200, iterations=1, warmup_rounds=5)


def test_get(benchmark: Any, setup: tuple) -> None:
    _, _, policy, _, _ = setup
    rng = random.Random(0)
    keys = [key(rng.randrange(ENTRIES)) for _ in range(1000)]
    get = policy.get

    def gets() -> None:
        for k in keys:
            get(k)

    run(benchmark, setup, "get", len(keys), gets)


def test_touch(benchmark: Any, setup: tuple) -> None:
    _, _, policy, ctx, _ = setup
    rng = random.Random(1)
    batches = [[key(rng.randrange(ENTRIES)) for _ in range(BATCH)] for _ in range(64)]
    it = iter(range(10**9))
    run(
        benchmark,
        setup,
        f"touch({BATCH})",
        BATCH,
        lambda: policy.touch(batches[next(it) % 64], ctx),
    )


def test_on_request_finished(benchmark: Any, setup: tuple) -> None:
    from vllm.v1.kv_offload.base import ReqContext

    _, _, policy, _, _ = setup
    rng = random.Random(2)
    requests = []
    for r in range(64):
        start = rng.randrange(ENTRIES - BATCH)
        keys = [key(start + j) for j in range(BATCH)]
        ctx = ReqContext(req_id=f"r{r}")
        for j, k in enumerate(keys):
            ctx.set_offload_key_position(k, 16 * (j + 1))
        reused = set(keys[: BATCH // 2])
        requests.append(((tuple(keys),), set(keys) - reused, reused, ctx))
    it = iter(range(10**9))
    run(
        benchmark,
        setup,
        f"on_request_finished({BATCH})",
        BATCH,
        lambda: policy.on_request_finished(*requests[next(it) % 64]),
    )


def test_evict_and_reinsert(benchmark: Any, setup: tuple) -> None:
    """evict(32), then store 32 new keys in the evicted chunk objects (as the manager reuses
    chunk slots); chunk construction stays out of the timing."""
    _, _, policy, ctx, _ = setup
    counter = iter(range(ENTRIES, 10**9))

    def evict_reinsert() -> None:
        evicted = policy.evict(EVICT, set())
        assert evicted is not None
        assert len(evicted) == EVICT
        for _, chunk in evicted:
            chunk.ref_cnt = -1
            store(policy, key(next(counter)), chunk, ctx)

    run(benchmark, setup, f"evict({EVICT})+reinsert", EVICT, evict_reinsert)


def test_evict(benchmark: Any, setup: tuple) -> None:
    """evict(32) alone: the batch operation (reinsertion happens between rounds, untimed)."""
    impl, kind, policy, ctx, _ = setup
    counter = iter(range(2 * 10**9, 3 * 10**9))
    evicted: list[Any] = []

    def reinsert() -> tuple[tuple, dict]:
        for _, chunk in evicted:
            chunk.ref_cnt = -1
            store(policy, key(next(counter)), chunk, ctx)
        evicted.clear()
        return (), {}

    def evict() -> None:
        out = policy.evict(EVICT, set())
        assert out is not None
        assert len(out) == EVICT
        evicted.extend(out)

    benchmark.group = f"{kind} evict({EVICT})"
    benchmark.extra_info.update(impl=impl, kind=kind, op=f"evict({EVICT})", keys_per_call=EVICT)
    benchmark.pedantic(evict, setup=reinsert, rounds=200, warmup_rounds=5)
    reinsert()
