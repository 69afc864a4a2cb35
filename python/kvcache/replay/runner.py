"""Run the experiment grid (policy x capacity), time it against the null baseline, compare.

Timing. The figure of merit is the time spent *inside the manager*. A replay's wall time also
holds the driver's own Python work (building request contexts, recording key positions, the
lookup loop, bookkeeping), which is the same for every manager and would otherwise hide the
difference between a slow and a fast one. So every timed replay of a real backend is paired with
a replay of the same workload against :class:`~kvcache.replay.backends.NullManager`, which repeats
the real run's answers and keeps no state, in the same process, right after it:

    ns per key visit = (min over repeats of t_real - min over repeats of t_null) / lookups

Both are measured with ``time.perf_counter_ns`` around the request loop only, after a full
``gc.collect()`` and with the pre-existing heap frozen (``gc.freeze``, as vLLM does after start-up)
so that a collection of the workload itself does not land in one run and not the other.

Before anything is timed, :func:`run_grid` replays the first requests of the workload once per
backend and policy, untimed: lazy imports (numpy, on the first store spec), first calls through
each code path and the allocator's first growth would otherwise land in the first timed row.

Capacities are given as chunk counts (``4096``) or as percentages of the workload's unique blocks
(``10%``: ``round(0.10 * unique_blocks)`` chunks).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvcache.replay.backends import POLICIES, Backend, null_backend
from kvcache.replay.compare import Comparison, compare_decisions
from kvcache.replay.driver import ReplayRun, replay
from kvcache.replay.errors import ConfigError, ReplayError
from kvcache.replay.workload import Workload

__all__ = [
    "CapacitySpec",
    "Row",
    "Timing",
    "compare_backends",
    "parse_capacities",
    "parse_policies",
    "run_grid",
    "time_backend",
    "time_backends",
    "warm_up",
]

#: Requests of the workload's head that the warm-up replays (see the module docstring).
WARM_UP_REQUESTS = 200

#: ``progress_for(label)`` returns a ``progress(done, total)`` callback, or None for no progress.
ProgressFactory = Callable[[str], Callable[[int, int], None] | None]


@dataclass(frozen=True, slots=True)
class CapacitySpec:
    """One ``--capacity`` item: a chunk count, or a percentage of the unique blocks."""

    text: str
    chunks: int | None = None
    percent: float | None = None

    def resolve(self, unique_blocks: int) -> int:
        """The capacity in chunks for a workload with ``unique_blocks`` distinct keys."""
        if self.chunks is not None:
            return self.chunks
        assert self.percent is not None
        chunks = round(self.percent / 100.0 * unique_blocks)
        if chunks < 1:
            raise ConfigError(
                f"capacity {self.text} of {unique_blocks} unique blocks is less than one chunk"
            )
        return chunks


def parse_capacities(text: str) -> list[CapacitySpec]:
    """Parse ``"10%,50%,4096"``; anything not a positive count or percentage is a ConfigError."""
    specs = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise ConfigError(f"empty item in --capacity {text!r}")
        if item.endswith("%"):
            try:
                percent = float(item[:-1])
            except ValueError:
                raise ConfigError(
                    f"malformed capacity {item!r} (expected e.g. 10% or 4096)"
                ) from None
            if not math.isfinite(percent) or percent <= 0:
                raise ConfigError(f"capacity must be > 0, not {item!r}")
            specs.append(CapacitySpec(item, percent=percent))
        else:
            try:
                chunks = int(item)
            except ValueError:
                raise ConfigError(
                    f"malformed capacity {item!r} (expected e.g. 10% or 4096)"
                ) from None
            if chunks <= 0:
                raise ConfigError(f"capacity must be > 0, not {item!r}")
            specs.append(CapacitySpec(item, chunks=chunks))
    return specs


def parse_policies(text: str) -> list[str]:
    """Parse ``"lru,arc"`` (case-insensitive, duplicates dropped); unknown names: ConfigError."""
    policies: list[str] = []
    for raw in text.split(","):
        name = raw.strip().lower()
        if name not in POLICIES:
            raise ConfigError(f"unknown policy {raw.strip()!r} (choose from {', '.join(POLICIES)})")
        if name not in policies:
            policies.append(name)
    return policies


@contextmanager
def _steady_gc() -> Iterator[None]:
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """Best-of-``repeat`` times of a backend and of its null baseline, in ns."""

    manager_ns: int
    null_ns: int
    lookups: int
    repeat: int

    @property
    def inside_ns(self) -> int:
        """Time inside the manager: the real replay minus the null replay."""
        return self.manager_ns - self.null_ns

    @property
    def ns_per_visit(self) -> float:
        return self.inside_ns / self.lookups if self.lookups else 0.0


def time_backend(
    backend: Backend,
    workload: Workload,
    *,
    policy: str,
    num_chunks: int,
    lag: int = 8,
    fail_store_every: int = 0,
    drain_events: bool = False,
    repeat: int = 1,
    progress_for: ProgressFactory | None = None,
) -> tuple[ReplayRun, Timing]:
    """Replay ``repeat`` times against ``backend`` and against its null twin, interleaved."""
    [result] = time_backends(
        [backend],
        workload,
        policy=policy,
        num_chunks=num_chunks,
        lag=lag,
        fail_store_every=fail_store_every,
        drain_events=drain_events,
        repeat=repeat,
        progress_for=progress_for,
    )
    return result


def time_backends(
    backends: Sequence[Backend],
    workload: Workload,
    *,
    policy: str,
    num_chunks: int,
    lag: int = 8,
    fail_store_every: int = 0,
    drain_events: bool = False,
    repeat: int = 1,
    progress_for: ProgressFactory | None = None,
) -> list[tuple[ReplayRun, Timing]]:
    """Time several backends on one configuration, each paired with its null twin.

    Each repeat runs every backend and then its null replay before the next repeat starts, so a
    slow drift of the machine's speed hits all of them alike rather than whichever ran last.
    Every repeat must reproduce the first run's counters (a manager that decides differently on
    the same input is a bug worth stopping for), and so must the null replay (or it did not
    follow the same path and the subtraction would be meaningless).
    """
    if repeat < 1:
        raise ConfigError(f"repeat must be >= 1, not {repeat}")
    options: dict[str, Any] = {
        "policy": policy,
        "num_chunks": num_chunks,
        "lag": lag,
        "fail_store_every": fail_store_every,
        "drain_events": drain_events,
    }
    firsts: list[ReplayRun | None] = [None] * len(backends)
    nulls: list[Backend | None] = [None] * len(backends)
    manager_times: list[list[int]] = [[] for _ in backends]
    null_times: list[list[int]] = [[] for _ in backends]
    for _ in range(repeat):
        for i, backend in enumerate(backends):
            label = f"{backend.name} {policy} {num_chunks} chunks"
            progress = progress_for(label) if progress_for else None
            with _steady_gc():
                run = replay(backend, workload, progress=progress, **options)
            manager_times[i].append(run.elapsed_ns)
            first = firsts[i]
            if first is None:
                first = firsts[i] = run
                nulls[i] = null_backend(backend, workload, run.script)
            elif run.counters() != first.counters():
                raise ReplayError(
                    f"{backend.name} {policy} capacity {num_chunks}: a repeat decided "
                    f"differently ({run.counters()} vs {first.counters()})"
                )
            null = nulls[i]
            assert null is not None
            with _steady_gc():
                null_run = replay(null, workload, **options)
            if null_run.counters() != first.counters():
                raise AssertionError("the null manager did not reproduce the recorded run")
            null_times[i].append(null_run.elapsed_ns)
    results = []
    for first, m_times, n_times in zip(firsts, manager_times, null_times, strict=True):
        assert first is not None
        timing = Timing(
            manager_ns=min(m_times),
            null_ns=min(n_times),
            lookups=workload.key_visits,
            repeat=repeat,
        )
        results.append((first, timing))
    return results


@dataclass(slots=True, kw_only=True)
class Row:
    """One policy x capacity result, with the vLLM reference when compared."""

    workload: str
    capacity_spec: str
    run: ReplayRun
    timing: Timing
    lag: int
    reference: Timing | None = None
    comparison: Comparison | None = None

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` row."""
        run, timing = self.run, self.timing
        row: dict[str, Any] = {
            "backend": run.backend,
            "policy": run.policy,
            "capacity": run.num_chunks,
            "capacity_spec": self.capacity_spec,
            "workload": self.workload,
            "requests": run.requests,
            "lookups": run.lookups,
            "hits": run.hits,
            "misses": run.misses,
            "hit_ratio": run.hit_ratio,
            "stored": run.stored,
            "evicted": run.evicted,
            "failed_prepares": run.failed_prepares,
            "store_jobs": run.store_jobs,
            "failed_stores": run.failed_stores,
            "failed_store_keys": run.failed_store_keys,
            "lookup_stops": run.stops,
            "lag": self.lag,
            "ns_per_visit": timing.ns_per_visit,
            "manager_ns": timing.manager_ns,
            "null_ns": timing.null_ns,
            "repeat": timing.repeat,
        }
        if self.reference is not None:
            row["vllm_ns_per_visit"] = self.reference.ns_per_visit
            row["speedup"] = self.speedup
        if self.comparison is not None:
            row["matched"] = self.comparison.matched
            row["divergence"] = self.comparison.divergence
        return row

    @property
    def speedup(self) -> float | None:
        """vLLM's time inside the manager over ours (None if not compared or not measurable)."""
        if self.reference is None or self.timing.inside_ns <= 0:
            return None
        return self.reference.inside_ns / self.timing.inside_ns


