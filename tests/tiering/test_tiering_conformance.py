"""kvcache's CPU primary tier under vLLM's tiered offloading (0.33.0 and 0.34.0), against
vLLM's own.

vLLM's ``TieringOffloadingManager`` runs twice through vLLM's spec factory: over vLLM's
``CPUPrimaryTierOffloadingManager`` (``TieringOffloadingSpec``) and over kvcache's
(``KvCacheTieringOffloadingSpec``), with the same secondary tiers: vLLM's in-memory
``example`` tier, vLLM's ``fs`` tier on a temporary directory, and an out-of-tree test tier
that fails cascades and promotions (partial promotions, whose failed chunks' release 0.34
defers until the tier lets go). The decision logs (see tests/support/tiering_driver.py) must be
identical step by step. Negative controls show that the comparison catches a primary tier
whose cascade reads never unpin (both releases) and one that frees a failed promotion's
chunks at once instead of deferring them (0.34). With retention hints on the requests, the
logs stay identical (turn reads them on both sides), and kvcache's primary tier counts every
hinted request it saw in the tiering manager's stats.
"""

from __future__ import annotations

import zlib
from collections import Counter
from typing import Any

import pytest

from tests.support.oracle import oracle_semantics, require_oracle

pytestmark = pytest.mark.oracle

EXAMPLE = {"type": "example"}
FS = {"type": "fs", "root_dir": "{root}/fs", "n_read_threads": 2, "n_write_threads": 2}
FAULTY = {"type": "FaultyTier", "module_path": "tests.support.tiering_tiers"}


def needs_tiering() -> None:
    require_oracle()


def seed_of(name: str) -> int:
    """A workload seed per case, the same in every process (``hash`` of a str is salted per
    process, so the workload, and whether it reached what a case checks, changed run to run)."""
    return zlib.crc32(name.encode()) % 1000


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize(
    ("name", "tiers"),
    [
        ("example", [EXAMPLE]),
        ("fs", [FS]),
        ("faulty", [FAULTY]),
        ("fs+faulty", [FS, FAULTY]),
    ],
)
def test_tiering_over_our_primary_tier_decides_as_over_vllms(
    name: str, tiers: list, policy: str
) -> None:
    needs_tiering()
    from tests.support.manager_driver import assert_same_decisions
    from tests.support.tiering_driver import Options, run_both

    ref, ours = run_both(tiers, Options(), seed=seed_of(name), eviction_policy=policy)
    assert_same_decisions(ref, ours)
    # The run reached what the contract is about.
    kinds = {entry[0] for entry in ref}
    assert {"lookup", "load", "store", "events", "tiers", "stats"} <= kinds
    lookups = {r for e in ref if e[0] == "lookup" for r in e[2]}
    assert "HIT" in lookups
    if name != "fs":
        # Promotions from a secondary tier: a miss in the primary tier, then pending.
        assert "HIT_PENDING" in lookups
    # Partial promotions: failed keys whose chunks 0.34 holds until the tier lets go (0.33
    # frees them at once).
    if "faulty" in name and oracle_semantics() == "0.34":
        assert any(e[0] == "primary" and e[1] > 0 for e in ref), "no release was deferred"


def test_reset_with_transfers_in_flight_decides_as_vllms() -> None:
    needs_tiering()
    from tests.support.manager_driver import assert_same_decisions
    from tests.support.tiering_driver import Options, run_both

    ref, ours = run_both([EXAMPLE, FAULTY], Options(reset_every=17), seed=7)
    assert_same_decisions(ref, ours)
    assert any(e[0] == "reset" for e in ref)


