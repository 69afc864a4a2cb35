"""Workloads for the replay: a sequence of requests, each an ordered list of offload keys.

A key is what vLLM's offloading scheduler hands its ``OffloadingManager``: a 32-byte block hash
followed by the KV-cache group index as 4 big-endian bytes (``make_offload_key``). Every key of
a request stands for one full block of ``block_tokens`` tokens of the prompt, in prefix order, so
the key at index ``i`` ends at token ``(i + 1) * block_tokens`` -- the position the driver records
on the request context, as vLLM's scheduler does.

The built-in generator models multi-turn chat, the workload CPU offloading is meant for: a turn's
prompt is the conversation's system prompt (shared by many conversations, Zipf-popular), its
whole history and the new user message; many conversations are interleaved, so a conversation's
prefix comes back after a reuse distance of roughly the number of active conversations. Keys are
derived like vLLM's chained block hashes: a block lying wholly inside the system prompt is shared
by every conversation using that prompt, any later block belongs to its conversation only.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "KEY_HASH_BYTES",
    "SyntheticChat",
    "Workload",
    "make_key",
    "synthetic_chat",
]

#: Length of the block-hash part of a key (vLLM uses 32-byte hashes).
KEY_HASH_BYTES = 32


def make_key(block_hash: bytes, group_idx: int = 0) -> bytes:
    """Build an offload key exactly as vLLM's ``make_offload_key`` does (hash + 4-byte BE group).

    Re-implemented here so that building a workload never imports vLLM (a ~10 s import).
    """
    return block_hash + group_idx.to_bytes(4, "big", signed=False)


#: A key's next use when no later request names it (the largest u64: the bound evicts it first).
NEVER = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Workload:
    """An immutable replay input: requests in issue order, each a tuple of keys in prefix order.

    Equal keys are the same ``bytes`` object wherever possible (the generators intern them), which
    keeps memory down and makes the driver's own work the same for every manager.
    """

    name: str
    requests: tuple[tuple[bytes, ...], ...]
    block_tokens: int
    unique_blocks: int
    key_visits: int
    #: Each request's retention hint (``"continues"``, ``"ends"`` or None); None: no hints.
    hints: tuple[str | None, ...] | None = None
    #: Where the hints came from (the trace, or how they were synthesised), for reports.
    hint_source: str | None = None

    def with_hints(self, hints: Sequence[str | None] | None, source: str | None) -> Workload:
        """The same requests with these hints (None: without hints)."""
        if hints is not None and len(hints) != len(self.requests):
            raise ValueError("one hint (or None) per request")
        return dataclasses.replace(
            self,
            hints=None if hints is None else tuple(hints),
            hint_source=None if hints is None else source,
        )

    @classmethod
    def from_requests(
        cls, name: str, requests: Iterable[Sequence[bytes]], *, block_tokens: int
    ) -> Workload:
        """Freeze ``requests`` and count its unique blocks (the base of percentage capacities)."""
        frozen = tuple(tuple(keys) for keys in requests)
        unique: set[bytes] = set()
        visits = 0
        for keys in frozen:
            unique.update(keys)
            visits += len(keys)
        return cls(
            name=name,
            requests=frozen,
            block_tokens=block_tokens,
            unique_blocks=len(unique),
            key_visits=visits,
        )

    @property
    def max_request_keys(self) -> int:
        """The longest request, in keys (the driver sizes its position table with it)."""
        return max((len(keys) for keys in self.requests), default=0)

    def next_uses(self) -> tuple[tuple[int, ...], ...]:
        """For each request and each of its keys, the index of the next request that names the
        key again (:data:`NEVER`: none): what the offline bound is told. One backward pass."""
        last: dict[bytes, int] = {}
        out: list[tuple[int, ...]] = [()] * len(self.requests)
        for i in range(len(self.requests) - 1, -1, -1):
            keys = self.requests[i]
            out[i] = tuple(last.get(k, NEVER) for k in keys)
            for k in keys:
                last[k] = i
        return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticChat:
    """Parameters of the built-in multi-turn chat workload.

    The defaults aim at a replay through vLLM 0.33.0's Python manager taking a few seconds on two
    cores (about 0.5 M key visits), with the cache pressure spread over a realistic range: the
    live conversations' prefixes add up to roughly a third of the unique blocks, so at 5-10 %
    mostly the popular system prompts survive (LRU hit ratio ~0.25-0.4) and at 50 % nearly every
    reusable block does (~0.8, the ceiling set by first-time blocks).
    Token counts are log-normal (median, sigma) and clipped; turn counts are geometric.
    """

    requests: int = 3000
    seed: int = 0
    #: Tokens per key. vLLM's offloading default is one GPU block (16 tokens) per chunk.
    block_tokens: int = 16
    #: Distinct system prompts and the Zipf exponent of their popularity.
    system_prompts: int = 32
    zipf_s: float = 1.1
    system_tokens: tuple[float, float] = (600.0, 0.8)
    user_tokens: tuple[float, float] = (120.0, 1.0)
    assistant_tokens: tuple[float, float] = (250.0, 0.8)
    #: Mean turns per conversation (geometric, at least one).
    mean_turns: float = 6.0
    #: Conversations in flight; the next request comes from one of them, picked uniformly.
    active_conversations: int = 200
    #: A conversation ends early once its prompt would exceed this context length.
    max_context_tokens: int = 16384


@dataclass(slots=True)
class _Conversation:
    conv_id: int
    system_id: int
    system_len: int
    context_len: int  # tokens of the history, i.e. the next prompt minus its user turn
    turns_left: int


class _KeyFactory:
    """Interns keys: one ``bytes`` object per block identity, random-looking like real hashes."""

    def __init__(self, seed: int) -> None:
        self._salt = seed.to_bytes(8, "big", signed=True)
        self._keys: dict[tuple[int, int, int], bytes] = {}

    def key(self, kind: int, owner: int, index: int) -> bytes:
        ident = (kind, owner, index)
        key = self._keys.get(ident)
        if key is None:
            material = self._salt + b"".join(x.to_bytes(8, "big") for x in ident)
            digest = hashlib.blake2b(material, digest_size=KEY_HASH_BYTES).digest()
            key = self._keys[ident] = make_key(digest, 0)
        return key


def _lognormal(rng: random.Random, median_sigma: tuple[float, float], lo: int, hi: int) -> int:
    median, sigma = median_sigma
    value = int(rng.lognormvariate(0.0, sigma) * median)
    return min(max(value, lo), hi)


def _geometric(rng: random.Random, mean: float, cap: int) -> int:
    """At least 1, mean ``mean`` (before the cap): the number of trials up to the first success."""
    p = 1.0 / max(mean, 1.0)
    n = 1
    while n < cap and rng.random() >= p:
        n += 1
    return n


def synthetic_chat(spec: SyntheticChat | None = None) -> Workload:
    """Generate the multi-turn chat workload; the same ``spec`` always gives the same keys.

    Only ``random.Random(seed)`` draws and ``blake2b`` are used, so the output depends on the seed
    and nothing else (no hash randomisation, no global state).
    """
    spec = spec or SyntheticChat()
    if spec.requests < 1 or spec.block_tokens < 1 or spec.active_conversations < 1:
        raise ValueError("requests, block_tokens and active_conversations must be >= 1")
    rng = random.Random(spec.seed)
    keys = _KeyFactory(spec.seed)
    bt = spec.block_tokens

    system_lens = [
        _lognormal(rng, spec.system_tokens, bt, spec.max_context_tokens // 2)
        for _ in range(spec.system_prompts)
    ]
    cum_weights = list(
        itertools.accumulate(
            1.0 / (rank**spec.zipf_s) for rank in range(1, spec.system_prompts + 1)
        )
    )
    conv_ids = itertools.count()

    def new_conversation() -> _Conversation:
        draw = rng.random() * cum_weights[-1]
        system_id = min(bisect.bisect_right(cum_weights, draw), spec.system_prompts - 1)
        return _Conversation(
            conv_id=next(conv_ids),
            system_id=system_id,
            system_len=system_lens[system_id],
            context_len=system_lens[system_id],
            turns_left=_geometric(rng, spec.mean_turns, 64),
        )

    active = [new_conversation() for _ in range(spec.active_conversations)]
    requests: list[tuple[bytes, ...]] = []
    for _ in range(spec.requests):
        slot = int(rng.random() * len(active))
        conv = active[slot]
        prompt_len = conv.context_len + _lognormal(rng, spec.user_tokens, 1, 4096)
        request_keys = []
        for index in range(prompt_len // bt):  # only full blocks get a hash
            if (index + 1) * bt <= conv.system_len:
                request_keys.append(keys.key(0, conv.system_id, index))
            else:
                request_keys.append(keys.key(1, conv.conv_id, index))
        requests.append(tuple(request_keys))

        conv.context_len = prompt_len + _lognormal(rng, spec.assistant_tokens, 1, 4096)
        conv.turns_left -= 1
        if conv.turns_left == 0 or conv.context_len >= spec.max_context_tokens:
            active[slot] = new_conversation()

    name = f"synthetic-chat(requests={spec.requests}, seed={spec.seed})"
    return Workload.from_requests(name, requests, block_tokens=bt)
