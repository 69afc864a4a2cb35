"""One untimed replay through kvcache's manager, for a profiler.

Timings on a shared machine move by tens of percent; the instructions the manager executes
do not. Under callgrind, counting only inside the manager's methods (the driver's own Python
work and the interpreter's start-up are left out):

    valgrind --tool=callgrind --toggle-collect='_core::manager::PyManager::__pymethod_*' \\
        python bench/replay_once.py --policy turn --capacity 5% --hints future [--trace FILE]

then ``callgrind_annotate callgrind.out.<pid>`` (its total over the key visits printed here is
instructions per key visit). Run: ``python bench/replay_once.py [--trace FILE] [--policy P]
[--capacity C] [--hints MODE]``.
"""

from __future__ import annotations

import argparse

from kvcache.replay import (
    apply_hints,
    kvcache_backend,
    load_mooncake_trace,
    parse_capacities,
    replay,
    resolve_capacities,
    synthetic_chat,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace")
    parser.add_argument("--policy", default="turn")
    parser.add_argument("--capacity", default="5%", help="one capacity, as kvcache replay's")
    parser.add_argument("--hints", default="trace", help="a kvcache replay --hints mode")
    args = parser.parse_args()
    workload = load_mooncake_trace(args.trace) if args.trace else synthetic_chat()
    workload = apply_hints(workload, args.hints)
    (capacity,) = resolve_capacities(
        parse_capacities(args.capacity), unique_blocks=workload.unique_blocks
    )
    run = replay(kvcache_backend(), workload, policy=args.policy, num_chunks=capacity.chunks)
    print(
        f"{workload.name}, hints {workload.hint_source or 'none'}: {args.policy} at "
        f"{capacity.chunks:,} chunks, {run.lookups:,} key visits, hit ratio {run.hit_ratio:.4f}"
    )


if __name__ == "__main__":
    main()
