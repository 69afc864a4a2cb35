"""Replay KV-cache offloading workloads through an ``OffloadingManager`` and measure it.

The library behind ``python -m kvcache replay`` (see ``docs/replay.md``):

* :mod:`~kvcache.replay.workload` -- the built-in multi-turn chat generator;
* :mod:`~kvcache.replay.trace` -- Mooncake JSONL traces;
* :mod:`~kvcache.replay.driver` -- the replay semantics (one fixed call sequence for all managers);
* :mod:`~kvcache.replay.backends` -- vLLM's manager, ours, and the null baseline;
* :mod:`~kvcache.replay.runner` -- timing against the null baseline, the policy x capacity grid;
* :mod:`~kvcache.replay.compare` -- decision-by-decision comparison of two managers;
* :mod:`~kvcache.replay.report` -- table, JSON and plot.

Importing this package never imports vLLM or torch; the ``vllm`` backend does, when asked for.
"""

from kvcache.replay.backends import (
    BACKENDS,
    POLICIES,
    Backend,
    NullManager,
    get_backend,
    kvcache_backend,
    null_backend,
    rust_policies_backend,
    vllm_backend,
)
from kvcache.replay.compare import Comparison, compare_decisions
from kvcache.replay.driver import Decision, ReplayRun, replay
from kvcache.replay.errors import BackendUnavailable, ConfigError, ReplayError, TraceError
from kvcache.replay.runner import (
    CapacitySpec,
    Row,
    Timing,
    compare_backends,
    parse_capacities,
    parse_policies,
    run_grid,
    time_backend,
    time_backends,
)
from kvcache.replay.trace import DEFAULT_TRACE_BLOCK_TOKENS, load_mooncake_trace
from kvcache.replay.workload import SyntheticChat, Workload, make_key, synthetic_chat

__all__ = [
    "BACKENDS",
    "DEFAULT_TRACE_BLOCK_TOKENS",
    "POLICIES",
    "Backend",
    "BackendUnavailable",
    "CapacitySpec",
    "Comparison",
    "ConfigError",
    "Decision",
    "NullManager",
    "ReplayError",
    "ReplayRun",
    "Row",
    "SyntheticChat",
    "Timing",
    "TraceError",
    "Workload",
    "compare_backends",
    "compare_decisions",
    "get_backend",
    "kvcache_backend",
    "load_mooncake_trace",
    "make_key",
    "null_backend",
    "parse_capacities",
    "parse_policies",
    "replay",
    "run_grid",
    "rust_policies_backend",
    "synthetic_chat",
    "time_backend",
    "time_backends",
    "vllm_backend",
]
