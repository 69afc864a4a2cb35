"""A pair of policies, the installed vLLM's (0.33.0 or 0.34.0) and ours, driven op by op and
compared after every op.

The operations follow how vLLM's ``CPUOffloadingManager`` drives a policy: chunks are inserted
pending (``ref_cnt == -1``), become ready and evictable when their store completes, are pinned
and unpinned by loads, and are removed when a store fails; requests carry token positions on
their context, observe keys, and finish; evictions protect the keys being stored.

After every operation ``check()`` runs our ``validate()`` and compares the complete internal
state: ARC's four lists (order included) and ``target_t1_size``; LRU's rank of every key and
its evictable set. Every ``get`` and ``evict`` result is compared too: keys, order, ``None``,
and the identity of the returned chunk objects.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import kvcache
from tests.support.hint_cases import HINT_KINDS, hint_fields
from tests.support.keys import make_key, request_keys

CHUNK_MODES = ("shared", "native")
CONTEXT_KINDS = ("vllm", "kvcache", "duck")
# Random operations and their weights, shaped like a manager's traffic.
OPS = {
    "new_request": 6,
    "end_request": 4,
    "store": 14,
    "complete": 10,
    "fail": 2,
    "pin": 6,
    "unpin": 6,
    "touch": 5,
    "miss": 4,
    "access": 8,
    "finish": 6,
    "evict": 10,
    "get": 4,
    "clear": 0.2,
}


class DuckContext:
    """An object with ReqContext's methods only (and the two places a retention hint may
    sit): exercises the policies' generic path."""

    def __init__(self, kv_transfer_params: Any = None, kv_hints: Any = None) -> None:
        self._s: dict[type, Any] = {}
        self._p: dict[bytes, int] = {}
        self.kv_transfer_params = kv_transfer_params
        self.kv_hints = kv_hints

    def set_state(self, val: Any) -> None:
        self._s[type(val)] = val

    def get_state(self, cls: type) -> Any:
        return self._s.get(cls)

    def set_offload_key_position(self, key: bytes, end_token: int) -> None:
        self._p[key] = end_token

    def get_offload_key_position(self, key: bytes) -> int | None:
        return self._p.get(key)


@dataclass
class Request:
    ctx: Any
    keys: list[bytes]


@dataclass
class Chunk:
    ref: Any  # the chunk vLLM's policy holds
    ours: Any  # the chunk our policy holds (the same object in "shared" mode)


