"""``kvcache.OffloadingManager``: vLLM's CPU offloading manager, in Rust, without vLLM.

Same methods, arguments and decisions as ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager``
of vLLM 0.33.0 or 0.34.0 (``vllm_semantics``; results use kvcache's look-alike types from
``kvcache._types``). For vLLM itself use
``kvcache.vllm.CPUOffloadingManager``, which returns vLLM's own types.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache._core import OffloadingManager as _RustManager
from kvcache._semantics import resolve_semantics
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
    hinted_requests: int = 0  # requests that arrived with a retention hint
    ignored_hints: int = 0  # retention hints that could not be read (see kvcache._hints)
    hint_kept_hits: int = 0  # reads of chunks kept because of a hint (turn; 0 for lru, arc)


class OffloadingManager(_RustManager):
    """Tracks offloaded chunks and decides loads, stores and evictions (LRU, ARC or turn).

    Args:
        num_chunks: chunk slots in host memory.
        cache_policy: ``"lru"``, ``"arc"`` or ``"turn"`` (or the class name).
        enable_events: collect stored/removed events for ``take_events()``.
        store_threshold: offers a key needs before it is stored (< 2: store at once).
        max_tracker_size: keys the ``store_threshold`` tracker remembers.
        vllm_semantics: the vLLM release whose decisions to reproduce, ``"0.33"`` or
            ``"0.34"``; None (default): the installed vLLM's, else the newest. They differ
            in how ``store_threshold`` counts a key the same request offers again (0.34:
            once per request), in ``removal_expected`` on stored events, and in ``touch``
            (0.34 has none: it raises ``UnsupportedOperationError``).
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
        vllm_semantics: str | None = None,
    ) -> OffloadingManager:
        return super().__new__(
            cls,
            num_chunks,
            cache_policy,
            None,
            enable_events=enable_events,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            vllm_semantics=resolve_semantics(vllm_semantics),
        )

    def get_stats(self) -> ManagerStats:
        usage, write, read, sizes, skipped, (hinted, ignored, kept) = self._take_stats()
        return ManagerStats(usage, write, read, list(sizes), skipped, hinted, ignored, kept)

    def __repr__(self) -> str:
        return (
            f"OffloadingManager(num_chunks={self.num_chunks}, "
            f"cache_policy={self.cache_policy!r}, vllm_semantics={self.vllm_semantics!r}, "
            f"resident={len(self)})"
        )
