"""One-key policy calls, vLLM 0.33.0's policies vs kvcache's, in one process.

vLLM's manager calls its policy once per key for most operations (``get`` about 3.5 times per key
visit on a replay), so the cost of a single call decides how much faster vLLM's manager gets with
our policies loaded by name. Each row times N calls in a loop (vLLM's ctypes ``ChunkStatus`` and
``ReqContext`` in both, as vLLM's manager passes them) and reports ns per call:
``insert`` of N new keys, ``mark_evictable``/``mark_non_evictable`` of each, ``get`` of resident
and of absent keys, ``touch``/``on_store_miss`` of one key, ``evict(1)``.

Run: ``python bench/policy_calls.py [lru|arc ...]``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import kvcache

N = 50_000
pc = time.perf_counter_ns


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\x00\x00\x00\x00"


def per_call(fn: Callable[[], None], calls: int) -> float:
    start = pc()
    fn()
    return (pc() - start) / calls


def measure(cls: Any) -> dict[str, float]:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    policy = cls(cache_capacity=N)
    ctx = ReqContext(req_id="bench")
    chunks = [ChunkStatus(i) for i in range(N)]
    keys = [key(i) for i in range(N)]
    absent = [key(N + i) for i in range(N)]
    half = N // 2
    out: dict[str, float] = {}

    def insert() -> None:
        for k, c in zip(keys, chunks, strict=True):
            policy.insert(k, c, ctx)

    out["insert"] = per_call(insert, N)
    for c in chunks:
        c.ref_cnt = 0

    def mark_evictable() -> None:
        for k in keys:
            policy.mark_evictable(k)

    def mark_non_evictable() -> None:
        for k in keys:
            policy.mark_non_evictable(k)

    out["mark_evictable"] = per_call(mark_evictable, N)
    out["get (resident)"] = per_call(lambda: [policy.get(k) for k in keys] and None, N)
    out["get (absent)"] = per_call(lambda: [policy.get(k) for k in absent] and None, N)
    out["mark_non_evictable"] = per_call(mark_non_evictable, N)
    mark_evictable()

    def touch() -> None:
        for k in keys[:half]:
            policy.touch((k,), ctx)

    def store_miss() -> None:
        for k in absent[:half]:
            policy.on_store_miss((k,), ctx)

    def evict() -> None:
        for _ in range(N // 10):
            policy.evict(1, set())

    out["touch([key])"] = per_call(touch, half)
    out["on_store_miss([key])"] = per_call(store_miss, half)
    out["evict(1)"] = per_call(evict, N // 10)
    return out


def main() -> None:
    from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

    classes = {
        "lru": (LRUCachePolicy, kvcache.LRUCachePolicy),
        "arc": (ARCCachePolicy, kvcache.ARCCachePolicy),
    }
    print(f"ns per call, {N:,} resident chunks\n")
    print("| policy | call | vLLM 0.33.0 | kvcache | speedup |")
    print("|---|---|---:|---:|---:|")
    for name in sys.argv[1:] or ["lru", "arc"]:
        ref_cls, ours_cls = classes[name]
        ref, ours = measure(ref_cls), measure(ours_cls)
        for call, ref_ns in ref.items():
            ours_ns = ours[call]
            speedup = ref_ns / ours_ns
            print(f"| {name.upper()} | {call} | {ref_ns:,.0f} | {ours_ns:,.0f} | {speedup:.1f}x |")


if __name__ == "__main__":
    main()
