"""vLLM's CPUOffloadingManager (0.33.0 or 0.34.0, the installed one) and ours, driven op by op
and compared after every op.

Both managers see the same request contexts (each keeps its per-request state on the context
under its own type, so they do not interfere) and the same calls. Every result is compared:
lookups, load and store specs (chunk ids), keys to store, evicted keys, None for a failed
prepare, events, stats. After every operation ``check()`` runs our ``validate()`` and compares
the whole state: each key's chunk id and ref_cnt, the free list, the counts, and the policy's
internal order (ARC's lists and target, LRU's ranks).

Ours follows the installed release's semantics unless ``our_semantics`` names another one (the
negative control: the suites must tell the releases apart where they differ).

A policy vLLM does not ship (kvcache's ``turn``) is compared the way an operator would deploy
it without kvcache's manager: vLLM's manager loading the class from ``kvcache.vllm`` by name.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tests.support.hint_cases import HINT_KINDS, hint_fields
from tests.support.keys import make_key, request_keys

OPS = (
    "new_request", "lookup", "load", "complete_load", "touch", "store", "complete_store",
    "finish", "events", "stats", "reset", "end_request",
)  # fmt: skip


def normalize_event(e: Any) -> tuple:
    # vLLM 0.34 adds req_context to stored events (compared by identity: the storing request's
    # own context object); 0.33 has no such field.
    ctx = getattr(e, "req_context", None)
    return (
        tuple(e.keys),
        str(getattr(e.medium, "name", e.medium)),
        e.removed,
        e.metadata_only,
        e.removal_expected,
        None if ctx is None else id(ctx),
    )


def our_manager_class(semantics: str | None) -> type:
    """kvcache.vllm's manager, or (``semantics`` given) the same class forced to another
    release's semantics, for negative controls."""
    from kvcache._core import OffloadingManager as RustManager
    from kvcache.vllm import CPUOffloadingManager

    if semantics is None:
        return CPUOffloadingManager

    class Forced(CPUOffloadingManager):
        def __new__(cls, num_chunks: int, cache_policy: str = "lru", **kwargs: Any) -> Any:
            kwargs.pop("info", None)
            return RustManager.__new__(
                cls, num_chunks, cache_policy, None, **kwargs, vllm_semantics=semantics
            )

    return Forced


def reference_policy(policy: str) -> dict[str, Any]:
    """How vLLM's manager is told to run ``policy``: its own class for a name vLLM registers,
    else kvcache's class by name from ``kvcache.vllm`` (vLLM's ``CachePolicyFactory`` path)."""
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    from kvcache import POLICY_KINDS

    if policy in CachePolicyFactory._registry:
        return {"cache_policy": policy}
    return {
        "cache_policy": POLICY_KINDS[policy].__name__,
        "cache_policy_module_path": "kvcache.vllm",
    }


def normalize_store(out: Any) -> Any:
    if out is None:
        return None
    return (list(out.keys_to_store), out.store_spec.block_ids.tolist(), list(out.evicted_keys))


@dataclass
class Request:
    ctx: Any
    keys: list[bytes]
    finished: bool = False
    hint: str = "none"