@dataclass
class Differential:
    kind: str  # "lru" | "arc"
    capacity: int
    chunk_mode: str = "shared"
    context_kind: str = "vllm"
    num_blocks: int = 12
    num_groups: int = 2
    #: Requests carry retention hints of random kinds (``tests.support.hint_cases``): LRU and ARC
    #: must decide as vLLM's, which read none.
    hints: bool = False
    ref: Any = None
    ours: Any = None
    chunks: dict[bytes, Chunk] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    next_chunk_id: int = 0
    ops: int = 0
    # Evictions that found their victims, and ones that returned None.
    evictions: dict[str, int] = field(default_factory=lambda: {"ok": 0, "none": 0})

    def __post_init__(self) -> None:
        from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy as RefArc
        from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus as RefChunk
        from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy as RefLru

        self._ref_chunk = RefChunk
        ref_cls, our_cls = {
            "lru": (RefLru, kvcache.LRUCachePolicy),
            "arc": (RefArc, kvcache.ARCCachePolicy),
        }[self.kind]
        self.ref = ref_cls(cache_capacity=self.capacity)
        self.ours = our_cls(cache_capacity=self.capacity)
        self.universe = [
            make_key(b, g) for b in range(self.num_blocks) for g in range(self.num_groups)
        ]

    # --- contexts -------------------------------------------------------------------------

    def new_context(self, hint: str = "none") -> Any:
        params, kv_hints = hint_fields(hint)
        if self.context_kind == "vllm":
            from vllm.v1.kv_offload.base import ReqContext

            return ReqContext(req_id=f"r{self.ops}", kv_transfer_params=params, kv_hints=kv_hints)
        if self.context_kind == "kvcache":
            return kvcache.ReqContext(f"r{self.ops}", params, kv_hints)
        return DuckContext(params, kv_hints)

    def new_request(self, blocks: list[int], groups: list[int], hint: str = "none") -> Request:
        """A request over ``blocks`` (prefix order) in every group of ``groups``, keys placed
        as :func:`request_keys` places them, carrying a retention hint of kind ``hint``."""
        ctx = self.new_context(hint)
        keys = request_keys(ctx, blocks, groups)
        request = Request(ctx, keys)
        self.requests.append(request)
        return request

    def end_request(self, index: int) -> None:
        # Dropping the context frees the per-request state both policies keep on it.
        del self.requests[index]

    # --- chunk state, as the manager keeps it -----------------------------------------------

    def _new_chunk(self) -> Chunk:
        self.next_chunk_id += 1
        ref = self._ref_chunk(self.next_chunk_id)
        if self.chunk_mode == "shared":
            return Chunk(ref, ref)
        return Chunk(ref, kvcache.ChunkStatus(self.next_chunk_id))

    def ref_cnt(self, key: bytes) -> int:
        return self.chunks[key].ref.ref_cnt

    def _set_ref_cnt(self, key: bytes, value: int) -> None:
        chunk = self.chunks[key]
        chunk.ref.ref_cnt = value
        chunk.ours.ref_cnt = value

    def keys_where(self, pred: Any) -> list[bytes]:
        return [k for k in self.chunks if pred(self.ref_cnt(k))]

    # --- protocol operations ----------------------------------------------------------------

    def insert(self, key: bytes, ctx: Any | None) -> None:
        assert key not in self.chunks
        chunk = self._new_chunk()
        if ctx is None:
            # The seed's two-argument form: vLLM 0.33's policies need a context, so give
            # vLLM an empty one (no position -> fresh rank) and ours none at all.
            self.ref.insert(key, chunk.ref, self.new_context())
            self.ours.insert(key, chunk.ours)
        else:
            self.ref.insert(key, chunk.ref, ctx)
            self.ours.insert(key, chunk.ours, ctx)
        self.chunks[key] = chunk

    def complete_store(self, key: bytes) -> None:
        assert self.ref_cnt(key) == -1
        self._set_ref_cnt(key, 0)
        self.ref.mark_evictable(key)
        self.ours.mark_evictable(key)

    def fail_store(self, key: bytes) -> None:
        assert self.ref_cnt(key) == -1
        self.ref.remove(key)
        self.ours.remove(key)
        del self.chunks[key]

    def pin(self, key: bytes) -> None:
        cnt = self.ref_cnt(key)
        assert cnt >= 0
        if cnt == 0:
            self.ref.mark_non_evictable(key)
            self.ours.mark_non_evictable(key)
        self._set_ref_cnt(key, cnt + 1)

    def unpin(self, key: bytes) -> None:
        cnt = self.ref_cnt(key)
        assert cnt > 0
        self._set_ref_cnt(key, cnt - 1)
        if cnt == 1:
            self.ref.mark_evictable(key)
            self.ours.mark_evictable(key)

    def touch(self, keys: list[bytes], ctx: Any) -> None:
        # vLLM 0.34's policies have no touch (ours keep it, outside vLLM's protocol): the op
        # then does nothing to either, so both releases draw the same random sequence.
        if hasattr(self.ref, "touch"):
            self.ref.touch(keys, ctx)
            self.ours.touch(keys, ctx)

    def on_store_miss(self, keys: list[bytes], ctx: Any) -> None:
        self.ref.on_store_miss(keys, ctx)
        self.ours.on_store_miss(keys, ctx)

    def on_request_access(self, keys: list[bytes], ctx: Any) -> None:
        self.ref.on_request_access(keys, ctx)
        self.ours.on_request_access(keys, ctx)

    def on_request_finished(
        self,
        key_groups: tuple[tuple[bytes, ...], ...],
        insertion_only: set[bytes],
        reused: set[bytes],
        ctx: Any,
    ) -> None:
        self.ref.on_request_finished(key_groups, set(insertion_only), set(reused), ctx)
        self.ours.on_request_finished(key_groups, set(insertion_only), set(reused), ctx)

    def get(self, key: bytes) -> None:
        ref, ours = self.ref.get(key), self.ours.get(key)
        if key in self.chunks:
            assert ref is self.chunks[key].ref
            assert ours is self.chunks[key].ours, f"get({key!r}) returned another object"
        else:
            assert ref is None
            assert ours is None, f"get({key!r}) found an absent key"

    def evict(self, n: int, protected: set[bytes]) -> list[bytes] | None:
        ref = self.ref.evict(n, set(protected))
        ours = self.ours.evict(n, set(protected))
        if ref is None:
            assert ours is None, f"evict({n}) succeeded where vLLM's failed: {ours}"
            self.evictions["none"] += 1
            return None
        self.evictions["ok"] += n > 0
        assert ours is not None, f"evict({n}) failed where vLLM's evicted {ref}"
        ref_keys = [k for k, _ in ref]
        assert [k for k, _ in ours] == ref_keys, "different victims or order"
        for (key, ref_chunk), (_, our_chunk) in zip(ref, ours, strict=True):
            assert ref_chunk is self.chunks[key].ref
            assert our_chunk is self.chunks[key].ours, "evict returned another chunk object"
            assert our_chunk.ref_cnt == 0
            assert key not in protected
            del self.chunks[key]
        return ref_keys

    def clear(self) -> None:
        self.ref.clear()
        self.ours.clear()
        self.chunks.clear()

    # --- comparison -------------------------------------------------------------------------

    def check(self) -> None:
        self.ops += 1
        self.ours.validate()
        assert len(self.ours) == len(self.chunks)
        state = self.ours._debug_state()
        if self.kind == "arc":
            for name in ("t1", "t2", "b1", "b2"):
                assert state[name] == list(getattr(self.ref, name)), f"{name} differs"
            assert state["target_t1_size"] == self.ref.target_t1_size
            assert self.ours.target_t1_size == self.ref.target_t1_size
        else:
            assert state["ranks"] == self.ref._ranks, "LRU ranks differ"
            assert set(state["evictable"]) == self.ref._evictable, "evictable sets differ"

    # --- a random manager-shaped step (for seeded long runs) --------------------------------

    def random_step(self, rng: random.Random) -> str:
        """Applies one random operation, weighted like a manager's traffic; returns its name."""
        op = rng.choices(list(OPS), weights=list(OPS.values()))[0]
        ctx = rng.choice(self.requests).ctx if self.requests else None
        if op == "new_request" or (ctx is None and op in ("access", "finish")):
            blocks = rng.sample(range(self.num_blocks), rng.randint(1, min(6, self.num_blocks)))
            groups = sorted(rng.sample(range(self.num_groups), rng.randint(1, self.num_groups)))
            # No draw without hints: the seeded runs without them stay as they were.
            hint = rng.choice(list(HINT_KINDS)) if self.hints else "none"
            self.new_request(blocks, groups, hint)
            return "new_request"
        if op == "end_request" and self.requests:
            self.end_request(rng.randrange(len(self.requests)))
        elif op == "store":
            free = [k for k in self.universe if k not in self.chunks]
            if free:
                self.insert(rng.choice(free), ctx if rng.random() < 0.8 else None)
        elif op in ("complete", "fail"):
            pending = self.keys_where(lambda c: c == -1)
            if pending:
                key = rng.choice(pending)
                (self.complete_store if op == "complete" else self.fail_store)(key)
        elif op == "pin":
            ready = self.keys_where(lambda c: c >= 0)
            if ready:
                self.pin(rng.choice(ready))
        elif op == "unpin":
            pinned = self.keys_where(lambda c: c > 0)
            if pinned:
                self.unpin(rng.choice(pinned))
        elif op in ("touch", "miss", "access"):
            keys = rng.sample(self.universe, rng.randint(0, min(6, len(self.universe))))
            if ctx is not None and rng.random() < 0.7:
                keys = [k for k in rng.choice(self.requests).keys if rng.random() < 0.7]
            if op == "access":
                request = rng.choice(self.requests)
                ctx = request.ctx
                keys = [k for k in request.keys if rng.random() < 0.8] + keys[:1]
            method = {"touch": self.touch, "miss": self.on_store_miss}.get(
                op, self.on_request_access
            )
            method(keys, ctx)
        elif op == "finish":
            request = rng.choice(self.requests)
            keys = [k for k in request.keys if rng.random() < 0.9]
            if rng.random() < 0.1:
                keys.append(rng.choice(self.universe))  # a key without a position
            if rng.random() < 0.05 and keys:
                keys.append(keys[0])  # a duplicate: vLLM then keeps concatenation order
            groups: dict[int, list[bytes]] = {}
            for key in keys:
                groups.setdefault(int.from_bytes(key[-4:], "big"), []).append(key)
            key_groups = tuple(tuple(groups[g]) for g in sorted(groups))
            resident = [k for k in keys if k in self.chunks]
            insertion_only = {k for k in resident if rng.random() < 0.4}
            reused = {k for k in resident if rng.random() < 0.5}
            if rng.random() < 0.8:
                reused -= insertion_only
            self.on_request_finished(key_groups, insertion_only, reused, request.ctx)
        elif op == "evict":
            n = rng.choice([0, 1, 1, 2, 3, 5, 8])
            protected = set(rng.sample(self.universe, rng.randint(0, min(5, len(self.universe)))))
            self.evict(n, protected)
        elif op == "get":
            self.get(rng.choice(self.universe))
        elif op == "clear":
            self.clear()
        return op
