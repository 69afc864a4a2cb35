"""Keys as vLLM's offloading code builds them."""

from __future__ import annotations


def make_key(block: int, group: int = 0) -> bytes:
    """A vLLM OffloadKey: a 32-byte block hash and a 4-byte big-endian group index."""
    return block.to_bytes(32, "big") + group.to_bytes(4, "big")
