"""``kvcache.OffloadingManager``: vLLM 0.33.0's CPU offloading manager, in Rust, without vLLM.

Same methods, arguments and decisions as ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager``
(results use kvcache's look-alike types from ``kvcache._types``). For vLLM itself use
``kvcache.vllm.CPUOffloadingManager``, which returns vLLM's own types.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache._core import OffloadingManager as _RustManager
from kvcache._types import RESULT_TYPES

__all__ = ["ManagerStats", "OffloadingManager"]


@dataclass(frozen=True)
class ManagerStats:
    """Usage since the last ``get_stats`` call (the figures vLLM reports as metrics)."""

    usage: float  # chunks pinned by transfers / all chunks
    write_usage: float  # chunks with a store in flight / all chunks
    read_usage: float  # chunks pinned by loads / all chunks
    allocation_sizes: list[int]  # chunks allocated by each prepare_store
    stores_skipped: int | None  # stores below store_threshold (None when it is off)


class OffloadingManager(_RustManager):
    """Tracks offloaded chunks and decides loads, stores and evictions (LRU or ARC).

    Args:
        num_chunks: chunk slots in host memory.
        cache_policy: ``"lru"`` or ``"arc"``.
        enable_events: collect stored/removed events for ``take_events()``.
        store_threshold: offers a key needs before it is stored (< 2: store at once).
        max_tracker_size: keys the ``store_threshold`` tracker remembers.
    """

    _result_types = RESULT_TYPES

    def __new__(
        cls,
        num_chunks: int,
        cache_policy: str = "lru",
        *,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
    ) -> OffloadingManager:
        return super().__new__(
            cls,
            num_chunks,
            cache_policy,
            None,
            enable_events=enable_events,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
        )

    def get_stats(self) -> ManagerStats:
        usage, write, read, sizes, skipped = self._take_stats()
        return ManagerStats(usage, write, read, list(sizes), skipped)

    def __repr__(self) -> str:
        return (
            f"OffloadingManager(num_chunks={self.num_chunks}, "
            f"cache_policy={self.cache_policy!r}, resident={len(self)})"
        )
