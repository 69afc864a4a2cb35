"""Where the scheduler's time goes in vLLM's tiered offloading, and what kvcache's primary
tier changes: vLLM's ``TieringOffloadingManager`` over vLLM's Python primary tier and over
kvcache's Rust one, side by side in one process, on the same workload and secondary tiers.

Every call the scheduler makes into the tiering manager is timed (the scheduler's time), and
inside it the time spent in the primary tier's methods and in the secondary tiers' methods
(each wrapped with a timer); the rest is the tiering manager's own Python. Per key visit
(a lookup, or a key offered to ``prepare_store``), best of ``--repeat`` runs. Also the hit
ratios (keys served from the primary tier, and promoted from a secondary tier) and the host
memory per resident chunk of each primary tier's bookkeeping (tracemalloc for vLLM's Python
objects, the Rust manager's own count for kvcache's; the chunk bytes themselves are vLLM's
shared region in both).

Run: ``python bench/tiering_cost.py [--tier fs|example] [--conversations N] [--repeat R]``
(needs vLLM 0.34.0 or 0.33.0; the figures in docs/benchmarks.md are 0.34.0's; the fs tier
writes to a temporary directory).
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.manager_driver import multi_turn_workload
from tests.tiering_driver import Options, build, drive

SCHEDULER_CALLS = (
    "lookup", "prepare_load", "complete_load", "prepare_store", "complete_store",
    "on_new_request", "on_request_finished", "on_schedule_end", "take_events", "get_stats",
    "get_load_source",
)  # fmt: skip
PRIMARY_CALLS = (
    "lookup", "prepare_load", "complete_load", "prepare_store", "complete_store",
    "prepare_read", "complete_read", "prepare_write", "complete_write", "defer_write_release",
    "release_deferred_write", "on_request_finished", "take_events", "get_stats",
    "get_load_source",
)  # fmt: skip
TIER_CALLS = (
    "lookup", "submit_store", "submit_load", "get_finished_jobs", "on_new_request",
    "on_request_finished", "on_schedule_end", "take_events", "serve_external_requests",
)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.seconds = {"scheduler": 0.0, "primary": 0.0, "tiers": 0.0}
        self.depth = {"scheduler": 0, "primary": 0, "tiers": 0}

    def wrap(self, obj: Any, names: tuple[str, ...], bucket: str) -> None:
        for name in names:
            fn = getattr(obj, name, None)
            if fn is None:
                continue

            @functools.wraps(fn)
            def timed(*a: Any, _fn: Any = fn, **kw: Any) -> Any:
                if self.depth[bucket]:
                    return _fn(*a, **kw)
                self.depth[bucket] += 1
                t0 = time.perf_counter()
                try:
                    out = _fn(*a, **kw)
                    if bucket != "scheduler" and hasattr(out, "__next__"):
                        out = list(out)  # generators run where they are consumed
                    return out
                finally:
                    self.seconds[bucket] += time.perf_counter() - t0
                    self.depth[bucket] -= 1

            setattr(obj, name, timed)


def run(side: str, tier: str, requests: list[list[int]], root: str) -> dict[str, Any]:
    tiers = [{"type": "example"}] if tier == "example" else [
        {"type": "fs", "root_dir": f"{root}/{side}", "n_read_threads": 2, "n_write_threads": 2}
    ]  # fmt: skip
    _spec, manager = build(side, tiers, cpu_bytes_to_use=256 * 4096)
    clock = Clock()
    clock.wrap(manager.primary_tier, PRIMARY_CALLS, "primary")
    for t in manager.secondary_tiers:
        clock.wrap(t, TIER_CALLS, "tiers")
    clock.wrap(manager, SCHEDULER_CALLS, "scheduler")
    try:
        log = drive(manager, requests, Options(fail_store_every=0, preempt_every=0))
    finally:
        manager.shutdown()
    visits = sum(len(e[2]) for e in log if e[0] == "lookup")
    visits += sum(len(e[2]) for e in log if e[0] == "store" and e[2] is not None)
    hits = sum(e[2].count("HIT") for e in log if e[0] == "lookup")
    promoted = sum(e[2].count("HIT_PENDING") for e in log if e[0] == "lookup")
    return {"seconds": clock.seconds, "visits": visits, "hits": hits, "promoted": promoted}


def bookkeeping_bytes(side: str, chunks: int) -> float:
    """Host bytes per resident chunk of the primary tier's bookkeeping, its cache full."""
    from tests.conftest import make_key
    from vllm.v1.kv_offload.base import ReqContext

    keys = [make_key(b, 0) for b in range(chunks)]  # the caller's, not the tier's
    gc.collect()
    tracemalloc.start()
    _spec, manager = build(side, [], cpu_bytes_to_use=chunks * 4096)
    p = manager.primary_tier
    base = tracemalloc.get_traced_memory()[0]
    # Requests of 16 chunks each, finished: what stays is per resident chunk (not a live
    # request's state, nor events waiting to be taken).
    for i in range(0, chunks, 16):
        ctx = ReqContext(req_id=f"fill-{i}")
        out = p.prepare_store(keys[i : i + 16], ctx)
        p.complete_store(out.keys_to_store, ctx, success=True)
        p.on_request_finished(ctx)
        list(p.take_events())
    del out, ctx
    gc.collect()
    p.lookup(keys[0], ReqContext(req_id="after"))  # lets kvcache release dead requests' state
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    # kvcache's manager keeps its state in Rust, which tracemalloc does not see.
    rust = p.memory_usage()["total"] if hasattr(p, "memory_usage") else 0
    manager.shutdown()
    return (used + rust) / chunks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tier", choices=["fs", "example"], default="fs")
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    requests = multi_turn_workload(args.seed, conversations=args.conversations)
    best: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.repeat):
            for side in ("vllm", "kvcache"):  # alternated: both see the same machine noise
                res = run(side, args.tier, requests, f"{root}/{r}")
                if (
                    side not in best
                    or res["seconds"]["scheduler"] < best[side]["seconds"]["scheduler"]
                ):
                    best[side] = res
    print(f"tiered offloading, {args.tier} tier, {len(requests)} requests "
          f"({best['vllm']['visits']:,} key visits), best of {args.repeat}")  # fmt: skip
    print(f"{'primary tier':<14} {'scheduler':>10} {'primary':>9} {'tiers':>8} {'tiering':>9}"
          f"  ns per key visit   hit ratio  promoted")  # fmt: skip
    for side in ("vllm", "kvcache"):
        b = best[side]
        s, v = b["seconds"], b["visits"]
        own = s["scheduler"] - s["primary"] - s["tiers"]
        print(
            f"{side:<14} {s['scheduler'] / v * 1e9:>10,.0f} {s['primary'] / v * 1e9:>9,.0f} "
            f"{s['tiers'] / v * 1e9:>8,.0f} {own / v * 1e9:>9,.0f}"
            f"                    {b['hits'] / v:>9.4f} {b['promoted'] / v:>9.4f}"
        )
    for chunks in (4096,):
        v, k = bookkeeping_bytes("vllm", chunks), bookkeeping_bytes("kvcache", chunks)
        print(f"primary-tier bookkeeping per resident chunk ({chunks} chunks): "
              f"vLLM {v:,.0f} B, kvcache {k:,.0f} B")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
