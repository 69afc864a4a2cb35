"""Replay semantics, checked call by call against a recording fake manager (no vLLM needed)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.replay import (
    Backend,
    ConfigError,
    NullManager,
    ReplayOptions,
    Workload,
    grid_runs,
    make_key,
    null_backend,
    parse_capacities,
    replay,
    run_grid,
    time_backend,
    time_backends,
)
from kvcache.replay.driver import NOT_CALLED
from tests.support.fake_manager import FakeContext, FakeManager


def key(i: int) -> bytes:
    return make_key(i.to_bytes(32, "big"))


def fake_backend(manager: FakeManager) -> Backend:
    return Backend(
        name="fake",
        make=lambda num_chunks, policy, *, enable_events=False, store_threshold=1: manager,
        hit="HIT",
        req_context=FakeContext,
    )


def fake_backend_factory(name: str) -> Backend:
    """A backend that builds a fresh FakeManager for every replay."""
    return Backend(
        name=name,
        make=lambda num_chunks, policy, *, enable_events=False, store_threshold=1: FakeManager(),
        hit="HIT",
        req_context=FakeContext,
    )


def workload(*requests: list[int], block_tokens: int = 4) -> Workload:
    return Workload.from_requests(
        "t", [[key(i) for i in r] for r in requests], block_tokens=block_tokens
    )


def test_call_sequence_with_lag_1() -> None:
    mgr = FakeManager()
    wl = workload([1, 2], [1, 2, 3], [1, 2, 3, 4])
    run = replay(fake_backend(mgr), wl, policy="lru", num_chunks=10, options=ReplayOptions(lag=1))
    k1, k2, k3, k4 = key(1), key(2), key(3), key(4)
    assert mgr.calls == [
        ("new", "r0"),
        ("lookup", "r0", k1, 4),  # stops at the first non-hit
        ("store", "r0", (k1, k2)),
        ("new", "r1"),
        ("lookup", "r1", k1, 4),  # r0's store has not completed yet
        ("store", "r1", (k1, k2, k3)),
        # one later request issued: r0 completes
        ("store_done", "r0", (k1, k2), True),
        ("finished", "r0"),
        ("new", "r2"),
        ("lookup", "r2", k1, 4),
        ("lookup", "r2", k2, 8),
        ("lookup", "r2", k3, 12),
        ("load", "r2", (k1, k2)),
        ("store", "r2", (k3, k4)),
        ("store_done", "r1", (k3,), True),
        ("finished", "r1"),
        # the final drain
        ("load_done", "r2", (k1, k2)),
        ("store_done", "r2", (k4,), True),
        ("finished", "r2"),
    ]
    assert run.lookups == 9  # every key of every request, looked up or not
    assert run.hits == 2
    assert run.misses == 7
    assert run.stored == 4
    assert run.stops == {"HIT_PENDING": 2, "MISS": 1}
    assert run.store_jobs == 3


def test_lag_0_completes_immediately_and_full_hits_skip_prepare_store() -> None:
    mgr = FakeManager()
    wl = workload([1, 2], [1, 2])
    run = replay(fake_backend(mgr), wl, policy="lru", num_chunks=10, options=ReplayOptions(lag=0))
    assert [c[0] for c in mgr.calls] == [
        "new", "lookup", "store", "store_done", "finished",
        "new", "lookup", "lookup", "load", "load_done", "finished",
    ]  # fmt: skip
    assert run.hits == 2
    assert run.script[1] == (2, None, NOT_CALLED, ())


def test_default_lag_is_8() -> None:
    mgr = FakeManager()
    wl = workload(*([i] for i in range(12)))
    replay(fake_backend(mgr), wl, policy="lru", num_chunks=100)
    order = [c[1] for c in mgr.calls if c[0] in ("new", "finished")]
    assert order.index("r0") < order.index("r8")
    # r0 finishes right after r8 is issued, before r9 is.
    finished_r0 = mgr.calls.index(("finished", "r0"))
    assert mgr.calls.index(("new", "r8")) < finished_r0 < mgr.calls.index(("new", "r9"))


def test_failed_prepare_and_failed_stores() -> None:
    mgr = FakeManager(fail_prepare={"r1"})
    wl = workload([1], [2], [3], [4], [5], [6])
    run = replay(
        fake_backend(mgr),
        wl,
        policy="lru",
        num_chunks=10,
        options=ReplayOptions(lag=0, fail_store_every=2),
    )
    assert run.failed_prepares == 1
    successes = [c[3] for c in mgr.calls if c[0] == "store_done"]
    # r1's prepare failed (no store job); the jobs are r0 r2 r3 r4 r5; every 2nd fails.
    assert successes == [True, False, True, False, True]
    assert (run.store_jobs, run.failed_stores, run.failed_store_keys) == (5, 2, 2)
    assert run.script[1][2] is None


def test_a_failed_prepare_is_offered_again_each_step_while_in_flight() -> None:
    """As vLLM's scheduler retries a failed store on its next steps: r0's keys are offered
    again after r1's and r2's own stores, until a prepare succeeds; the stored keys join r0's
    store jobs and complete with it."""
    mgr = FakeManager(fail_prepare_times={"r0": 2})
    wl = workload([1, 2], [3], [4], [5])
    run = replay(fake_backend(mgr), wl, policy="lru", num_chunks=10, options=ReplayOptions(lag=3))
    stores = [(c[1], c[2]) for c in mgr.calls if c[0] == "store"]
    k1, k2, k3, k4, k5 = (key(i) for i in range(1, 6))
    assert stores == [
        ("r0", (k1, k2)), ("r1", (k3,)), ("r0", (k1, k2)), ("r2", (k4,)), ("r0", (k1, k2)),
        ("r3", (k5,)),
    ]  # fmt: skip
    assert (run.failed_prepares, run.reoffers, run.stored, run.store_jobs) == (2, 2, 5, 4)
    assert ("store_done", "r0", (k1, k2), True) in mgr.calls
    assert run.script[1][3] == (None,)
    assert len(run.script[2][3]) == 1


def test_a_preempted_request_offers_all_its_keys_again_at_the_next_step() -> None:
    mgr = FakeManager()
    wl = workload([1, 2], [1, 2, 3], [4], [5])
    run = replay(
        fake_backend(mgr),
        wl,
        policy="lru",
        num_chunks=10,
        options=ReplayOptions(lag=2, preempt_every=2),
    )
    k1, k2, k3 = key(1), key(2), key(3)
    stores = [(c[1], c[2]) for c in mgr.calls if c[0] == "store"]
    # r1 (the 2nd request) is preempted; at the next step it offers every key again.
    assert stores[:3] == [("r0", (k1, k2)), ("r1", (k1, k2, k3)), ("r2", (key(4),))]
    assert stores[3] == ("r1", (k1, k2, k3))
    # r3 (the 4th) is preempted too, but finishes before a next step re-offers it.
    assert run.reoffers == 1
    with pytest.raises(ConfigError, match="preempt-every"):
        ReplayOptions(preempt_every=-1)
    with pytest.raises(ConfigError, match="store-threshold"):
        ReplayOptions(store_threshold=-1)


def test_empty_request_counts_nothing() -> None:
    mgr = FakeManager()
    run = replay(
        fake_backend(mgr),
        workload([], [1]),
        policy="lru",
        num_chunks=10,
        options=ReplayOptions(lag=0),
    )
    assert run.lookups == 1
    assert ("new", "r0") in mgr.calls
    assert ("finished", "r0") in mgr.calls
    assert not any(c[0] == "store" and c[1] == "r0" for c in mgr.calls)


def test_bad_options_are_config_errors() -> None:
    backend = fake_backend(FakeManager())
    wl = workload([1])
    with pytest.raises(ConfigError, match="lag"):
        ReplayOptions(lag=-1)
    with pytest.raises(ConfigError, match="fail-store-every"):
        ReplayOptions(fail_store_every=-1)
    with pytest.raises(ConfigError, match="capacity"):
        replay(backend, wl, policy="lru", num_chunks=0)


def test_null_manager_reproduces_the_recorded_answers() -> None:
    wl = workload([1, 2], [1, 2, 3], [1, 2, 3, 4], [5], [1, 2, 3, 4, 5])
    mgr = FakeManager(fail_prepare={"r3"})
    options = ReplayOptions(lag=2, preempt_every=2)
    real = replay(fake_backend(mgr), wl, policy="lru", num_chunks=10, options=options)
    assert real.reoffers > 0
    null = null_backend(fake_backend(FakeManager()), wl, real.script)
    again = replay(null, wl, policy="lru", num_chunks=10, options=options)
    assert again.counters() == real.counters()
    assert again.script == real.script
    # It really is stateless: lookups are plain dict probes of the recorded answers.
    manager = null.make(10, "lru")
    assert isinstance(manager, NullManager)
    manager.on_new_request(FakeContext("r0"))
    assert manager.lookup(key(1), None) == "MISS"


def test_time_backend_pairs_real_and_null_runs() -> None:
    wl = workload([1, 2], [1, 2, 3], [1, 2, 3, 4])
    managers: list[FakeManager] = []

    def make(
        num_chunks: int, policy: str, *, enable_events: bool = False, store_threshold: int = 1
    ) -> FakeManager:
        managers.append(FakeManager())
        return managers[-1]

    backend = Backend(name="fake", make=make, hit="HIT", req_context=FakeContext)
    run, timing = time_backend(
        backend, wl, policy="lru", num_chunks=10, options=ReplayOptions(lag=1), repeat=3
    )
    assert len(managers) == 3  # one fresh manager per repeat; null runs use their own
    assert timing.repeat == 3
    assert timing.lookups == wl.key_visits
    assert timing.inside_ns == timing.manager_ns - timing.null_ns
    assert run.hits == 2


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(st.lists(st.integers(0, 12), max_size=6, unique=True), max_size=14),
    lag=st.integers(0, 5),
    fail_store_every=st.integers(0, 3),
)
def test_every_request_is_issued_and_finished_in_order(
    requests: list[list[int]], lag: int, fail_store_every: int
) -> None:
    mgr = FakeManager()
    wl = workload(*requests)
    run = replay(
        fake_backend(mgr),
        wl,
        policy="lru",
        num_chunks=10,
        options=ReplayOptions(lag=lag, fail_store_every=fail_store_every),
    )
    n = len(requests)
    ids = [f"r{i}" for i in range(n)]
    assert [c[1] for c in mgr.calls if c[0] == "new"] == ids
    assert [c[1] for c in mgr.calls if c[0] == "finished"] == ids
    position = {c: i for i, c in enumerate(mgr.calls)}
    for i in range(n):
        finished = position[("finished", f"r{i}")]
        assert finished > position[("new", f"r{i}")]
        if i + lag < n:  # finished after request i + lag was issued ...
            assert finished > position[("new", f"r{i + lag}")]
        if i + lag + 1 < n:  # ... and before the next one
            assert finished < position[("new", f"r{i + lag + 1}")]
    # Loads complete exactly what was prepared; stores exactly what prepare_store accepted.
    loads = [c[1:] for c in mgr.calls if c[0] == "load"]
    assert loads == [c[1:] for c in mgr.calls if c[0] == "load_done"]
    assert run.hits == sum(len(keys) for _, keys in loads)
    assert run.stored == sum(len(c[2]) for c in mgr.calls if c[0] == "store_done")
    assert run.hits + run.misses == run.lookups == sum(len(r) for r in requests)
    assert run.failed_stores == sum(1 for c in mgr.calls if c[0] == "store_done" and not c[3])


def test_time_backends_interleaves_repeats() -> None:
    wl = workload([1, 2], [1, 2, 3])
    order: list[str] = []

    def backend(name: str) -> Backend:
        def make(
            num_chunks: int, policy: str, *, enable_events: bool = False, store_threshold: int = 1
        ) -> FakeManager:
            order.append(name)
            return FakeManager()

        return Backend(name=name, make=make, hit="HIT", req_context=FakeContext)

    results = time_backends([backend("a"), backend("b")], wl, policy="lru", num_chunks=10, repeat=2)
    assert order == ["a", "b", "a", "b"]
    assert [run.backend for run, _ in results] == ["a", "b"]
    assert all(timing.repeat == 2 for _, timing in results)


def test_grid_warms_up_each_backend_and_policy_before_timing() -> None:
    wl = workload(*[[i, i + 1] for i in range(0, 600, 2)])  # 300 requests, 600 blocks
    made: list[tuple[str, int, FakeManager]] = []

    def backend(name: str) -> Backend:
        def make(
            num_chunks: int, policy: str, *, enable_events: bool = False, store_threshold: int = 1
        ) -> FakeManager:
            manager = FakeManager()
            made.append((policy, num_chunks, manager))
            return manager

        return Backend(name=name, make=make, hit="HIT", req_context=FakeContext)

    rows = run_grid(wl, backend("a"), policies=["lru", "arc"], capacities=parse_capacities("50%"))
    requests_seen = [sum(c[0] == "new" for c in m.calls) for _, _, m in made]
    # First the warm-up, untimed: the first 200 requests, at the grid's largest capacity (50 %
    # of the whole workload's 600 blocks); then the timed runs over all 300 requests.
    assert [(p, n) for p, n, _ in made] == [("lru", 300), ("arc", 300), ("lru", 300), ("arc", 300)]
    assert requests_seen == [200, 200, 300, 300]
    assert [r.run.requests for r in rows] == [300, 300]


@pytest.mark.parametrize("repeat", [1, 3])
@pytest.mark.parametrize("with_reference", [False, True])
def test_grid_runs_counts_every_replay_that_reports_progress(
    repeat: int, with_reference: bool
) -> None:
    wl = workload(*[[i, i + 1] for i in range(0, 40, 2)])
    labels: list[str] = []
    done: list[tuple[int, int]] = []

    def progress_for(label: str) -> Any:
        labels.append(label)
        return lambda d, t: done.append((d, t))

    rows = run_grid(
        wl,
        fake_backend_factory("a"),
        policies=["lru", "arc"],
        capacities=parse_capacities("10%,50%,100%"),
        repeat=repeat,
        reference=fake_backend_factory("ref") if with_reference else None,
        progress_for=progress_for,
    )
    assert len(rows) == 6
    assert len(labels) == grid_runs(
        policies=2, capacities=3, repeat=repeat, reference=with_reference
    )
    assert done[-1] == (len(wl.requests), len(wl.requests))  # every run reports its end


def test_options_reach_every_replay_of_the_grid() -> None:
    wl = workload(*[[i] for i in range(30)])
    made: list[FakeManager] = []

    def make(
        num_chunks: int, policy: str, *, enable_events: bool = False, store_threshold: int = 1
    ) -> FakeManager:
        made.append(FakeManager())
        return made[-1]

    backend = Backend(name="a", make=make, hit="HIT", req_context=FakeContext)
    options = ReplayOptions(lag=0, fail_store_every=2)
    rows = run_grid(
        wl, backend, policies=["lru"], capacities=parse_capacities("50%"), options=options
    )
    # Warm-up and timed run alike: lag 0 (each request finishes before the next starts) and
    # every second store job failed.
    for manager in made:
        kinds = [c[0] for c in manager.calls]
        assert kinds[:4] == ["new", "lookup", "store", "store_done"]
        successes = [c[3] for c in manager.calls if c[0] == "store_done"]
        assert successes[:4] == [True, False, True, False]
    assert rows[0].options == options
    assert rows[0].as_dict()["fail_store_every"] == 2