def run_grid(
    workload: Workload,
    backend: Backend,
    *,
    policies: Sequence[str],
    capacities: Sequence[CapacitySpec],
    lag: int = 8,
    fail_store_every: int = 0,
    drain_events: bool = False,
    repeat: int = 1,
    reference: Backend | None = None,
    progress_for: ProgressFactory | None = None,
) -> list[Row]:
    """Time ``backend`` for every policy x capacity; with ``reference``, time and compare it too.

    ``backend`` and ``reference`` are timed interleaved (see :func:`time_backends`).
    The comparison uses separate, untimed replays that record decision logs (events on), so the
    timed replays carry no recording cost.
    """
    resolved = [(spec, spec.resolve(workload.unique_blocks)) for spec in capacities]
    rows = []
    common: dict[str, Any] = {
        "lag": lag,
        "fail_store_every": fail_store_every,
    }
    warm_up(
        [backend] if reference is None else [backend, reference],
        workload,
        policies,
        num_chunks=max(n for _, n in resolved),
        **common,
    )
    for policy in policies:
        for spec, num_chunks in resolved:
            timed = time_backends(
                [backend] if reference is None else [backend, reference],
                workload,
                policy=policy,
                num_chunks=num_chunks,
                drain_events=drain_events,
                repeat=repeat,
                progress_for=progress_for,
                **common,
            )
            run, timing = timed[0]
            row = Row(
                workload=workload.name,
                capacity_spec=spec.text,
                run=run,
                timing=timing,
                lag=lag,
            )
            if reference is not None:
                row.reference = timed[1][1]
                row.comparison = compare_backends(
                    reference,
                    backend,
                    workload,
                    policy=policy,
                    num_chunks=num_chunks,
                    progress_for=progress_for,
                    **common,
                )
            rows.append(row)
    return rows


