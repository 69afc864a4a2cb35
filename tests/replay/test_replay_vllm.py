"""Replays through vLLM 0.33.0's manager: counters, the null baseline, the decision comparison.

The comparison is only worth something if it can fail, so most of this file plants a single,
deliberate divergence in an otherwise faithful vLLM manager and checks that it is reported at
the right request and field.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from kvcache.replay import (
    Backend,
    ConfigError,
    ReplayOptions,
    SyntheticChat,
    Workload,
    compare_backends,
    kvcache_backend,
    parse_capacities,
    replay,
    run_grid,
    rust_policies_backend,
    synthetic_chat,
    time_backend,
    vllm_backend,
)

pytestmark = pytest.mark.oracle

WORKLOAD = SyntheticChat(requests=160, seed=3, active_conversations=12, mean_turns=4.0)


@pytest.fixture(scope="module")
def vllm() -> Backend:
    return vllm_backend()


@pytest.fixture(scope="module")
def wl() -> Workload:
    return synthetic_chat(WORKLOAD)


def capacities(wl: Workload) -> list[int]:
    # From below the longest request (failed prepares) to everything fits.
    return [
        wl.max_request_keys // 2,
        wl.unique_blocks // 10,
        wl.unique_blocks // 3,
        wl.unique_blocks,
    ]


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("fail_store_every", [0, 4])
def test_counters_are_consistent(
    vllm: Backend, wl: Workload, policy: str, fail_store_every: int
) -> None:
    for num_chunks in capacities(wl):
        run = replay(
            vllm,
            wl,
            policy=policy,
            num_chunks=num_chunks,
            options=ReplayOptions(fail_store_every=fail_store_every),
        )
        assert run.lookups == wl.key_visits
        assert run.hits + run.misses == run.lookups
        assert 0 <= run.hits <= run.lookups
        assert 0.0 <= run.hit_ratio <= 1.0
        incomplete = sum(
            1
            for keys, (n_hit, *_) in zip(wl.requests, run.script, strict=True)
            if n_hit < len(keys)
        )
        assert sum(run.stops.values()) == incomplete
        assert set(run.stops) <= {"MISS", "HIT_PENDING"}
        # Everything completed at the end: what was stored and not evicted or failed is resident.
        resident = run.stored - run.evicted - run.failed_store_keys
        assert 0 <= resident <= num_chunks
        assert run.failed_stores == (run.store_jobs // fail_store_every if fail_store_every else 0)
        if num_chunks >= wl.unique_blocks and not fail_store_every:
            # Room for everything: each block is stored exactly once and never evicted.
            assert (run.evicted, run.failed_prepares) == (0, 0)
            assert run.stored == wl.unique_blocks
        if num_chunks < wl.max_request_keys:
            assert run.failed_prepares > 0


def test_small_capacity_evicts(vllm: Backend, wl: Workload) -> None:
    run = replay(vllm, wl, policy="lru", num_chunks=wl.unique_blocks // 10)
    assert run.evicted > 0
    assert run.hits > 0


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize(("lag", "fail_store_every"), [(8, 0), (0, 3), (2, 5)])
def test_vllm_matches_itself(
    vllm: Backend, wl: Workload, policy: str, lag: int, fail_store_every: int
) -> None:
    for num_chunks in capacities(wl):
        result = compare_backends(
            vllm,
            vllm,
            wl,
            policy=policy,
            num_chunks=num_chunks,
            options=ReplayOptions(lag=lag, fail_store_every=fail_store_every),
        )
        assert result.matched, result.divergence
        assert result.steps == len(wl.requests) + 1  # every request and the final drain


# --- planted divergences -------------------------------------------------------------------


class _ReverseOneEviction:
    """Policy proxy: the ``at``-th eviction of two or more chunks returns its victims reversed.

    A real decision change (the manager frees the chunks in that order, so later chunk ids move),
    of the subtle kind a set-based comparison would miss.
    """

    def __init__(self, policy: Any, state: dict[str, Any], at: int) -> None:
        self._policy = policy
        self._state = state
        self._at = at

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def evict(self, n: int, protected: set[bytes]) -> Any:
        victims = self._policy.evict(n, protected)
        if victims is not None and len(victims) >= 2:
            self._state["evictions"] += 1
            if self._state["evictions"] == self._at:
                self._state["perturbed_at"] = self._state["request"]
                return list(reversed(victims))
        return victims


class _Perturbing:
    """Proxy around vLLM's manager: tells one lie of the given ``kind``, at its ``at``-th chance."""

    def __init__(self, inner: Any, kind: str, at: int, state: dict[str, Any], hit: Any) -> None:
        self._inner = inner
        self._kind = kind
        self._at = at
        self._state = state
        self._hit = hit
        self._chances = 0
        if kind == "eviction-order":
            inner._policy = _ReverseOneEviction(inner._policy, state, at)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _chance(self) -> bool:
        self._chances += 1
        if self._chances == self._at:
            self._state["perturbed_at"] = self._state["request"]
            return True
        return False

    def on_new_request(self, ctx: Any) -> Any:
        self._state["request"] += 1
        return self._inner.on_new_request(ctx)

    def lookup(self, key: bytes, ctx: Any) -> Any:
        result = self._inner.lookup(key, ctx)
        if self._kind == "lookup" and result == self._hit and self._chance():
            return type(result).MISS
        return result

    def prepare_store(self, keys: Any, ctx: Any) -> Any:
        out = self._inner.prepare_store(keys, ctx)
        if self._kind == "chunk-id" and out is not None and out.keys_to_store and self._chance():
            ids = list(out.store_spec.block_ids)
            ids[-1] += 1
            out = dataclasses.replace(out, store_spec=SimpleNamespace(block_ids=ids))
        return out

    def take_events(self) -> Any:
        events = list(self._inner.take_events())
        if self._kind == "event" and events and self._chance():
            events.pop()
        return events


