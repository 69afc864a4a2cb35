"""Time inside kvcache's manager per key visit, the turn policy against LRU, in the same rounds.

`kvcache replay --policy lru,turn` times one policy after the other, so a noisy machine can
slow one and not the other. Here every repeat replays LRU, LRU's null twin, turn and turn's
null twin back to back (``kvcache.replay.time_backends``), and each keeps its fastest repeat;
the whole measurement is done ``--rounds`` times and the spread of the ratio is printed.

``--hints MODE`` (a ``kvcache replay --hints`` mode, e.g. ``future``) adds a third column:
turn with every request carrying the hint ``MODE`` gives it, as ``kv_transfer_params``, in the
same rounds; LRU and the first turn column then replay the same requests without hints.

Run: ``python bench/policy_cost.py [--trace FILE] [--capacity 5%,10%,20%,50%] [--repeat 5]
[--rounds 3] [--hints MODE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any

from kvcache.replay import apply_hints, synthetic_chat, time_backends
from kvcache.replay.backends import Backend, kvcache_backend
from kvcache.replay.capacity import parse_capacities, resolve_capacities
from kvcache.replay.trace import load_mooncake_trace


def fixed(backend: Backend, policy: str, *, hints: bool = True) -> Backend:
    """``backend`` always building ``policy`` (so two policies can share a timing round);
    with ``hints=False`` its request contexts are built without the requests' hints."""

    def make(num_chunks: int, _policy: str, **kwargs: Any) -> Any:
        return backend.make(num_chunks, policy, **kwargs)

    make_ctx = backend.req_context

    def unhinted(req_id: str, *_params: Any) -> Any:
        return make_ctx(req_id)

    return dataclasses.replace(
        backend,
        name=f"kvcache {policy}" + (" hinted" if hints else ""),
        make=make,
        req_context=make_ctx if hints else unhinted,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace")
    parser.add_argument("--capacity", default="5%,10%,20%,50%")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hints", help="also time turn with these hints (a --hints mode)")
    args = parser.parse_args()
    workload = load_mooncake_trace(args.trace) if args.trace else synthetic_chat()
    base = kvcache_backend()
    columns = ["lru", "turn"]
    backends = [fixed(base, "lru", hints=False), fixed(base, "turn", hints=False)]
    if args.hints:
        workload = apply_hints(workload, args.hints)
        columns.append(f"turn {args.hints}")
        backends.append(fixed(base, "turn"))
    capacities = resolve_capacities(
        parse_capacities(args.capacity), unique_blocks=workload.unique_blocks
    )
    print(f"workload: {workload.name}; ns per key visit inside the manager, best of {args.repeat}")
    ratios_head = " | ".join(f"{c} / lru" for c in columns[1:])
    print("| capacity | " + " | ".join(f"{c} (rounds)" for c in columns) + f" | {ratios_head} |")
    print("|---|" + "---:|" * (2 * len(columns) - 1))
    for cap in capacities:
        per_column: dict[str, list[float]] = {c: [] for c in columns}
        for _ in range(args.rounds):
            timed = time_backends(
                backends, workload, policy="lru", num_chunks=cap.chunks, repeat=args.repeat
            )
            for c, (_, t) in zip(columns, timed, strict=True):
                per_column[c].append(t.ns_per_visit)
        cells = [", ".join(f"{x:.0f}" for x in per_column[c]) for c in columns]
        for c in columns[1:]:
            ratios = [x / y for x, y in zip(per_column[c], per_column["lru"], strict=True)]
            cells.append(
                f"median {statistics.median(ratios):.2f} ({min(ratios):.2f} to {max(ratios):.2f})"
            )
        print(f"| {cap.spec} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