def warm_up(
    backends: Sequence[Backend],
    workload: Workload,
    policies: Sequence[str],
    *,
    num_chunks: int,
    lag: int = 8,
    fail_store_every: int = 0,
) -> None:
    """Replay the workload's first :data:`WARM_UP_REQUESTS` requests once per backend and
    policy, untimed, with ``num_chunks`` chunks (the grid's largest capacity: a manager sizes
    its tables by it, so the allocator grows once, here)."""
    head = Workload.from_requests(
        f"{workload.name} (warm-up)",
        workload.requests[:WARM_UP_REQUESTS],
        block_tokens=workload.block_tokens,
    )
    for backend in backends:
        for policy in policies:
            replay(
                backend,
                head,
                policy=policy,
                num_chunks=num_chunks,
                lag=lag,
                fail_store_every=fail_store_every,
            )


def compare_backends(
    expected: Backend,
    actual: Backend,
    workload: Workload,
    *,
    policy: str,
    num_chunks: int,
    lag: int = 8,
    fail_store_every: int = 0,
    progress_for: ProgressFactory | None = None,
) -> Comparison:
    """Record both backends' decisions on ``workload`` and compare them step by step."""
    logs = []
    for backend in (expected, actual):
        progress = (
            progress_for(f"{backend.name} {policy} {num_chunks} chunks, recording")
            if progress_for
            else None
        )
        run = replay(
            backend,
            workload,
            policy=policy,
            num_chunks=num_chunks,
            lag=lag,
            fail_store_every=fail_store_every,
            record=True,
            progress=progress,
        )
        assert run.decisions is not None
        logs.append(run.decisions)
    return compare_decisions(logs[0], logs[1], expected_name=expected.name, actual_name=actual.name)