def perturbed(vllm: Backend, kind: str, at: int) -> tuple[Backend, dict[str, Any]]:
    state: dict[str, Any] = {"request": -1, "evictions": 0, "perturbed_at": None}

    def make(
        num_chunks: int, policy: str, *, enable_events: bool = False, store_threshold: int = 1
    ) -> _Perturbing:
        inner = vllm.make(num_chunks, policy, enable_events=enable_events)
        return _Perturbing(inner, kind, at, state, vllm.hit)

    backend = Backend(name="planted", make=make, hit=vllm.hit, req_context=vllm.req_context)
    return backend, state


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize(
    ("kind", "at", "field"),
    [
        ("eviction-order", 3, "evicted_keys"),
        ("lookup", 25, "hits"),
        ("chunk-id", 10, "block_ids"),
        ("event", 7, "events"),
    ],
)
def test_planted_divergence_is_detected(
    vllm: Backend, wl: Workload, policy: str, kind: str, at: int, field: str
) -> None:
    planted, state = perturbed(vllm, kind, at)
    result = compare_backends(vllm, planted, wl, policy=policy, num_chunks=wl.unique_blocks // 10)
    assert state["perturbed_at"] is not None, "the perturbation never fired; test is vacuous"
    assert not result.matched
    assert result.steps == state["perturbed_at"]
    assert result.divergence is not None
    assert result.divergence.startswith(f"request {state['perturbed_at']}: {field} differ")


def test_unperturbed_proxy_matches(vllm: Backend, wl: Workload) -> None:
    """Control for the test above: the proxy itself, telling no lie, changes nothing."""
    planted, state = perturbed(vllm, "none", 1)
    result = compare_backends(vllm, planted, wl, policy="lru", num_chunks=wl.unique_blocks // 10)
    assert result.matched, result.divergence
    assert state["perturbed_at"] is None


# --- timing and the grid ---------------------------------------------------------------------


def test_null_baseline_follows_the_real_run(vllm: Backend, wl: Workload) -> None:
    run, timing = time_backend(vllm, wl, policy="arc", num_chunks=wl.unique_blocks // 10, repeat=2)
    reference = replay(vllm, wl, policy="arc", num_chunks=wl.unique_blocks // 10)
    assert run.counters() == reference.counters()
    assert timing.lookups == wl.key_visits
    assert timing.manager_ns > 0
    assert timing.null_ns > 0
    assert timing.ns_per_visit == (timing.manager_ns - timing.null_ns) / wl.key_visits


def test_events_do_not_change_decisions(vllm: Backend, wl: Workload) -> None:
    quiet = replay(vllm, wl, policy="lru", num_chunks=wl.unique_blocks // 10)
    run, _ = time_backend(
        vllm,
        wl,
        policy="lru",
        num_chunks=wl.unique_blocks // 10,
        options=ReplayOptions(drain_events=True),
    )
    assert run.counters() == quiet.counters()


def test_grid_with_reference(vllm: Backend, wl: Workload) -> None:
    rows = run_grid(
        wl,
        vllm,
        policies=["lru", "arc"],
        capacities=parse_capacities("10%,60"),
        reference=vllm,
    )
    assert [(r.run.policy, r.capacity_spec) for r in rows] == [
        ("lru", "10%"),
        ("lru", "60"),
        ("arc", "10%"),
        ("arc", "60"),
    ]
    for row in rows:
        assert row.comparison is not None
        assert row.comparison.matched
        as_dict = row.as_dict()
        assert as_dict["matched"] is True
        assert "speedup" in as_dict
        assert "vllm_ns_per_visit" in as_dict
    assert rows[0].run.num_chunks == round(0.1 * wl.unique_blocks)
    assert rows[1].run.num_chunks == 60


# --- the kvcache backend ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("fail_store_every", [0, 3])
def test_kvcache_backend_matches_vllm(
    vllm: Backend, wl: Workload, policy: str, fail_store_every: int
) -> None:
    ours = kvcache_backend()
    for num_chunks in capacities(wl):
        result = compare_backends(
            vllm,
            ours,
            wl,
            policy=policy,
            num_chunks=num_chunks,
            options=ReplayOptions(fail_store_every=fail_store_every),
        )
        assert result.matched, result.divergence


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_re_offers_under_a_threshold_match_vllm_and_tell_the_releases_apart(
    vllm: Backend, wl: Workload, policy: str
) -> None:
    """With store_threshold 2, re-offered stores (retries, preemptions) are where vLLM 0.33 and
    0.34 differ: ours at the installed release's semantics matches vLLM decision for decision,
    and ours at the other release's does not."""
    options = ReplayOptions(store_threshold=2, preempt_every=3, lag=4)
    num_chunks = wl.unique_blocks // 2
    same = compare_backends(
        vllm, kvcache_backend(vllm.semantics), wl, policy=policy, num_chunks=num_chunks,
        options=options,
    )  # fmt: skip
    assert same.matched, same.divergence
    other = {"0.33": "0.34", "0.34": "0.33"}[vllm.semantics]
    differs = compare_backends(
        vllm, kvcache_backend(other), wl, policy=policy, num_chunks=num_chunks, options=options
    )
    assert not differs.matched


def test_vllms_manager_runs_only_the_installed_semantics(vllm: Backend) -> None:
    other = {"0.33": "0.34", "0.34": "0.33"}[vllm.semantics]
    with pytest.raises(ConfigError, match="--backend kvcache only"):
        vllm_backend(other)
    with pytest.raises(ConfigError, match="--backend kvcache only"):
        rust_policies_backend(other)
    assert vllm_backend(vllm.semantics).semantics == vllm.semantics


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_rust_policies_backend_matches_vllm(policy: str, vllm: Backend, wl: Workload) -> None:
    """vLLM's manager loading our Rust policies by name decides exactly as with its own."""
    backend = rust_policies_backend()
    assert backend.name == "vllm-rust-policies"
    result = compare_backends(vllm, backend, wl, policy=policy, num_chunks=wl.unique_blocks // 10)
    assert result.matched, result.divergence
