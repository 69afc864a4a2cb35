"""Memory per resident chunk: kvcache's manager vs vLLM 0.33.0's, same process.

For each manager and policy: fill ``N`` chunks with 36-byte keys (vLLM's OffloadKey size) through
``prepare_store`` + ``complete_store``, then keep storing new keys (evicting) until the policy's
ghosts reach their bound: ``2 N`` more for ARC (and LRU, which keeps none), ``5 N`` for the
turn policy (two full generations of 2.5 N); then report bytes per resident chunk, minus the 36
key bytes. The ``kvcache turn, hinted`` row gives every request a retention hint (``continues``
and ``ends`` in turn), so the policy also keeps its shadow sample of hinted keys (at its bound
after four capacities of stores):

- ``rss``: growth of the process's resident set (``/proc/self/statm``) from before the manager
  was built (after imports and a small warm-up fill, in a fresh process per row) to after the
  fill and ``gc.collect()``; counts everything, allocator slack included;
- ``heap`` (kvcache only): the manager's own accounting of its allocations (``memory_usage()``).

Run: ``python bench/memory_per_chunk.py [N]`` (default 200,000).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from typing import Any

KEY_BYTES = 36
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\x00\x00\x00\x00"


def fill(manager: Any, ctx_cls: Any, n: int, churn: int) -> None:
    batch = 256
    for start in range(0, n + churn, batch):
        ctx = ctx_cls("fill")
        keys = [key(i) for i in range(start, start + batch)]
        out = manager.prepare_store(keys, ctx)
        assert out is not None
        manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)


#: Stores after the fill, in units of the capacity: enough for each policy's ghosts to reach
#: their bound.
CHURN = {"lru": 2, "arc": 2, "turn": 5}


def measure(name: str, make: Any, ctx_cls: Any, n: int, churn: int) -> dict[str, Any]:
    gc.collect()
    before = rss()
    manager = make()
    fill(manager, ctx_cls, n, churn * n)
    gc.collect()
    grown = rss() - before
    row: dict[str, Any] = {"manager": name, "resident": n, "rss_per_chunk": grown / n - KEY_BYTES}
    usage = getattr(manager, "memory_usage", None)
    if usage is not None:
        u = usage()
        assert u["resident_chunks"] == n
        row["heap_per_chunk"] = u["total"] / n - KEY_BYTES
        row["heap"] = {k: u[k] / n for k in ("policy", "table", "tracker", "requests")}
        row["hinted_requests"] = manager._take_stats()[5][0]
    del manager
    gc.collect()
    return row


def hinted_context(ctx_cls: Any) -> Any:
    """A context factory whose requests carry ``continues`` and ``ends`` hints in turn."""
    from kvcache._hints import retention_params

    params = [retention_params("continues"), retention_params("ends")]
    count = 0

    def make(req_id: str) -> Any:
        nonlocal count
        count += 1
        return ctx_cls(req_id, params[count % 2])

    return make


def one(impl: str, policy: str, n: int, hinted: bool = False) -> dict[str, Any]:
    """One row, measured in this (fresh) process."""
    if impl == "kvcache":
        import kvcache

        make = lambda: kvcache.OffloadingManager(n, policy)  # noqa: E731
        ctx = hinted_context(kvcache.ReqContext) if hinted else kvcache.ReqContext
        warm = kvcache.OffloadingManager(1024, policy)
    else:
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        make = lambda: CPUOffloadingManager(n, cache_policy=policy)  # noqa: E731
        ctx = lambda rid: ReqContext(req_id=rid)  # noqa: E731
        warm = CPUOffloadingManager(1024, cache_policy=policy)
    fill(warm, ctx, 1024, 1024)  # imports and first-use allocations happen here
    del warm
    name = f"{impl} {policy}" + (", hinted" if hinted else "")
    return measure(name, make, ctx, n, CHURN[policy])


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        hinted = sys.argv[5:6] == ["hinted"]
        print(json.dumps(one(sys.argv[2], sys.argv[3], int(sys.argv[4]), hinted)))
        return
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    rows = []
    runs = [("kvcache", p, "") for p in CHURN] + [("kvcache", "turn", "hinted")]
    runs += [("vllm", "lru", ""), ("vllm", "arc", "")]
    for impl, policy, hinted in runs:
        out = subprocess.run(
            [sys.executable, __file__, "--one", impl, policy, str(n), hinted],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if hinted:
            assert rows[-1]["hinted_requests"] > 0, "the hints did not reach the manager"
    print(
        f"bytes per resident chunk beyond its {KEY_BYTES} key bytes, {n:,} chunks, after "
        "more stores until each policy's ghosts reach their bound\n"
    )
    print("| manager | RSS growth | own heap accounting |")
    print("|---|---:|---:|")
    for r in rows:
        heap = f"{r['heap_per_chunk']:.0f}" if "heap_per_chunk" in r else "-"
        print(f"| {r['manager']} | {r['rss_per_chunk']:.0f} | {heap} |")
    for r in rows:
        if "heap" in r:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["heap"].items())
            print(f"\n{r['manager']}: heap bytes per chunk by structure: {parts}", end="")
    print()


if __name__ == "__main__":
    main()
