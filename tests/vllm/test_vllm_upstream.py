"""vLLM's own KV-offloading tests, run against kvcache's manager and primary tier.

The tests come from the installed vLLM release's source release (0.34.0 or 0.33.0;
``tests/support/vllm_upstream.py`` fetches it, pinned by SHA-256): ``tests/v1/kv_offload/`` (the CPU
manager with LRU and ARC, the policy factory, the specs, the shared host region, the tiering
manager, the ``example``, ``fs``, ``obj`` and ``p2p`` tiers with their transports mocked,
backpressure, the lookup and poll threads), less the files that need a GPU:
``cpu/test_gpu_worker.py`` (vLLM's worker, CUDA) and 0.34.0's
``tiering/test_p2p_lifecycle_e2e.py`` (serves a model).
``tests/support/upstream_swap_plugin.py`` swaps the manager and the primary tier under them.

Every test that passes on vLLM's classes must pass on kvcache's, except ``EXPECTED``: each
entry says why it cannot, and the words its failure must show, so a test that starts
failing for another reason (or starts passing) fails here. A test that passes on vLLM and
fails on kvcache outside that list is run again, alone, on both, before it counts as a
difference: some of vLLM's p2p tests wait on real sockets for a few seconds and can time out
on a loaded two-core machine, whichever manager is under them. The negative control puts a
manager and a primary tier with deliberate defects under the same tests, which must catch
both.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import vllm_upstream
from tests.support.oracle import oracle_semantics, require_oracle

pytestmark = pytest.mark.oracle

OFFLOAD = "tests/v1/kv_offload"
SELECTION = [
    OFFLOAD,
    "--ignore",
    f"{OFFLOAD}/cpu/test_gpu_worker.py",
    "--ignore",
    f"{OFFLOAD}/tiering/test_p2p_lifecycle_e2e.py",
]
MANAGER = f"{OFFLOAD}/cpu/test_manager.py"
ARC = f"{MANAGER}::TestARCPolicy"
TIERING = f"{OFFLOAD}/tiering/test_tiering_offloading.py::TestTieringOffloadingManager"
FACTORY = f"{OFFLOAD}/cpu/policies/test_factory.py::TestCachePolicyFactory"

# Why each of these cannot pass on kvcache's side, and the words its failure must show.
WRITES_INTERNALS = "sets or replaces a private attribute of vLLM's policy object"
PATCHES_INTERNALS = "patches a private method of vLLM's manager or policy to inject a fault"
CALLS_POLICY = "calls vLLM's policy object directly, below the manager"
FALL_BACK_ARC = [
    f"{ARC}::test_store_falls_back_to_t1_when_t2_cannot_satisfy_eviction[{case}]"
    for case in (
        "pinned0-protected0-new_keys0-expected_evicted0",
        "pinned1-protected1-new_keys1-expected_evicted1",
        "pinned2-protected2-new_keys2-expected_evicted2",
        "pinned3-protected3-new_keys3-expected_evicted3",
        "pinned4-protected4-new_keys4-expected_evicted4",
        "pinned5-protected5-new_keys5-None",
    )
]
POLICY_ONLY = (
    "kvcache's manager runs its Rust policies only; kvcache's spec gives a custom Python "
    "policy to vLLM's own manager"
)
BOTH: dict[str, tuple[str, tuple[str, ...]]] = {
    f"{FACTORY}::test_register_and_resolve_custom_policy": (
        POLICY_ONLY,
        ("InvalidArgumentError", "unsupported cache policy"),
    ),
    f"{FACTORY}::test_manager_resolves_policy_via_module_path": (
        POLICY_ONLY,
        ("InvalidArgumentError", "unsupported cache policy"),
    ),
    f"{OFFLOAD}/tiering/test_tier_poll_thread.py::test_lock_defaults_to_no_op": (
        "pins vLLM's no-op default lock by entering it twice; kvcache's manager returns a real "
        "threading.Lock, as vLLM's contract allows (skipped by the plugin: it would hang)",
        ("real threading.Lock",),
    ),
    f"{ARC}::test_batch_eviction_falls_back_after_t1_iterator_exhausted": (
        WRITES_INTERNALS,
        ("target_t1_size", "has no setter"),
    ),
    f"{ARC}::test_batch_eviction_scans_t1_and_t2_once": (
        WRITES_INTERNALS,
        ("target_t1_size", "has no setter"),
    ),
    f"{ARC}::test_t1_t2_eviction_policy": (WRITES_INTERNALS, ("target_t1_size", "has no setter")),
    f"{MANAGER}::test_lru_repeated_pin_cycles_compact_lazy_heap_entries": (
        WRITES_INTERNALS,
        ("has no attribute '_heap'",),
    ),
    f"{ARC}::test_batch_eviction_failure_is_atomic": (CALLS_POLICY, ("no attribute 'evict'",)),
    f"{MANAGER}::test_lru_batch_eviction_failure_is_atomic": (
        CALLS_POLICY,
        ("no attribute 'evict'",),
    ),
    f"{MANAGER}::test_evictable_cache_chunk_count": (CALLS_POLICY, ("no attribute 'evict'",)),
    f"{MANAGER}::test_cpu_manager_reports_allocation_size_on_allocation_failure": (
        PATCHES_INTERNALS,
        ("no attribute '_allocate_chunks'",),
    ),
    f"{MANAGER}::test_failed_store_records_access_once_and_uses_store_miss_hook": (
        PATCHES_INTERNALS,
        ("no attribute '_record_request_cache_access'",),
    ),
    f"{MANAGER}::test_request_finish_forwards_grouped_deduplicated_accesses": (
        PATCHES_INTERNALS,
        ("no attribute 'on_request_finished'",),
    ),
}
# Why each test that passes on vLLM's side cannot pass on kvcache's, and the words its
# failure must show, by release.
EXPECTED: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "0.34": {
        **BOTH,
        f"{TIERING}::test_defer_write_release_asserts_on_non_pending_key": (
            "vLLM's primary tier checks this with `assert` (AssertionError, or nothing under "
            "`python -O`); kvcache's raises InvalidStateError with the same words, nothing "
            "changed",
            ("InvalidStateError", "is not a pending write"),
        ),
        **{node: (PATCHES_INTERNALS, ("no attribute 'on_store_miss'",)) for node in FALL_BACK_ARC},
    },
    "0.33": {
        **BOTH,
        f"{MANAGER}::test_touch_forwards_req_context_to_policy": (
            PATCHES_INTERNALS,
            ("no attribute 'touch'",),
        ),
        **{node: (WRITES_INTERNALS, ("'t1'", "has no setter")) for node in FALL_BACK_ARC},
    },
}


@pytest.fixture(scope="module")
def release() -> str:
    require_oracle()
    return oracle_semantics()


@pytest.fixture(scope="module")
def upstream(release: str) -> Path:
    return vllm_upstream.tests_root(release)


def passed(records: dict[str, dict]) -> set[str]:
    return {node for node, record in records.items() if record["outcome"] == "passed"}


def test_vllms_offloading_tests_pass_on_kvcaches_manager(
    release: str, upstream: Path, tmp_path: Path
) -> None:
    theirs = vllm_upstream.run(upstream, "vllm", SELECTION, tmp_path / "vllm.jsonl")
    ours = vllm_upstream.run(upstream, "kvcache", SELECTION, tmp_path / "kvcache.jsonl")
    assert set(ours) == set(theirs), "the two runs ran different tests"
    hung = [node for node, record in ours.items() if record["outcome"] == "hung"]
    assert not hung, f"hung on kvcache's side: {hung}"

    # The swap really happened: where both sides passed, the same tests built a manager or a
    # primary tier, and many did.
    both = passed(theirs) & passed(ours)
    built = {node for node in both if ours[node]["built"]}
    assert built == {node for node in both if theirs[node]["built"]}
    assert len(built) >= 100, f"only {len(built)} of vLLM's tests built kvcache's classes"
    assert len(passed(theirs)) >= 800, "vLLM's own suite did not run as expected"

    expected = EXPECTED[release]
    suspects = sorted(passed(theirs) - passed(ours) - set(expected))
    if suspects:
        again_theirs = vllm_upstream.run(upstream, "vllm", suspects, tmp_path / "v-again.jsonl")
        again_ours = vllm_upstream.run(upstream, "kvcache", suspects, tmp_path / "k-again.jsonl")
        differences = sorted(passed(again_theirs) - passed(again_ours))
        assert not differences, "\n\n".join(
            f"{node}:\n{again_ours[node]['longrepr']}" for node in differences
        )

    for node, (why, words) in expected.items():
        assert node in passed(theirs), f"{node} no longer passes on vLLM's side"
        assert node not in passed(ours), f"{node} now passes on kvcache's: drop it ({why})"
        text = ours[node]["longrepr"]
        assert all(word in text for word in words), f"{node} ({why}) failed otherwise:\n{text}"


def test_vllms_offloading_tests_catch_a_defective_manager_and_primary_tier(
    release: str, upstream: Path, tmp_path: Path
) -> None:
    selection = [MANAGER, f"{OFFLOAD}/tiering/test_tiering_offloading.py"]
    sound = vllm_upstream.run(upstream, "kvcache", selection, tmp_path / "kvcache.jsonl")
    broken = vllm_upstream.run(upstream, "broken", selection, tmp_path / "broken.jsonl")
    caught = passed(sound) - passed(broken)
    assert any(node.startswith(MANAGER) for node in caught), sorted(caught)
    if release == "0.34":  # 0.33 has no deferred release to get wrong
        assert f"{TIERING}::test_deferred_release_misses_but_holds_chunks_until_released" in caught


LEAKS_A_WORKER = """
import multiprocessing as mp
import os


def _wait(queue):
    queue.get()  # nobody puts: waits for ever


def test_leaves_a_waiting_worker():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    worker = ctx.Process(target=_wait, args=(queue,))
    worker.start()
    with open(os.environ["LEAK_PID_FILE"], "w") as out:
        out.write(str(worker.pid))
    raise AssertionError("gave up on its worker, as a test that timed out does")
"""


def test_a_worker_a_failed_test_leaves_behind_does_not_hold_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test of vLLM's that fails half-way can leave a spawned worker waiting for ever, and
    Python joins workers at exit: the run must still end (well within the timeout that only
    bounds a hang) with the test's record, and the worker must be gone."""
    (tmp_path / "test_leak.py").write_text(LEAKS_A_WORKER)
    pid_file = tmp_path / "worker.pid"
    monkeypatch.setenv("LEAK_PID_FILE", str(pid_file))
    records = vllm_upstream.run(
        tmp_path, "vllm", ["test_leak.py"], tmp_path / "r.jsonl", timeout=300
    )
    (record,) = records.values()
    assert record["outcome"] == "failed"
    assert "gave up on its worker" in record["longrepr"]
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
