"""Conformance of kvcache's manager with the installed vLLM's (0.33.0 or 0.34.0)
CPUOffloadingManager.

- Seeded random operation sequences (``tests/support/manager_differential.py``): every result and
  the whole state compared after each operation, for LRU and ARC, tight and roomy caches, one and
  two KV-cache groups, with and without ``store_threshold``; and for kvcache's turn policy,
  kvcache's manager against vLLM's manager loading ``TurnCachePolicy`` by name.
- Replays of a multi-turn workload through the scheduler-shaped driver: identical decision logs
  (lookups incl. HIT_PENDING, chunk ids, keys to store, evictions, failed prepares, events,
  stats) with failed stores, split stores, re-offered stores and cache resets.
- Negative controls: ours forced to the other release's semantics differs from the oracle where
  the releases differ (``store_threshold`` counting, events, ``touch``), so the suites can tell
  the releases apart.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from kvcache import POLICY_KINDS
from tests.support.manager_differential import ManagerPair, our_manager_class, reference_policy
from tests.support.manager_driver import (
    REPLAY_CASE_NAMES,
    REPLAY_CASES,
    DriverOptions,
    assert_same_decisions,
    drive,
    multi_turn_workload,
    replay_both,
)
from tests.support.oracle import oracle_semantics, require_oracle

pytestmark = pytest.mark.oracle

#: Every kvcache policy: vLLM's own LRU and ARC, and kvcache's turn policy as vLLM's manager
#: loads it by class name.
POLICIES = list(POLICY_KINDS)

RANDOM_OPS = int(os.environ.get("KVCACHE_MANAGER_CONFORMANCE_OPS", "40000"))


def random_pairs(
    policy: str, rng: random.Random, ops: int, *, threshold: int | None = None, hints: bool = False
) -> dict[str, int]:
    """Runs ``ops`` random operations on fresh manager pairs of random shapes (1,500 each),
    comparing the two managers after every one, their events and stats after each pair.
    ``threshold``: the store threshold (None: a random one per pair); ``hints``: requests
    carry random retention hints. Returns how often each operation ran."""
    counts: dict[str, int] = {}
    done = 0
    while done < ops:
        pair = ManagerPair(
            policy,
            num_chunks=rng.choice([1, 3, 6, 12, 24]),
            store_threshold=threshold if threshold is not None else rng.choice([1, 2]),
            max_tracker_size=rng.choice([4, 64]),
            num_blocks=rng.choice([6, 16]),
            num_groups=rng.choice([1, 2]),
            hints=hints,
        )
        for _ in range(1500):
            op = pair.random_step(rng)
            counts[op] = counts.get(op, 0) + 1
            pair.check()
            done += 1
        pair.events()
        pair.stats()
    return counts


@pytest.mark.parametrize("threshold", [1, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_seeded_random_operations_match_vllm(policy: str, threshold: int) -> None:
    require_oracle()
    rng = random.Random(f"manager-{policy}-{threshold}")
    counts = random_pairs(policy, rng, RANDOM_OPS, threshold=threshold)
    for op in ("lookup", "load", "complete_load", "store", "complete_store", "finish", "reset"):
        assert counts.get(op, 0) > 0, f"no {op} operations were generated"


def run(
    policy: str,
    ours: bool,
    num_chunks: int,
    options: DriverOptions,
    *,
    threshold: int,
    seed: int,
    our_semantics: str | None = None,
) -> list[tuple]:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as Ref

    kwargs: dict[str, Any] = dict(
        num_chunks=num_chunks, enable_events=True, store_threshold=threshold, max_tracker_size=64
    )
    if ours:
        manager = our_manager_class(our_semantics)(cache_policy=policy, **kwargs)
    else:
        manager = Ref(**kwargs, **reference_policy(policy))
    requests = multi_turn_workload(seed, conversations=60)
    return drive(manager, LookupResult.HIT, lambda rid: ReqContext(req_id=rid), requests, options)


@pytest.mark.parametrize(REPLAY_CASE_NAMES, REPLAY_CASES)
def test_workload_replay_decides_identically(
    policy: str, num_chunks: int, fail_every: int, groups: int, threshold: int
) -> None:
    require_oracle()
    ref, ours = replay_both(run, policy, num_chunks, fail_every, groups, threshold)
    assert any(e[0] == "lookup" and "HIT_PENDING" in e[2] for e in ref)
    assert_same_decisions(ref, ours)


@pytest.mark.parametrize("policy", POLICIES)
def test_positions_read_alike_whatever_the_order_and_key_objects(policy: str) -> None:
    """kvcache reads positions by walking the context's position dict alongside the keys when
    they come in recording order, as the very same objects; keys out of order, equal copies of
    the recorded objects and positions changed between calls must read exactly as vLLM's
    lookups do (the decisions and the whole state are compared after every call)."""
    require_oracle()
    pair = ManagerPair(policy, num_chunks=6, num_blocks=12)
    # Fill the cache so that later stores evict by rank.
    for blocks in ([0, 1, 2], [3, 4, 5]):
        request = pair.new_request(blocks, [0])
        pair.store(request, request.keys)
        pair.complete_store(0, True, [])
        pair.finish(request)
        pair.check()
    request = pair.new_request([6, 7, 8, 9, 10, 11], [0])
    keys = request.keys
    copies = [bytes(bytearray(k)) for k in keys]  # equal, not identical
    assert all(c == k and c is not k for c, k in zip(copies, keys, strict=True))
    pair.store(request, [keys[1], copies[0], keys[3]])  # out of order, one copy
    pair.check()
    request.ctx.set_offload_key_position(keys[3], 1)  # moved before the others
    pair.load(request, [keys[3], keys[1]])
    pair.check()
    pair.store(request, [copies[5], keys[4], keys[2]])
    pair.check()
    while pair.stores:
        pair.complete_store(0, True, [])
        pair.check()
    while pair.loads:
        pair.complete_load(0)
        pair.check()
    pair.finish(request)
    pair.check()
    later = pair.new_request([0, 1, 2, 3], [0])
    pair.store(later, later.keys)  # evicts in the order the finish above left
    pair.check()
    pair.events()


def _other_semantics() -> str:
    return {"0.33": "0.34", "0.34": "0.33"}[oracle_semantics()]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_other_releases_semantics_differ_from_the_oracle(policy: str) -> None:
    """Negative control: with ``store_threshold`` 2, a re-offered store counts again under
    vLLM 0.33 and not under 0.34; stored events differ in ``removal_expected``. Ours forced to
    the release that is not installed must therefore disagree with the oracle, both in the
    scheduler-shaped replay and in the random operations."""
    require_oracle()
    other = _other_semantics()
    options = DriverOptions(groups=1, reset_every=97)
    ref = run(policy, False, 96, options, threshold=2, seed=7)
    ours = run(policy, True, 96, options, threshold=2, seed=7, our_semantics=other)
    with pytest.raises(AssertionError, match="differs"):
        assert_same_decisions(ref, ours)
    # The same forced manager at the installed release's semantics agrees.
    same = run(policy, True, 96, options, threshold=2, seed=7, our_semantics=oracle_semantics())
    assert_same_decisions(ref, same)

    rng = random.Random(f"negative-{policy}")

    def random_pairs() -> None:
        for _ in range(50):
            pair = ManagerPair(
                policy, num_chunks=12, store_threshold=2, num_blocks=6, our_semantics=other
            )
            for _ in range(400):
                pair.random_step(rng)
                pair.check()
            pair.events()
            pair.stats()

    with pytest.raises(AssertionError):
        random_pairs()


def test_a_threshold_of_one_cannot_tell_the_releases_apart() -> None:
    """Below a threshold of 2 no key is counted, so the releases decide alike: the negative
    control above differs because of the threshold, not because ours is wrong elsewhere."""
    require_oracle()
    options = DriverOptions(groups=2, reset_every=97, touch_hits=False)
    ref = run("lru", False, 24, options, threshold=1, seed=11)
    ours = run("lru", True, 24, options, threshold=1, seed=11, our_semantics=_other_semantics())
    # Stored events still differ in removal_expected; everything else is equal.
    strip = [tuple(e[:4] for e in entry[1]) if entry[0] == "events" else entry for entry in ref]
    strip_ours = [
        tuple(e[:4] for e in entry[1]) if entry[0] == "events" else entry for entry in ours
    ]
    assert strip == strip_ours
    assert ref != ours


# --- retention hints ----------------------------------------------------------------------

HINT_OPS = RANDOM_OPS // 4


@pytest.mark.parametrize("policy", POLICIES)
def test_seeded_random_operations_with_hints_match_vllm(policy: str) -> None:
    """Every request carries a retention hint of a random kind (tests/support/hint_cases.py): LRU
    and ARC decide exactly as vLLM's, which read none; turn decides in kvcache's manager exactly
    as in vLLM's (loaded by name), both reading them; kvcache's manager counts exactly the
    hints it read (``ManagerPair.stats``)."""
    require_oracle()
    rng = random.Random(f"manager-hints-{policy}")
    counts = random_pairs(policy, rng, HINT_OPS, hints=True)
    for op in ("new_request", "load", "store", "finish", "stats", "reset"):
        assert counts.get(op, 0) > 0, f"no {op} operations were generated"


def test_turn_hears_of_a_hint_when_the_request_first_reaches_it() -> None:
    """Under vLLM's manager, turn reads a request's hint from its context at the first policy
    call for the request (vLLM's manager does not pass on ``on_new_request``); kvcache's
    manager reads it at ``on_new_request`` but hands it to turn at that same point. Another
    request finishing in between (its sampled keys marked only once some request was hinted)
    must leave both policies alike."""
    require_oracle()
    pair = ManagerPair("turn", num_chunks=256, num_blocks=200, hints=True)
    first = pair.new_request(list(range(200)), [0], "none")
    pair.store(first, first.keys)
    pair.complete_store(0, True, [])
    pair.check()
    hinted = pair.new_request([0, 1], [0], "params-continues")
    pair.check()
    pair.finish(first)  # 200 keys: some are in turn's sample (1 in 16)
    pair.check()
    pair.load(hinted, hinted.keys)
    pair.finish(hinted)
    pair.check()
    pair.stats()


@pytest.mark.parametrize("policy", POLICIES)
def test_any_hint_sequence_decides_as_vllm(policy: str) -> None:
    """Hypothesis draws the hint sequence requests take in turn (any kinds, well-formed or
    not) and the operations: every decision and the whole state equal vLLM's manager's (for
    turn, vLLM's manager running kvcache's policy), ``validate()`` holds after every
    operation, and kvcache's manager counts exactly the hints it read."""
    require_oracle()
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.support.hint_cases import HINT_KINDS

    @settings(
        max_examples=int(os.environ.get("KVCACHE_HYPOTHESIS_EXAMPLES", "150")) // 2,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        kinds=st.lists(st.sampled_from(list(HINT_KINDS)), min_size=1, max_size=12),
        rng=st.randoms(use_true_random=False),
        num_chunks=st.sampled_from([1, 3, 6, 12]),
        threshold=st.sampled_from([1, 2]),
    )
    def check(kinds: list[str], rng: random.Random, num_chunks: int, threshold: int) -> None:
        pair = ManagerPair(
            policy,
            num_chunks=num_chunks,
            store_threshold=threshold,
            num_blocks=8,
            hints=True,
            hint_kinds=kinds,
        )
        for _ in range(100):
            pair.random_step(rng)
            pair.check()
        pair.events()
        pair.stats()

    check()
