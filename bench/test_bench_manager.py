"""Managers side by side on a replay: vLLM 0.33.0's manager with its own policies, with our Rust
policies loaded by name, and kvcache's Rust manager. Each benchmark also times the same replay
against a do-nothing manager that repeats that run's answers (the driver's own work), so
``bench/summarize.py`` can report time inside the manager per key visit and the speedup over
vLLM. Run with ``make bench-py``.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest

from kvcache.replay import (
    SyntheticChat,
    kvcache_backend,
    null_backend,
    replay,
    rust_policies_backend,
    synthetic_chat,
    vllm_backend,
)

WORKLOAD = synthetic_chat(SyntheticChat(requests=600, seed=1))
VISITS = sum(len(r) for r in WORKLOAD.requests)
BACKENDS = {
    "vllm": vllm_backend,
    "vllm-rust-policies": rust_policies_backend,
    "kvcache": kvcache_backend,
}
ROUNDS = 5


def run(backend: Any, policy: str) -> Any:
    return replay(backend, WORKLOAD, policy=policy, num_chunks=WORKLOAD.unique_blocks // 4)


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_replay(benchmark: Any, name: str, policy: str) -> None:
    backend = BACKENDS[name]()
    gc.collect()
    gc.freeze()
    try:
        result = benchmark.pedantic(
            lambda: run(backend, policy), rounds=ROUNDS, iterations=1, warmup_rounds=1
        )
        baseline = null_backend(backend, WORKLOAD, result.script)
        times = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            run(baseline, policy)
            times.append(time.perf_counter() - start)
    finally:
        gc.unfreeze()
    benchmark.group = f"manager replay {policy}"
    benchmark.extra_info.update(
        impl=name,
        kind=policy,
        op="replay: inside the manager",
        keys_per_call=VISITS,
        baseline_s=sorted(times)[len(times) // 2],
    )