def test_the_comparison_catches_a_release_that_is_not_deferred(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Negative control: a primary tier that frees a failed promotion's chunks at once
    (instead of deferring them until the tier lets go) hands those chunk ids out again
    earlier; the logs must then differ. vLLM 0.33 has no deferred release."""
    needs_tiering()
    if oracle_semantics() != "0.34":
        pytest.skip("deferred releases are vLLM 0.34's")
    import kvcache.vllm
    from tests.support.tiering_driver import Options, run_both

    primary = kvcache.vllm.CPUPrimaryTierOffloadingManager

    def release_at_once(self, keys):  # type: ignore[no-untyped-def]
        self.complete_store(list(keys), None, success=False)
        return []

    monkeypatch.setattr(primary, "defer_write_release", release_at_once)
    ref, ours = run_both([FAULTY], Options(), seed=seed_of("faulty"), eviction_policy="lru")
    assert ref != ours


def test_the_comparison_catches_a_cascade_that_never_unpins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Negative control, both releases: a primary tier whose cascade reads never let go of
    their chunks keeps them from eviction; the logs must then differ."""
    needs_tiering()
    import kvcache.vllm
    from tests.support.tiering_driver import Options, run_both

    primary = kvcache.vllm.CPUPrimaryTierOffloadingManager
    monkeypatch.setattr(primary, "complete_read", lambda self, keys, *args, **kwargs: None)
    ref, ours = run_both([EXAMPLE], Options(), seed=seed_of("example"), eviction_policy="lru")
    assert ref != ours


def test_our_spec_falls_back_to_vllms_primary_tier_for_python_policies() -> None:
    needs_tiering()
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager

    from tests.support.tiering_driver import build

    _spec, manager = build(
        "kvcache",
        [EXAMPLE],
        eviction_policy="LRUCachePolicy",
        cache_policy_module_path="vllm.v1.kv_offload.cpu.policies.lru",
    )
    try:
        assert type(manager.primary_tier) is CPUPrimaryTierOffloadingManager
    finally:
        manager.shutdown()


def test_our_spec_builds_our_primary_tier_with_vllms_tiers() -> None:
    needs_tiering()
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    import kvcache
    import kvcache.vllm
    from tests.support.tiering_driver import build, tiering_config

    _spec, manager = build("kvcache", [EXAMPLE], eviction_policy="turn")
    try:
        assert isinstance(manager, TieringOffloadingManager)
        assert isinstance(manager.primary_tier, kvcache.vllm.CPUPrimaryTierOffloadingManager)
        assert manager.primary_tier.cache_policy == "turn"
        assert [t.tier_type for t in manager.secondary_tiers] == ["example"]
        view = manager.primary_tier.get_kv_memoryview()
        assert view.shape[0] == manager.primary_tier._num_chunks
    finally:
        manager.shutdown()
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    # The worker settings are read as by kvcache's CPU spec (tests/tiering/test_tiering_worker.py
    # runs the worker itself).
    with pytest.raises(kvcache.InvalidTypeError, match="kvcache_worker"):
        OffloadingSpecFactory.create_spec(
            tiering_config("kvcache", [EXAMPLE], kvcache_worker="yes")
        )
    # Refused when the spec is built (vLLM's spec refuses it later, from get_manager).
    with pytest.raises(kvcache.InvalidArgumentError, match="store_threshold"):
        OffloadingSpecFactory.create_spec(tiering_config("kvcache", [EXAMPLE], store_threshold=2))


def test_the_primary_tier_contract_refuses_what_vllm_asserts() -> None:
    """What vLLM's primary tier asserts (and may half-apply), ours refuses with a typed error
    and changes nothing."""
    needs_tiering()
    from vllm.v1.kv_offload.base import ReqContext

    import kvcache
    from tests.support.keys import make_key
    from tests.support.tiering_driver import build

    _spec, manager = build("kvcache", [])
    p = manager.primary_tier
    try:
        ctx = ReqContext(req_id="r")
        keys = [make_key(b, 0) for b in range(3)]
        out = p.prepare_store(keys, ctx)
        assert [int(c) for c in out.store_spec.block_ids] == [0, 1, 2]
        p.complete_store(keys[2:], ctx, success=True)
        before = p._debug_state()
        with pytest.raises(kvcache.InvalidStateError):
            p.defer_write_release(keys)  # keys[2] is ready, not a pending write
        with pytest.raises(kvcache.InvalidArgumentError):
            p.release_deferred_write([0])  # not deferred
        assert p._debug_state() == before
        assert p.defer_write_release(keys[:2]) == [0, 1]
        assert p.num_deferred_release_chunks == 2
        with pytest.raises(kvcache.InvalidStateError, match="deferred"):
            p.reset_cache()
        with pytest.raises(kvcache.InvalidArgumentError):
            p.release_deferred_write(iter(range(10**9)))  # more ids than deferred chunks
        p.release_deferred_write([1, 0])
        assert p.num_deferred_release_chunks == 0
        p.reset_cache()
        p.validate()
    finally:
        manager.shutdown()


def test_the_tiering_cost_bench_runs(tmp_path: object) -> None:
    """bench/tiering_cost.py (docs/benchmarks.md's figures) on a tiny workload, so it cannot rot."""
    needs_tiering()
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.tiering_cost",
            "--tier",
            "example",
            "--conversations",
            "4",
            "--repeat",
            "1",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("vllm ") for line in lines)
    assert any(line.startswith("kvcache ") for line in lines)
    assert "bookkeeping per resident chunk" in done.stdout


