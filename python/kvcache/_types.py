"""Result types of ``kvcache.OffloadingManager``, shaped like vLLM's (``vllm.v1.kv_offload.base``)
so code written against vLLM's manager reads them unchanged, without importing vLLM.

``LoadStoreSpec``, ``PrepareStoreOutput``, ``EvictedKeys`` and ``OffloadingEvent`` are Rust
classes (the manager builds them without running Python code); ``LookupResult`` is a Python enum
with vLLM's members. ``EvictedKeys`` (``PrepareStoreOutput.evicted_keys``, with vLLM's types too)
is a read-only sequence of ``bytes`` that makes its ``bytes`` objects on first use: vLLM's
scheduler never reads the field, and a full cache evicts on most stores.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from types import SimpleNamespace

from kvcache._core import EvictedKeys, LoadStoreSpec, OffloadingEvent, PrepareStoreOutput

__all__ = ["EvictedKeys", "LoadStoreSpec", "LookupResult", "OffloadingEvent", "PrepareStoreOutput"]

Sequence.register(EvictedKeys)


class LookupResult(enum.Enum):
    """Result of ``OffloadingManager.lookup`` (same member names and values as vLLM's)."""

    MISS = 1
    HIT = 2
    HIT_PENDING = 3
    RETRY = 4


# What the Rust manager builds its results from (see crates/kvcache-py/src/results.rs).
RESULT_TYPES = SimpleNamespace(
    native=True,
    miss=LookupResult.MISS,
    hit=LookupResult.HIT,
    hit_pending=LookupResult.HIT_PENDING,
)
