"""How much of vLLM's manager time is spent inside its policy: the most any faster policy can give.

vLLM 0.33.0's ``CPUOffloadingManager`` replays a synthetic workload (600 requests, capacity 25 %,
as ``bench/test_bench_manager.py``) twice per policy:

* plainly, against the null baseline, for the time inside the manager per key visit (as the
  replay CLI measures it);
* with its policy wrapped in a proxy that times every protocol call (``get``, ``insert``,
  ``mark_evictable``, ...). Each timed call also pays the proxy's own overhead, which is measured
  separately (the proxy around a no-op) and subtracted per call.

``manager's own = inside - policy``; a policy that cost nothing would make vLLM's manager at most
``inside / manager's own`` times faster. The proxy correction is approximate (a few tens of ns
per call), so read the bound to one decimal.

Run: ``python bench/policy_share.py [lru|arc ...]`` (needs vLLM, as ``make install`` sets up).
"""

from __future__ import annotations

import gc
import sys
import time
from collections import Counter
from typing import Any

from kvcache.replay import SyntheticChat, null_backend, replay, synthetic_chat, vllm_backend

METHODS = (
    "get",
    "insert",
    "remove",
    "touch",
    "on_store_miss",
    "on_request_access",
    "on_request_finished",
    "evict",
    "clear",
    "mark_evictable",
    "mark_non_evictable",
)
pc = time.perf_counter_ns
spent: Counter[str] = Counter()
calls: Counter[str] = Counter()


def _timed(name: str) -> Any:
    def call(self: TimedPolicy, *args: Any, **kwargs: Any) -> Any:
        start = pc()
        result = getattr(self.inner, name)(*args, **kwargs)
        spent[name] += pc() - start
        calls[name] += 1
        return result

    return call


class TimedPolicy:
    """Forwards the CachePolicy protocol to ``inner``, timing each call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.cache_capacity = getattr(inner, "cache_capacity", None)


for _name in METHODS:
    setattr(TimedPolicy, _name, _timed(_name))


class _NoOp:
    def get(self, key: Any) -> None:
        return None


def proxy_overhead_ns(n: int = 200_000) -> float:
    """Time the proxy adds to one call (the proxy around a no-op, minus a no-op call)."""
    plain = _NoOp()
    start = pc()
    for _ in range(n):
        plain.get(b"k")
    bare = (pc() - start) / n
    proxy = TimedPolicy(_NoOp())
    spent.clear()
    for _ in range(n):
        proxy.get(b"k")
    return spent["get"] / n - bare


def best_of(runs: int, fn: Any) -> int:
    times = []
    for _ in range(runs):
        gc.collect()
        gc.freeze()
        try:
            times.append(fn())
        finally:
            gc.unfreeze()
    return min(times)


def measure(policy: str) -> str:
    import vllm.v1.kv_offload.cpu.manager as manager_module

    workload = synthetic_chat(SyntheticChat(requests=600, seed=1))
    chunks = workload.unique_blocks // 4
    visits = workload.key_visits
    backend = vllm_backend()

    def run(b: Any) -> int:
        return replay(b, workload, policy=policy, num_chunks=chunks).elapsed_ns

    first = replay(backend, workload, policy=policy, num_chunks=chunks)
    null = null_backend(backend, workload, first.script)
    inside = (best_of(3, lambda: run(backend)) - best_of(3, lambda: run(null))) / visits

    original_init = manager_module.CPUOffloadingManager.__init__

    def wrapped_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._policy = TimedPolicy(self._policy)

    manager_module.CPUOffloadingManager.__init__ = wrapped_init
    try:

        def timed_run() -> int:
            spent.clear()
            calls.clear()
            run(backend)
            return sum(spent.values())

        policy_ns = best_of(3, timed_run)
        n_calls = sum(calls.values())
    finally:
        manager_module.CPUOffloadingManager.__init__ = original_init
    overhead = proxy_overhead_ns()
    in_policy = (policy_ns - n_calls * overhead) / visits
    own = inside - in_policy
    return (
        f"{policy}: inside vLLM's manager {inside:,.0f} ns/visit, of which its policy "
        f"{in_policy:,.0f} ({n_calls / visits:.1f} policy calls per visit; proxy overhead "
        f"{overhead:.0f} ns per call subtracted) and the manager's own {own:,.0f}: a policy "
        f"costing nothing would make it at most {inside / own:.1f}x faster"
    )


def main() -> None:
    for policy in sys.argv[1:] or ["lru", "arc"]:
        print(measure(policy))


if __name__ == "__main__":
    main()
