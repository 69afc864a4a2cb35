"""Replay KV-cache offloading workloads through an ``OffloadingManager`` and measure it.

The library behind ``kvcache replay`` (see ``docs/replay.md``):

* :mod:`~kvcache.replay.workload` -- the built-in multi-turn chat generator;
* :mod:`~kvcache.replay.trace` -- Mooncake JSONL traces;
* :mod:`~kvcache.replay.hints` -- retention hints: a trace's own, or synthesised from the
  workload's future (exact, partly wrong, random);
* :mod:`~kvcache.replay.driver` -- the replay semantics (one fixed call sequence for all
  managers) and its options;
* :mod:`~kvcache.replay.backends` -- vLLM's manager and ours, and the policy names;
* :mod:`~kvcache.replay.baseline` -- the null manager the timing subtracts;
* :mod:`~kvcache.replay.capacity` -- capacities in chunks, percentages or bytes;
* :mod:`~kvcache.replay.runner` -- timing against the null baseline, the policy x capacity grid;
* :mod:`~kvcache.replay.compare` -- decision-by-decision comparison of two managers;
* :mod:`~kvcache.replay.report` -- table, JSON, CSV and plot; :mod:`~kvcache.replay.meta` --
  what describes a run (versions, host, date).

Importing this package never imports vLLM or torch; the ``vllm`` backends do, when asked for.
"""

from kvcache.replay.backends import (
    BACKENDS,
    POLICIES,
    POLICY_CLASSES,
    REFERENCE_VLLM,
    Backend,
    get_backend,
    kvcache_backend,
    parse_policies,
    rust_policies_backend,
    vllm_backend,
)
from kvcache.replay.baseline import NullManager, null_backend
from kvcache.replay.capacity import (
    BlockSize,
    Capacity,
    CapacitySpec,
    kv_bytes_per_block,
    parse_capacities,
    parse_size,
    resolve_capacities,
)
from kvcache.replay.compare import Comparison, compare_decisions
from kvcache.replay.driver import Decision, ReplayOptions, ReplayRun, replay
from kvcache.replay.errors import BackendUnavailable, ConfigError, ReplayError, TraceError
from kvcache.replay.hints import HintMode, apply_hints, future_hints, parse_hint_mode
from kvcache.replay.runner import (
    Row,
    Timing,
    compare_backends,
    grid_runs,
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
    "POLICY_CLASSES",
    "REFERENCE_VLLM",
    "Backend",
    "BackendUnavailable",
    "BlockSize",
    "Capacity",
    "CapacitySpec",
    "Comparison",
    "ConfigError",
    "Decision",
    "HintMode",
    "NullManager",
    "ReplayError",
    "ReplayOptions",
    "ReplayRun",
    "Row",
    "SyntheticChat",
    "Timing",
    "TraceError",
    "Workload",
    "apply_hints",
    "compare_backends",
    "compare_decisions",
    "future_hints",
    "get_backend",
    "grid_runs",
    "kv_bytes_per_block",
    "kvcache_backend",
    "load_mooncake_trace",
    "make_key",
    "null_backend",
    "parse_capacities",
    "parse_hint_mode",
    "parse_policies",
    "parse_size",
    "replay",
    "resolve_capacities",
    "run_grid",
    "rust_policies_backend",
    "synthetic_chat",
    "time_backend",
    "time_backends",
    "vllm_backend",
]
