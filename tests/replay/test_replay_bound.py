"""The replay's offline bound (``--policy belady``): against brute force, and above every policy.

The brute force enumerates every choice of victims under the manager's semantics with
transfers that complete at once (``lag=0``: no chunk is pending or pinned at an eviction
except the request's own): per request the hit prefix is loaded, the other keys that are not
resident are stored, evicting from the resident chunks the request does not name, or nothing
is stored when too few of them are left (a failed prepare). It maximises the prefix hits of
the whole workload.
"""

from __future__ import annotations

import functools
import itertools
import random

import pytest

from kvcache.replay import ReplayOptions, Workload, make_key, replay
from kvcache.replay.backends import (
    ALL_POLICIES,
    BOUND_POLICY,
    POLICIES,
    kvcache_backend,
    parse_policies,
)
from kvcache.replay.errors import ConfigError
from kvcache.replay.workload import NEVER, SyntheticChat, synthetic_chat


def prefix_tree_workload(rng: random.Random) -> list[list[bytes]]:
    """Requests that are root-to-node paths of a small random prefix tree (shared prefixes,
    several turns of one path, one-off branches)."""
    ids: dict[tuple[int, ...], bytes] = {}
    depth, branch = rng.randint(2, 4), rng.randint(1, 3)
    requests = []
    for _ in range(rng.randint(3, 9)):
        node: tuple[int, ...] = ()
        path = []
        for _ in range(rng.randint(1, depth)):
            node = (*node, rng.randrange(branch))
            if node not in ids:
                ids[node] = make_key(len(ids).to_bytes(32, "big"))
            path.append(ids[node])
        requests.append(path)
    return requests


def brute_force_hits(requests: list[list[bytes]], capacity: int) -> int:
    """The most prefix hits any sequence of eviction choices reaches (see the module docs)."""
    reqs = [tuple(r) for r in requests]

    @functools.cache
    def best(i: int, resident: frozenset[bytes]) -> int:
        if i == len(reqs):
            return 0
        keys = reqs[i]
        hits = 0
        for k in keys:
            if k not in resident:
                break
            hits += 1
        new = [k for k in keys[hits:] if k not in resident]
        need = len(new) - (capacity - len(resident))
        if not new:
            return hits + best(i + 1, resident)
        if need <= 0:
            return hits + best(i + 1, resident | set(new))
        evictable = sorted(resident - set(keys))
        if need > len(evictable):  # a failed prepare: nothing stored
            return hits + best(i + 1, resident)
        return hits + max(
            best(i + 1, (resident - set(victims)) | set(new))
            for victims in itertools.combinations(evictable, need)
        )

    return best(0, frozenset())


def hits_of(requests: list[list[bytes]], capacity: int, policy: str, **options: int) -> int:
    wl = Workload.from_requests("t", requests, block_tokens=16)
    run = replay(
        kvcache_backend(), wl, policy=policy, num_chunks=capacity, options=ReplayOptions(**options)
    )
    return run.hits


def test_the_bound_equals_brute_force_on_tiny_workloads() -> None:
    rng = random.Random("bound-vs-brute-force")
    below_lru = 0
    for _ in range(400):
        requests = prefix_tree_workload(rng)
        capacity = rng.randint(1, 5)
        optimum = brute_force_hits(requests, capacity)
        assert hits_of(requests, capacity, BOUND_POLICY, lag=0) == optimum, (requests, capacity)
        lru = hits_of(requests, capacity, "lru", lag=0)
        assert lru <= optimum
        below_lru += lru < optimum
    # The cases are not all trivial: the bound beats LRU on a good share of them.
    assert below_lru >= 25


@pytest.mark.parametrize(
    "options",
    [
        {"lag": 8},
        {"lag": 2, "store_threshold": 2, "preempt_every": 3},
        {"lag": 4, "fail_store_every": 5},
    ],
    ids=["default", "threshold-preempt", "failing"],
)
def test_the_bound_is_above_every_policy(options: dict[str, int]) -> None:
    wl = synthetic_chat(SyntheticChat(requests=400, seed=3))
    for fraction in (0.02, 0.05, 0.1, 0.2, 0.5):
        capacity = max(1, round(fraction * wl.unique_blocks))
        runs = {
            policy: replay(
                kvcache_backend(),
                wl,
                policy=policy,
                num_chunks=capacity,
                options=ReplayOptions(**options),
            )
            for policy in ALL_POLICIES
        }
        bound = runs[BOUND_POLICY].hit_ratio
        for policy in POLICIES:
            assert runs[policy].hit_ratio <= bound, (policy, fraction, options)


def test_next_uses_name_the_next_request_with_the_key() -> None:
    a, b, c = (make_key(bytes([i]) * 32) for i in range(3))
    wl = Workload.from_requests("t", [[a, b], [a], [a, c], [b]], block_tokens=16)
    assert wl.next_uses() == ((1, 3), (2,), (NEVER, NEVER), (NEVER,))


def test_policy_all_runs_every_policy_then_the_bound_and_only_on_kvcache() -> None:
    assert parse_policies("all") == [*POLICIES, BOUND_POLICY]
    assert parse_policies("belady,lru,ALL") == [BOUND_POLICY, "lru", *POLICIES[1:]]
    with pytest.raises(ConfigError, match="unknown policy"):
        parse_policies("optimal")
    from kvcache.replay.backends import _check_policy

    with pytest.raises(ConfigError, match="kvcache's manager only"):
        _check_policy(BOUND_POLICY)
