"""kvcache's retention-hint counters in vLLM's offloading metrics (0.33.0 and 0.34.0).

kvcache's manager reports, with vLLM's own figures, how many requests arrived with a retention
hint, how many hints it ignored (unreadable: see ``kvcache._hints``) and how many reads hit
chunks a hint kept (``turn`` only). They travel as counters in vLLM's
``OffloadingConnectorStats`` and reach Prometheus through the metric definitions the spec
declares (vLLM's frontend refuses a stats key no definition names). The names follow vLLM's
own (``vllm:kv_offload_...``): vLLM unregisters and re-creates only metrics named ``vllm:``
when it builds its Prometheus logger again, and ``LLM.get_metrics()`` lists only those.
"""

from __future__ import annotations

from typing import Any, Final

from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingMetricMetadata

__all__ = [
    "HINTED_REQUESTS",
    "HINT_KEPT_HITS",
    "HINT_METRICS",
    "IGNORED_HINTS",
    "add_hint_counts",
    "hint_metric_definitions",
]

HINTED_REQUESTS: Final = "vllm:kv_offload_kvcache_hinted_requests"
IGNORED_HINTS: Final = "vllm:kv_offload_kvcache_ignored_hints"
HINT_KEPT_HITS: Final = "vllm:kv_offload_kvcache_hint_kept_hits"
#: In the order of the manager's ``_take_stats()`` hint figures.
HINT_METRICS: Final = (HINTED_REQUESTS, IGNORED_HINTS, HINT_KEPT_HITS)

_DOCUMENTATION: Final = {
    HINTED_REQUESTS: "Requests that reached kvcache's offloading manager with a retention hint.",
    IGNORED_HINTS: (
        "Retention hints kvcache's offloading manager could not read and ignored (malformed, "
        "of an unknown version or oversized); each kind of mistake is logged once."
    ),
    HINT_KEPT_HITS: (
        "Reads of offloaded chunks kvcache's turn policy kept only because a retention hint "
        "said their conversation continues."
    ),
}


def hint_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The counters' definitions, for a spec's ``build_metric_definitions``."""
    return {
        name: OffloadingCounterMetadata(documentation=_DOCUMENTATION[name]) for name in HINT_METRICS
    }


def add_hint_counts(stats: Any, counts: tuple[int, int, int]) -> None:
    """Adds the manager's hint figures since its last stats to vLLM's ``stats`` (only those
    that are not 0: a deployment without hints reports exactly vLLM's metrics)."""
    for name, count in zip(HINT_METRICS, counts, strict=True):
        if count:
            stats.increase_counter(name, count)
