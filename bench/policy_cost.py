"""Time inside kvcache's manager per key visit, the turn policy against LRU, in the same rounds.

`kvcache replay --policy lru,turn` times one policy after the other, so a noisy machine can
slow one and not the other. Here every repeat replays LRU, LRU's null twin, turn and turn's
null twin back to back (``kvcache.replay.time_backends``), and each keeps its fastest repeat;
the whole measurement is done ``--rounds`` times and the spread of the ratio is printed.

Run: ``python bench/policy_cost.py [--trace FILE] [--capacity 5%,10%,20%,50%] [--repeat 5]
[--rounds 3]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any

from kvcache.replay import synthetic_chat, time_backends
from kvcache.replay.backends import Backend, kvcache_backend
from kvcache.replay.capacity import parse_capacities, resolve_capacities
from kvcache.replay.trace import load_mooncake_trace

POLICIES = ("lru", "turn")


def fixed(backend: Backend, policy: str) -> Backend:
    """``backend`` always building ``policy`` (so two policies can share a timing round)."""

    def make(num_chunks: int, _policy: str, **kwargs: Any) -> Any:
        return backend.make(num_chunks, policy, **kwargs)

    return dataclasses.replace(backend, name=f"kvcache {policy}", make=make)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace")
    parser.add_argument("--capacity", default="5%,10%,20%,50%")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    workload = load_mooncake_trace(args.trace) if args.trace else synthetic_chat()
    base = kvcache_backend()
    backends = [fixed(base, p) for p in POLICIES]
    capacities = resolve_capacities(
        parse_capacities(args.capacity), unique_blocks=workload.unique_blocks
    )
    print(f"workload: {workload.name}; ns per key visit inside the manager, best of {args.repeat}")
    print("| capacity | " + " | ".join(f"{p} (rounds)" for p in POLICIES) + " | turn / lru |")
    print("|---|" + "---:|" * (len(POLICIES) + 1))
    for cap in capacities:
        per_policy: dict[str, list[float]] = {p: [] for p in POLICIES}
        ratios = []
        for _ in range(args.rounds):
            timed = time_backends(
                backends, workload, policy="lru", num_chunks=cap.chunks, repeat=args.repeat
            )
            ns = {p: t.ns_per_visit for p, (_, t) in zip(POLICIES, timed, strict=True)}
            for p in POLICIES:
                per_policy[p].append(ns[p])
            ratios.append(ns["turn"] / ns["lru"])
        cells = [", ".join(f"{x:.0f}" for x in per_policy[p]) for p in POLICIES]
        print(
            f"| {cap.spec} | " + " | ".join(cells) + f" | median {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f} to {max(ratios):.2f}) |"
        )


if __name__ == "__main__":
    main()
