"""vLLM 0.33.0's own CPUOffloadingManager, loading our policies by name, decides exactly as with
its built-in policies: the same hits, stores, chunk ids, evictions, events and usage figures on
a multi-turn workload with failed stores, split stores, several KV groups and cache resets."""

from __future__ import annotations

import pytest

from tests.support.manager_driver import (
    REPLAY_CASE_NAMES,
    REPLAY_CASES,
    DriverOptions,
    assert_same_decisions,
    drive,
    multi_turn_workload,
    replay_both,
)
from tests.support.oracle import require_oracle

pytestmark = pytest.mark.oracle

#: The policies vLLM ships too (kvcache's turn policy has no vLLM counterpart: it is compared
#: in vLLM's manager against kvcache's manager, in test_manager_conformance.py).
OUR_CLASS = {"lru": "LRUCachePolicy", "arc": "ARCCachePolicy"}


def run(
    policy: str, ours: bool, num_chunks: int, options: DriverOptions, *, threshold: int, seed: int
) -> list[tuple]:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    manager = CPUOffloadingManager(
        num_chunks=num_chunks,
        cache_policy=OUR_CLASS[policy] if ours else policy,
        cache_policy_module_path="kvcache.vllm" if ours else None,
        enable_events=True,
        store_threshold=threshold,
        max_tracker_size=64,
    )
    if ours:
        import kvcache

        assert isinstance(manager._policy, kvcache.BaseCachePolicy)
    requests = multi_turn_workload(seed, conversations=60)
    return drive(manager, LookupResult.HIT, lambda rid: ReqContext(req_id=rid), requests, options)


@pytest.mark.parametrize(REPLAY_CASE_NAMES, [case for case in REPLAY_CASES if case[0] in OUR_CLASS])
def test_vllm_manager_decides_identically_with_our_policy(
    policy: str, num_chunks: int, fail_every: int, groups: int, threshold: int
) -> None:
    require_oracle()
    ref, ours = replay_both(run, policy, num_chunks, fail_every, groups, threshold)
    # The workload must exercise what it claims to.
    assert any(e[0] == "lookup" and "HIT" in e[2] for e in ref)
    assert any(e[0] == "store" and e[2] is not None and e[-1] for e in ref) or num_chunks > 90
    assert_same_decisions(ref, ours)
