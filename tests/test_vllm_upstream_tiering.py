"""vLLM 0.34.0's own tiering tests, run against kvcache's CPU primary tier.

The tests come from vLLM 0.34.0's source release (``tests/vllm_upstream.py`` fetches it,
pinned by SHA-256): ``tests/v1/kv_offload/tiering/`` whole (the tiering manager, the
``example``, ``fs``, ``obj`` and ``p2p`` tiers with their transports mocked, backpressure, the
lookup and poll threads, the spec), less ``test_p2p_lifecycle_e2e.py``, which serves a model
on a GPU. ``tests/upstream_primary_plugin.py`` swaps the primary tier under them.

Every test that passes on vLLM's own primary tier must pass on kvcache's, but one:
``EXPECTED``, where vLLM's tier asserts and kvcache's raises its typed error. A test that passes
on vLLM and fails on kvcache is run again, alone, on both, before it counts as a difference:
some of vLLM's p2p tests wait on real sockets for a few seconds and can time out on a loaded
two-core machine, whichever primary tier is under them. The negative control puts a primary
tier with a deliberate defect under the same tests, which must catch it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import vllm_upstream
from tests.conftest import oracle_semantics, require_oracle

pytestmark = pytest.mark.oracle

E2E = f"{vllm_upstream.TIERING}/test_p2p_lifecycle_e2e.py"
TIERING_MANAGER = (
    f"{vllm_upstream.TIERING}/test_tiering_offloading.py::TestTieringOffloadingManager"
)

# vLLM's primary tier checks this contract with `assert` (an AssertionError, or nothing under
# `python -O`); kvcache's raises InvalidStateError (a KvCacheError and a ValueError) with the
# same words and changes nothing. The test matches AssertionError, so it cannot pass here.
EXPECTED = {
    f"{TIERING_MANAGER}::test_defer_write_release_asserts_on_non_pending_key": (
        "InvalidStateError",
        "is not a pending write",
    ),
}


@pytest.fixture(scope="module")
def upstream() -> Path:
    require_oracle()
    if oracle_semantics() != "0.34":
        pytest.skip("tiering is vLLM 0.34's")
    return vllm_upstream.tests_root()


def run(upstream: Path, mode: str, selection: list[str], report: Path) -> dict[str, dict]:
    return vllm_upstream.run(upstream, mode, selection, report)


def passed(records: dict[str, dict]) -> set[str]:
    return {node for node, record in records.items() if record["outcome"] == "passed"}


def test_vllms_tiering_tests_pass_on_kvcaches_primary_tier(upstream: Path, tmp_path: Path) -> None:
    selection = [vllm_upstream.TIERING, "--ignore", E2E]
    theirs = run(upstream, "vllm", selection, tmp_path / "vllm.json")
    ours = run(upstream, "kvcache", selection, tmp_path / "kvcache.json")
    assert set(ours) == set(theirs), "the two runs collected different tests"

    # The swap really happened: the same tests built a primary tier on both sides, many of them.
    built = {node for node, record in ours.items() if record["primary_tiers"]}
    assert built == {node for node, record in theirs.items() if record["primary_tiers"]}
    assert len(built) >= 100, f"only {len(built)} of vLLM's tests built a primary tier"

    suspects = sorted(passed(theirs) - passed(ours) - set(EXPECTED))
    if suspects:
        again_theirs = run(upstream, "vllm", suspects, tmp_path / "vllm-again.json")
        again_ours = run(upstream, "kvcache", suspects, tmp_path / "kvcache-again.json")
        differences = sorted(passed(again_theirs) - passed(again_ours))
        assert not differences, "\n\n".join(
            f"{node}:\n{again_ours[node]['longrepr']}" for node in differences
        )

    for node, words in EXPECTED.items():
        assert node in passed(theirs), f"{node} no longer passes on vLLM's primary tier"
        assert ours[node]["outcome"] == "failed"
        assert all(word in ours[node]["longrepr"] for word in words), ours[node]["longrepr"]


def test_vllms_tiering_tests_catch_a_primary_tier_that_frees_chunks_early(
    upstream: Path, tmp_path: Path
) -> None:
    selection = [f"{vllm_upstream.TIERING}/test_tiering_offloading.py"]
    sound = run(upstream, "kvcache", selection, tmp_path / "kvcache.json")
    broken = run(upstream, "broken", selection, tmp_path / "broken.json")
    caught = passed(sound) - passed(broken)
    assert f"{TIERING_MANAGER}::test_deferred_release_misses_but_holds_chunks_until_released" in (
        caught
    )
