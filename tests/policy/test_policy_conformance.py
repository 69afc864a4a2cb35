"""Conformance of kvcache's policies with vLLM 0.33.0's, operation by operation.

Two drivers feed the same manager-shaped operations to vLLM's policy and ours and compare every
result and the full internal state after each operation (see ``tests/support/differential.py``):

- hypothesis stateful machines, which shrink any divergence to a minimal sequence;
- seeded random runs, cheap enough to cover well over 100 k operations per policy in CI.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.support.differential import CHUNK_MODES, CONTEXT_KINDS, OPS, Differential
from tests.support.hint_cases import HINT_KINDS
from tests.support.oracle import require_oracle

pytestmark = pytest.mark.oracle

# Operations per (policy, chunk mode) in the seeded runs; CI runs the default.
RANDOM_OPS = int(os.environ.get("KVCACHE_CONFORMANCE_OPS", "100000"))


@pytest.mark.parametrize("hints", [False, True], ids=["plain", "hints"])
@pytest.mark.parametrize("chunk_mode", CHUNK_MODES)
@pytest.mark.parametrize("kind", ["lru", "arc"])
def test_seeded_random_operations_match_vllm(kind: str, chunk_mode: str, hints: bool) -> None:
    """With ``hints``, every request's context carries a retention hint of a random kind
    (tests/support/hint_cases.py), in every context kind: ours read them, vLLM's do not, and the
    decisions and states stay identical."""
    require_oracle()
    rng = random.Random(f"{kind}-{chunk_mode}" + ("-hints" if hints else ""))
    done = 0
    counts: dict[str, int] = {}
    evictions = {"ok": 0, "none": 0}
    while done < (RANDOM_OPS // 4 if hints else RANDOM_OPS):
        # Fresh pairs now and then: small and large capacities, all context kinds.
        pair = Differential(
            kind,
            capacity=rng.choice([1, 2, 3, 5, 8, 16]),
            chunk_mode=chunk_mode,
            context_kind=CONTEXT_KINDS[done // 997 % len(CONTEXT_KINDS)],
            num_blocks=rng.choice([4, 8, 12]),
            num_groups=rng.choice([1, 2, 3]),
            hints=hints,
        )
        for _ in range(2000):
            op = pair.random_step(rng)
            counts[op] = counts.get(op, 0) + 1
            pair.check()
            done += 1
        for outcome, n in pair.evictions.items():
            evictions[outcome] += n
    # The run must have exercised every kind of operation, evictions that succeed and fail.
    for op in OPS:
        assert counts.get(op, 0) > 0, f"no {op} operations were generated"
    assert evictions["ok"] > 0, evictions
    assert evictions["none"] > 0, evictions


class PolicyMachine(RuleBasedStateMachine):
    """Hypothesis drives the same operations; a failure shrinks to a minimal sequence."""

    kind = "lru"

    @initialize(
        capacity=st.integers(1, 8),
        chunk_mode=st.sampled_from(CHUNK_MODES),
        context_kind=st.sampled_from(CONTEXT_KINDS),
        num_groups=st.integers(1, 2),
    )
    def setup(self, capacity: int, chunk_mode: str, context_kind: str, num_groups: int) -> None:
        self.pair = Differential(
            self.kind,
            capacity=capacity,
            chunk_mode=chunk_mode,
            context_kind=context_kind,
            num_blocks=6,
            num_groups=num_groups,
        )

    def _free(self) -> list[bytes]:
        return [k for k in self.pair.universe if k not in self.pair.chunks]

    @rule(data=st.data(), hint=st.sampled_from(list(HINT_KINDS)))
    def new_request(self, data: st.DataObject, hint: str) -> None:
        """A request carrying any kind of retention hint (or none): LRU and ARC ignore it."""
        blocks = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=5, unique=True))
        groups = data.draw(
            st.lists(st.integers(0, self.pair.num_groups - 1), min_size=1, unique=True)
        )
        self.pair.new_request(blocks, sorted(groups), hint)

    @precondition(lambda self: self.pair.requests)
    @rule(data=st.data())
    def end_request(self, data: st.DataObject) -> None:
        self.pair.end_request(data.draw(st.integers(0, len(self.pair.requests) - 1)))

    @rule(data=st.data(), with_context=st.booleans())
    def insert(self, data: st.DataObject, with_context: bool) -> None:
        free = self._free()
        if not free:
            return
        key = data.draw(st.sampled_from(free))
        ctx = None
        if with_context and self.pair.requests:
            ctx = data.draw(st.sampled_from(self.pair.requests)).ctx
        self.pair.insert(key, ctx)

    @rule(data=st.data(), fail=st.booleans())
    def finish_store(self, data: st.DataObject, fail: bool) -> None:
        pending = self.pair.keys_where(lambda c: c == -1)
        if pending:
            key = data.draw(st.sampled_from(pending))
            (self.pair.fail_store if fail else self.pair.complete_store)(key)

    @rule(data=st.data(), load=st.booleans())
    def pin_or_unpin(self, data: st.DataObject, load: bool) -> None:
        keys = self.pair.keys_where((lambda c: c >= 0) if load else (lambda c: c > 0))
        if keys:
            key = data.draw(st.sampled_from(keys))
            (self.pair.pin if load else self.pair.unpin)(key)

    def _keys_and_ctx(self, data: st.DataObject) -> tuple[list[bytes], object]:
        request = data.draw(st.sampled_from(self.pair.requests))
        extra = data.draw(st.lists(st.sampled_from(self.pair.universe), max_size=2))
        keys = data.draw(st.lists(st.sampled_from(request.keys), max_size=8)) + extra
        return keys, request.ctx

    @precondition(lambda self: self.pair.requests)
    @rule(data=st.data(), op=st.sampled_from(["touch", "miss", "access"]))
    def observe(self, data: st.DataObject, op: str) -> None:
        keys, ctx = self._keys_and_ctx(data)
        method = {
            "touch": self.pair.touch,
            "miss": self.pair.on_store_miss,
            "access": self.pair.on_request_access,
        }[op]
        method(keys, ctx)

    @precondition(lambda self: self.pair.requests)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.pair.requests))
        keys = data.draw(st.lists(st.sampled_from(request.keys), unique=True))
        groups: dict[int, list[bytes]] = {}
        for key in keys:
            groups.setdefault(int.from_bytes(key[-4:], "big"), []).append(key)
        key_groups = tuple(tuple(groups[g]) for g in sorted(groups))
        resident = [k for k in keys if k in self.pair.chunks]
        subsets = st.sets(st.sampled_from(resident)) if resident else st.just(set())
        insertion_only = data.draw(subsets)
        reused = data.draw(subsets) - insertion_only
        self.pair.on_request_finished(key_groups, insertion_only, reused, request.ctx)

    @rule(n=st.integers(0, 6), data=st.data())
    def evict(self, n: int, data: st.DataObject) -> None:
        protected = data.draw(st.sets(st.sampled_from(self.pair.universe), max_size=4))
        self.pair.evict(n, protected)

    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        self.pair.get(data.draw(st.sampled_from(self.pair.universe)))

    @rule()
    def clear(self) -> None:
        self.pair.clear()

    @invariant()
    def same_state(self) -> None:
        if hasattr(self, "pair"):
            self.pair.check()


class LRUMachine(PolicyMachine):
    kind = "lru"


class ARCMachine(PolicyMachine):
    kind = "arc"


MACHINE_SETTINGS = settings(
    max_examples=int(os.environ.get("KVCACHE_HYPOTHESIS_EXAMPLES", "150")),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize("machine", [LRUMachine, ARCMachine], ids=["lru", "arc"])
def test_hypothesis_state_machine_matches_vllm(machine: type[PolicyMachine]) -> None:
    require_oracle()
    machine.TestCase.settings = MACHINE_SETTINGS
    machine.TestCase().runTest()


@st.composite
def _key_groups(draw: st.DrawFn) -> tuple[list[list[bytes]], list[tuple[int, int | None]]]:
    """Key groups over a few blocks (repeats allowed) and the positions to record, in a drawn
    order: most blocks get one (so sorting is common), positions often tie."""
    blocks = draw(st.integers(1, 6))
    block = st.integers(0, blocks - 1)
    groups = [
        [b.to_bytes(32, "big") + bytes(4) for b in draw(st.lists(block, max_size=6))]
        for _ in range(draw(st.integers(0, 3)))
    ]
    order = draw(st.permutations(range(blocks)))
    positions = draw(st.lists(st.integers(-1, 4), min_size=blocks, max_size=blocks))
    recorded = [(b, None if positions[b] < 0 else positions[b]) for b in order]
    return groups, recorded


@pytest.mark.parametrize("same_objects", [True, False])
def test_order_request_keys_matches_vllm(same_objects: bool) -> None:
    """kvcache.order_request_keys (which walks the position dict by key identity and checks
    repeats only among equal positions) orders exactly as vLLM's does."""
    require_oracle()
    from hypothesis import given
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.policies.base import order_request_keys

    import kvcache

    @settings(max_examples=300, deadline=None)
    @given(_key_groups())
    def check(case: tuple[list[list[bytes]], list[tuple[int, int | None]]]) -> None:
        groups, recorded = case
        ctx = ReqContext(req_id="r")
        by_block = {k[:32]: k for group in groups for k in group}
        for block, position in recorded:
            key = block.to_bytes(32, "big") + bytes(4)
            if same_objects:
                key = by_block.get(key[:32], key)
            if position is not None:
                ctx.set_offload_key_position(key, position)
        expected = order_request_keys([list(g) for g in groups], ctx)
        assert kvcache.order_request_keys(groups, ctx) == expected

    check()
