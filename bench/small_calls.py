"""Small manager calls, vLLM 0.33.0's manager vs kvcache's, in one process.

In decode, the scheduler offers a request's blocks a few at a time, so per-call costs matter as
much as per-key ones. Each manager is filled to capacity (4,096 chunks), then each round runs
one request: ``on_new_request``, ``prepare_store`` of ``k`` new keys (evicting ``k``),
``complete_store``, ``on_request_finished``. Each call is timed on its own
(``perf_counter_ns``, whose own ~80 ns is included in every figure alike); the table shows the
mean per call.

``--live N`` keeps the last N finished request contexts alive (the scheduler drops a context
soon after its request finishes; a caller that keeps many alive makes kvcache's LRU walk past
one anchor per context on each eviction).

Run: ``python bench/small_calls.py [--policy lru,arc] [--live N]``.
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

import kvcache

NUM_CHUNKS = 4096
ROUNDS = 20_000
pc = time.perf_counter_ns


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\x00\x00\x00\x00"


def fill(manager: Any, ctx_cls: Any) -> None:
    for start in range(0, NUM_CHUNKS, 64):
        ctx = ctx_cls("fill")
        out = manager.prepare_store([key(i) for i in range(start, start + 64)], ctx)
        manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)


def rounds(manager: Any, ctx_cls: Any, n_keys: int, n: int, first: int, live: int) -> list[float]:
    batches = [tuple(key(first + r * n_keys + j) for j in range(n_keys)) for r in range(n)]
    kept: collections.deque[Any] = collections.deque(maxlen=live or None)
    new_request = manager.on_new_request
    prepare_store = manager.prepare_store
    complete_store = manager.complete_store
    finished = manager.on_request_finished
    t_new = t_store = t_finish = 0
    for keys in batches:
        ctx = ctx_cls("r")
        for j, k in enumerate(keys):
            ctx.set_offload_key_position(k, 16 * (j + 1))
        a = pc()
        new_request(ctx)
        b = pc()
        out = prepare_store(keys, ctx)
        c = pc()
        complete_store(out.keys_to_store, ctx)
        d = pc()
        finished(ctx)
        e = pc()
        t_new += b - a
        t_store += c - b
        t_finish += e - d
        if live:
            kept.append(ctx)
    return [t_new / n, t_store / n, t_finish / n]


def measure(name: str, manager: Any, ctx_cls: Any, sizes: list[int], live: int) -> list[str]:
    fill(manager, ctx_cls)
    first = 1 << 40
    lines = []
    for n_keys in sizes:
        rounds(manager, ctx_cls, n_keys, ROUNDS // 10, first, live)  # warm-up
        first += ROUNDS // 10 * n_keys
        new, store, finish = rounds(manager, ctx_cls, n_keys, ROUNDS, first, live)
        first += ROUNDS * n_keys
        lines.append(f"| {name} | {n_keys} | {new:,.0f} | {store:,.0f} | {finish:,.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="lru,arc")
    parser.add_argument("--live", type=int, default=0, help="finished contexts kept alive")
    parser.add_argument("--sizes", default="1,8,32", help="keys per prepare_store")
    args = parser.parse_args()
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"ns per call, {NUM_CHUNKS} chunks, full cache, {args.live} finished contexts kept\n")
    print("| manager | keys | on_new_request | prepare_store | on_request_finished |")
    print("|---|---:|---:|---:|---:|")
    for policy in args.policy.split(","):
        rows = measure(
            f"vLLM {policy}",
            CPUOffloadingManager(NUM_CHUNKS, cache_policy=policy),
            ReqContext,
            sizes,
            args.live,
        )
        rows += measure(
            f"kvcache {policy}",
            kvcache.OffloadingManager(NUM_CHUNKS, policy),
            kvcache.ReqContext,
            sizes,
            args.live,
        )
        print("\n".join(rows))


if __name__ == "__main__":
    main()
