"""Result types of ``kvcache.OffloadingManager``, shaped like vLLM's (``vllm.v1.kv_offload.base``)
so code written against vLLM's manager reads them unchanged, without importing vLLM."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

__all__ = ["LoadStoreSpec", "LookupResult", "OffloadingEvent", "PrepareStoreOutput"]


class LookupResult(enum.Enum):
    """Result of ``OffloadingManager.lookup`` (same member names and values as vLLM's)."""

    MISS = 1
    HIT = 2
    HIT_PENDING = 3
    RETRY = 4


class LoadStoreSpec:
    """Chunk ids of a load or store, as an ``np.int32`` array in ``block_ids``."""

    __slots__ = ("block_ids",)

    def __init__(self, block_ids: Any) -> None:
        import numpy as np  # noqa: PLC0415 - numpy is only needed once a spec is built

        self.block_ids = np.array(block_ids, dtype=np.int32)

    @property
    def chunk_ids(self) -> Any:
        return self.block_ids

    def __repr__(self) -> str:
        return f"LoadStoreSpec({self.block_ids.tolist()})"


@dataclass
class PrepareStoreOutput:
    keys_to_store: list[bytes]
    store_spec: LoadStoreSpec
    evicted_keys: list[bytes]


@dataclass
class OffloadingEvent:
    keys: list[bytes]
    medium: str
    removed: bool  # True: evicted or dropped; False: stored
    metadata_only: bool = False  # a failed store's cleanup, not a public eviction


RESULT_TYPES = SimpleNamespace(
    miss=LookupResult.MISS,
    hit=LookupResult.HIT,
    hit_pending=LookupResult.HIT_PENDING,
    spec_cls=LoadStoreSpec,
    output_cls=PrepareStoreOutput,
    event_cls=OffloadingEvent,
    medium="CPU",
    new_request=lambda: None,
)