#: How each side is told to run a policy: vLLM's tiering spec loads kvcache's turn policy by
#: name (vLLM has none), kvcache's spec runs it in kvcache's primary tier.
def policy_settings(policy: str) -> dict[str, str]:
    if policy == "turn":
        return {"eviction_policy": "TurnCachePolicy", "cache_policy_module_path": "kvcache.vllm"}
    return {"eviction_policy": policy}


def watch_primary_requests(manager: Any, seen: set[str]) -> None:
    """Records the requests whose context reaches the primary tier in a call that records
    the request (where kvcache reads its hint: vLLM's tiering manager passes on no
    ``on_new_request``)."""
    primary = manager.primary_tier
    for name in ("prepare_store", "prepare_load", "prepare_write"):
        method = getattr(primary, name)

        def watched(keys: Any, req_context: Any, *args: Any, _method: Any = method) -> Any:
            seen.add(req_context.req_id)
            return _method(keys, req_context, *args)

        setattr(primary, name, watched)


@pytest.mark.parametrize("policy", ["lru", "arc", "turn"])
def test_tiering_with_hints_decides_as_over_vllms(policy: str) -> None:
    """Requests carry retention hints of every kind (tests/support/hint_cases.py). Over LRU and ARC
    both primary tiers decide as if there were none; turn reads them over vLLM's primary tier
    (kvcache's policy loaded by name) and over kvcache's alike. Only kvcache's primary tier
    counts them, and its counters reach the tiering manager's stats."""
    needs_tiering()
    from kvcache.vllm._metrics import HINTED_REQUESTS, IGNORED_HINTS
    from tests.support.manager_driver import assert_same_decisions
    from tests.support.tiering_driver import Options, run_both

    counts: dict[str, Counter[str]] = {}
    ref, ours = run_both(
        [EXAMPLE, FAULTY],
        Options(hints=True),
        seed=29,
        hint_counts=counts,
        **policy_settings(policy),
    )
    assert_same_decisions(ref, ours)
    assert not counts["vllm"]
    assert counts["kvcache"][HINTED_REQUESTS] > 0
    assert counts["kvcache"][IGNORED_HINTS] > 0


@pytest.mark.parametrize("hints", [False, True])
def test_the_primary_tier_counts_and_learns_from_every_hinted_request(hints: bool) -> None:
    """kvcache's primary tier reads each request's hint once, from the first call that
    records the request; the counts in the tiering manager's stats are exactly those of the
    requests it saw."""
    needs_tiering()
    from kvcache.vllm._metrics import HINTED_REQUESTS, IGNORED_HINTS
    from tests.support.hint_cases import tally
    from tests.support.manager_driver import multi_turn_workload
    from tests.support.tiering_driver import Options, build, drive, request_hint

    _spec, manager = build("kvcache", [EXAMPLE], eviction_policy="turn")
    try:
        seen: set[str] = set()
        watch_primary_requests(manager, seen)
        counts: Counter[str] = Counter()
        options = Options(hints=hints)
        requests = multi_turn_workload(31, conversations=options.conversations)
        drive(manager, requests, options, counts)
        kinds = [request_hint(int(req_id.split("-")[1]), options) for req_id in seen]
        hinted, ignored = tally(kinds)
        assert counts[HINTED_REQUESTS] == hinted
        assert counts[IGNORED_HINTS] == ignored
        if hints:
            assert hinted > 0
            assert ignored > 0
        else:
            assert not counts
        manager.primary_tier.validate()
    finally:
        manager.shutdown()