@dataclass
class ManagerPair:
    policy: str
    num_chunks: int
    store_threshold: int = 1
    max_tracker_size: int = 64_000
    num_blocks: int = 16
    num_groups: int = 1
    our_semantics: str | None = None
    #: Requests carry retention hints of random kinds (``tests.support.hint_cases``); ``hint_kinds``
    #: (when given) is the sequence they take them from, in turn.
    hints: bool = False
    hint_kinds: list[str] | None = None
    ref: Any = None
    ours: Any = None
    requests: list[Request] = field(default_factory=list)
    loads: list[tuple[Any, list[bytes]]] = field(default_factory=list)
    stores: list[tuple[Any, list[bytes]]] = field(default_factory=list)
    #: Requests whose state kvcache's manager holds (it reads a request's hint when it makes
    #: that state: at ``on_new_request``, and again at the next call after a reset).
    recorded: set[int] = field(default_factory=set)
    #: The hint counts kvcache's manager must report at the next ``stats``.
    hint_tally: Counter[str] = field(default_factory=Counter)
    #: Requests made so far (each draws the next hint of ``hint_kinds``).
    made: int = 0

    def __post_init__(self) -> None:
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as Ref

        Ours = our_manager_class(self.our_semantics)
        kwargs: dict[str, Any] = dict(
            num_chunks=self.num_chunks,
            enable_events=True,
            store_threshold=self.store_threshold,
            max_tracker_size=self.max_tracker_size,
        )
        self.ref = Ref(**kwargs, **reference_policy(self.policy))
        self.ours = Ours(**kwargs, cache_policy=self.policy)
        self.universe = [
            make_key(b, g) for b in range(self.num_blocks) for g in range(self.num_groups)
        ]

    def both(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return getattr(self.ref, method)(*args, **kwargs), getattr(self.ours, method)(
            *args, **kwargs
        )

    # --- operations -----------------------------------------------------------------------

    def new_request(self, blocks: list[int], groups: list[int], hint: str = "none") -> Request:
        from vllm.v1.kv_offload.base import ReqContext

        params, kv_hints = hint_fields(hint)
        ctx = ReqContext(
            req_id=f"r{len(self.requests)}", kv_transfer_params=params, kv_hints=kv_hints
        )
        keys = request_keys(ctx, blocks, groups)
        ref, ours = self.both("on_new_request", ctx)
        assert ref == ours
        request = Request(ctx, keys, hint=hint)
        self.requests.append(request)
        self.made += 1
        self.record(request)
        return request

    def record(self, request: Request) -> None:
        """kvcache's manager has made the request's state (and read its hint) if it had none."""
        if id(request.ctx) in self.recorded:
            return
        self.recorded.add(id(request.ctx))
        read = HINT_KINDS[request.hint]
        if read == "ignored":
            self.hint_tally["ignored"] += 1
        elif read is not None:
            self.hint_tally["hinted"] += 1

    def lookup(self, key: bytes, ctx: Any) -> Any:
        ref, ours = self.both("lookup", key, ctx)
        assert ours is ref, f"lookup({key!r}): vLLM {ref}, ours {ours}"
        return ref

    def load(self, request: Request, keys: list[bytes]) -> None:
        from vllm.v1.kv_offload.base import LookupResult

        keys = [k for k in keys if self.ref.lookup(k, request.ctx) is LookupResult.HIT]
        if request.finished and any(
            k not in request.ctx.get_state(_ref_state_type()).seen_keys for k in keys
        ):
            return  # vLLM asserts on new keys after finish; ours raises (tested elsewhere)
        ref, ours = self.both("prepare_load", keys, request.ctx)
        self.record(request)
        assert ours.block_ids.tolist() == ref.block_ids.tolist()
        self.loads.append((request.ctx, keys))

    def complete_load(self, index: int) -> None:
        ctx, keys = self.loads.pop(index)
        self.both("complete_load", keys, ctx)

    def touch(self, keys: list[bytes], ctx: Any) -> None:
        if hasattr(self.ref, "touch"):
            self.both("touch", keys, ctx)
            return
        # vLLM 0.34 has no touch: neither has the adapter's manager, and the Rust method
        # under it refuses, typed, and changes nothing.
        import pytest

        from kvcache import UnsupportedOperationError
        from kvcache._core import OffloadingManager as RustManager

        assert not hasattr(self.ours, "touch")
        before = self.ours._debug_state()
        with pytest.raises(UnsupportedOperationError):
            RustManager.touch(self.ours, keys, ctx)
        assert self.ours._debug_state() == before

    def store(self, request: Request, keys: list[bytes]) -> None:
        keys = list(dict.fromkeys(keys))  # one offer names a key once
        if request.finished:
            return  # the scheduler never stores for a finished request
        ref, ours = self.both("prepare_store", keys, request.ctx)
        self.record(request)
        assert normalize_store(ours) == normalize_store(ref), (
            f"prepare_store({len(keys)} keys): vLLM {normalize_store(ref)}, "
            f"ours {normalize_store(ours)}"
        )
        if ref is not None and ref.keys_to_store:
            self.stores.append((request.ctx, list(ref.keys_to_store)))

    def complete_store(self, index: int, success: bool, extra: list[bytes]) -> None:
        ctx, keys = self.stores.pop(index)
        self.both("complete_store", keys + extra, ctx, success=success)

    def finish(self, request: Request) -> None:
        self.both("on_request_finished", request.ctx)
        request.finished = True

    def events(self) -> None:
        ref, ours = self.both("take_events")
        ref, ours = list(ref), list(ours)
        assert [normalize_event(e) for e in ours] == [normalize_event(e) for e in ref]

    def stats(self) -> None:
        from kvcache.vllm._metrics import HINT_METRICS, HINTED_REQUESTS, IGNORED_HINTS

        ref, ours = self.both("get_stats")
        # kvcache's hint counters: exactly the hints its manager read since the last stats.
        data = ours.data["data"]
        reported = {name: data.pop(name)[()] for name in HINT_METRICS if name in data}
        for name in HINT_METRICS:
            ours.data["types"].pop(name, None)
        expected = {
            name: count
            for name, count in (
                (HINTED_REQUESTS, self.hint_tally["hinted"]),
                (IGNORED_HINTS, self.hint_tally["ignored"]),
            )
            if count
        }
        if self.policy not in ("lru", "arc"):
            reported.pop(HINT_METRICS[2], None)  # turn's hits on chunks a hint kept
        assert reported == expected, f"hint counters: expected {expected}, got {reported}"
        self.hint_tally.clear()
        assert ours.data == ref.data, f"stats: vLLM {ref.data}, ours {ours.data}"

    def reset(self) -> None:
        self.both("reset_cache")
        self.recorded.clear()
        # The scheduler drops jobs in flight at a reset: they never complete.
        self.loads.clear()
        self.stores.clear()

    def end_request(self, index: int) -> None:
        request = self.requests.pop(index)
        self.recorded.discard(id(request.ctx))  # the id may name another context later
        self.loads = [(c, k) for c, k in self.loads if c is not request.ctx]
        self.stores = [(c, k) for c, k in self.stores if c is not request.ctx]

    # --- comparison -----------------------------------------------------------------------

    def check(self) -> None:
        self.ours.validate()
        state = self.ours._debug_state()
        policy = self.ref._policy
        if self.policy not in ("lru", "arc"):
            # vLLM's manager runs kvcache's own class: its whole state must equal the one
            # kvcache's manager keeps, and hold the same chunks.
            policy.validate()
            for name, value in policy._debug_state().items():
                assert state[name] == value, f"policy state {name!r} differs"
            assert len(policy) == len(state["chunks"])
            ref_chunks = {
                k: (policy.get(k).chunk_id, policy.get(k).ref_cnt) for k in state["chunks"]
            }
            assert state["chunks"] == ref_chunks, "chunk ids or ref counts differ"
            self._check_counts(state)
            return
        ref_chunks = {}
        resident = policy.chunks if self.policy == "lru" else {**policy.t1, **policy.t2}
        for key, chunk in resident.items():
            ref_chunks[key] = (chunk.chunk_id, chunk.ref_cnt)
        assert state["chunks"] == ref_chunks, "chunk ids or ref counts differ"
        self._check_counts(state)
        if self.policy == "arc":
            for name in ("t1", "t2", "b1", "b2"):
                assert state[name] == list(getattr(policy, name)), f"ARC {name} differs"
            assert state["target_t1_size"] == policy.target_t1_size
        else:
            assert state["ranks"] == policy._ranks, "LRU ranks differ"

    def _check_counts(self, state: dict[str, Any]) -> None:
        assert state["free_list"] == self.ref._free_list
        assert state["num_allocated"] == self.ref._num_allocated_chunks
        assert state["num_evictable"] == self.ref._num_evictable_cache_chunks
        assert state["num_write_pending"] == self.ref._num_write_pending_chunks

    # --- random manager-shaped traffic ------------------------------------------------------

    def random_step(self, rng: random.Random) -> str:
        op = rng.choices(OPS, weights=[6, 8, 6, 6, 3, 10, 9, 5, 3, 2, 0.15, 3])[0]
        if op == "new_request" or not self.requests:
            blocks = rng.sample(range(self.num_blocks), rng.randint(1, min(8, self.num_blocks)))
            if rng.random() < 0.5:
                blocks.sort()
            groups = sorted(rng.sample(range(self.num_groups), rng.randint(1, self.num_groups)))
            self.new_request(blocks, groups, self.next_hint(rng))
            return "new_request"
        request = rng.choice(self.requests)
        if op == "lookup":
            for key in request.keys:
                if self.lookup(key, request.ctx).name != "HIT":
                    break
        elif op == "load":
            self.load(request, [k for k in request.keys if rng.random() < 0.7])
        elif op == "complete_load" and self.loads:
            self.complete_load(rng.randrange(len(self.loads)))
        elif op == "touch":
            self.touch(rng.sample(self.universe, rng.randint(0, 4)), request.ctx)
        elif op == "store":
            keys = [k for k in request.keys if rng.random() < 0.8]
            if rng.random() < 0.1:
                keys.append(rng.choice(self.universe))  # a key without a position
            self.store(request, keys)
        elif op == "complete_store" and self.stores:
            extra = rng.sample(self.universe, rng.randint(0, 2)) if rng.random() < 0.2 else []
            self.complete_store(rng.randrange(len(self.stores)), rng.random() < 0.85, extra)
        elif op == "finish":
            self.finish(request)
        elif op == "events":
            self.events()
        elif op == "stats":
            self.stats()
        elif op == "reset":
            self.reset()
        elif op == "end_request":
            self.end_request(self.requests.index(request))
        return op

    def next_hint(self, rng: random.Random) -> str:
        """The hint kind of the next request (no draw from ``rng`` without hints, so that the
        seeded runs without hints stay as they were)."""
        if not self.hints:
            return "none"
        if self.hint_kinds:
            return self.hint_kinds[self.made % len(self.hint_kinds)]
        return rng.choice(list(HINT_KINDS))


def _ref_state_type() -> type:
    from vllm.v1.kv_offload.cpu.manager import _RequestCacheAccess

    return _RequestCacheAccess
