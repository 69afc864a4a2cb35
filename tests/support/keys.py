"""Keys as vLLM's offloading code builds them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def make_key(block: int, group: int = 0) -> bytes:
    """A vLLM OffloadKey: a 32-byte block hash and a 4-byte big-endian group index."""
    return block.to_bytes(32, "big") + group.to_bytes(4, "big")


def request_keys(ctx: Any, blocks: Sequence[int], groups: Sequence[int]) -> list[bytes]:
    """The keys of a request over ``blocks`` (prefix order) in every KV-cache group of
    ``groups``, their positions set on ``ctx`` as vLLM's scheduler sets them: block i ends at
    token 16 * (i + 1) in every group (so equal positions tie on key bytes)."""
    keys = []
    for i, b in enumerate(blocks):
        for g in groups:
            key = make_key(b, g)
            ctx.set_offload_key_position(key, 16 * (i + 1))
            keys.append(key)
    return keys
