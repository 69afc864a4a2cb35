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

Capacities (chunk counts, percentages of the workload's unique blocks, bytes) are resolved and
clamped by :mod:`kvcache.replay.capacity`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvcache.replay.backends import BOUND_POLICY, Backend
from kvcache.replay.baseline import null_backend
from kvcache.replay.capacity import Capacity, CapacitySpec, resolve_capacities
from kvcache.replay.compare import Comparison, compare_decisions
from kvcache.replay.driver import DEFAULT_OPTIONS, ReplayOptions, ReplayRun, replay
from kvcache.replay.errors import ConfigError, ReplayError
from kvcache.replay.workload import Workload

__all__ = [
    "ProgressFactory",
    "Row",
    "Timing",
    "compare_backends",
    "grid_runs",
    "run_grid",
    "time_backend",
    "time_backends",
    "warm_up",
]

#: Requests of the workload's head that the warm-up replays (see the module docstring).
WARM_UP_REQUESTS = 200

#: ``progress_for(label)`` is called once before each replay that reports progress (every timed
#: replay of a real backend, every recording replay of a comparison; not the null replays nor
#: the warm-up) and returns that replay's ``progress(done, total)`` callback, or None.
ProgressFactory = Callable[[str], Callable[[int, int], None] | None]


def _chunks(n: int) -> str:
    return f"{n:,} chunk" + ("" if n == 1 else "s")


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
    options: ReplayOptions = DEFAULT_OPTIONS,
    repeat: int = 1,
    progress_for: ProgressFactory | None = None,
) -> tuple[ReplayRun, Timing]:
    """Replay ``repeat`` times against ``backend`` and against its null twin, interleaved."""
    [result] = time_backends(
        [backend],
        workload,
        policy=policy,
        num_chunks=num_chunks,
        options=options,
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
    options: ReplayOptions = DEFAULT_OPTIONS,
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
    firsts: list[ReplayRun | None] = [None] * len(backends)
    nulls: list[Backend | None] = [None] * len(backends)
    manager_times: list[list[int]] = [[] for _ in backends]
    null_times: list[list[int]] = [[] for _ in backends]
    for _ in range(repeat):
        for i, backend in enumerate(backends):
            label = f"{backend.name} {policy} {_chunks(num_chunks)}"
            progress = progress_for(label) if progress_for else None
            with _steady_gc():
                run = replay(
                    backend,
                    workload,
                    policy=policy,
                    num_chunks=num_chunks,
                    options=options,
                    progress=progress,
                )
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
                null_run = replay(
                    null, workload, policy=policy, num_chunks=num_chunks, options=options
                )
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
    capacity: Capacity
    run: ReplayRun
    timing: Timing
    options: ReplayOptions
    reference: Timing | None = None
    comparison: Comparison | None = None
    #: The offline bound's hit ratio at the same capacity, when the grid ran it.
    bound_hit_ratio: float | None = None
    #: Where the requests' retention hints came from (``Workload.hint_source``; None: none).
    hints: str | None = None

    @property
    def of_bound(self) -> float | None:
        """This row's hit ratio as a fraction of the bound's (None without the bound)."""
        if self.bound_hit_ratio is None:
            return None
        if self.bound_hit_ratio == 0:
            return 1.0 if self.run.hit_ratio == 0 else None
        return self.run.hit_ratio / self.bound_hit_ratio

    @property
    def capacity_spec(self) -> str:
        """The ``--capacity`` item as given."""
        return self.capacity.spec

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` row."""
        run, timing = self.run, self.timing
        row: dict[str, Any] = {
            "backend": run.backend,
            "vllm_semantics": run.semantics,
            "policy": run.policy,
            "capacity": run.num_chunks,
            "capacity_spec": self.capacity.spec,
            "capacity_requested": self.capacity.requested,
            "capacity_bytes": self.capacity.bytes,
            "workload": self.workload,
            "hints": self.hints,
            "requests": run.requests,
            "lookups": run.lookups,
            "hits": run.hits,
            "misses": run.misses,
            "hit_ratio": run.hit_ratio,
            "stored": run.stored,
            "evicted": run.evicted,
            "failed_prepares": run.failed_prepares,
            "reoffers": run.reoffers,
            "store_jobs": run.store_jobs,
            "failed_stores": run.failed_stores,
            "failed_store_keys": run.failed_store_keys,
            "lookup_stops": run.stops,
            "lag": self.options.lag,
            "fail_store_every": self.options.fail_store_every,
            "preempt_every": self.options.preempt_every,
            "store_threshold": self.options.store_threshold,
            "events": self.options.drain_events,
            "of_bound": self.of_bound,
            # The bound's replay includes the driver telling it the future: not a manager cost.
            "ns_per_visit": None if run.policy == BOUND_POLICY else timing.ns_per_visit,
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


def grid_runs(
    *, policies: int, capacities: int, repeat: int = 1, reference: bool = False, bounds: int = 0
) -> int:
    """How many times :func:`run_grid` calls its ``progress_for``: the replays that report
    progress (timed replays of each backend, and with a reference two recording replays).
    ``bounds`` of the ``policies`` are the offline bound, which is never compared."""
    per_cell = repeat * (2 if reference else 1) + (2 if reference else 0)
    return (policies - bounds) * capacities * per_cell + bounds * capacities * repeat


def run_grid(
    workload: Workload,
    backend: Backend,
    *,
    policies: Sequence[str],
    capacities: Sequence[CapacitySpec | Capacity],
    options: ReplayOptions = DEFAULT_OPTIONS,
    repeat: int = 1,
    reference: Backend | None = None,
    progress_for: ProgressFactory | None = None,
) -> list[Row]:
    """Time ``backend`` for every policy x capacity; with ``reference``, time and compare it too.

    ``backend`` and ``reference`` are timed interleaved (see :func:`time_backends`).
    The comparison uses separate, untimed replays that record decision logs (events on), so the
    timed replays carry no recording cost. Capacities that are not resolved yet are resolved
    against the workload (clamped to its unique blocks, without a block size).
    """
    resolved = resolve_capacities(capacities, unique_blocks=workload.unique_blocks)
    both = [backend] if reference is None else [backend, reference]
    rows = []
    online = [p for p in policies if p != BOUND_POLICY]
    warm_up(both, workload, online, num_chunks=max(c.chunks for c in resolved), options=options)
    for policy in policies:
        # The offline bound has no counterpart in vLLM: it is never compared.
        backends = both[:1] if policy == BOUND_POLICY else both
        for capacity in resolved:
            timed = time_backends(
                backends,
                workload,
                policy=policy,
                num_chunks=capacity.chunks,
                options=options,
                repeat=repeat,
                progress_for=progress_for,
            )
            run, timing = timed[0]
            row = Row(
                workload=workload.name,
                capacity=capacity,
                run=run,
                timing=timing,
                options=options,
                hints=workload.hint_source,
            )
            if reference is not None and policy != BOUND_POLICY:
                row.reference = timed[1][1]
                row.comparison = compare_backends(
                    reference,
                    backend,
                    workload,
                    policy=policy,
                    num_chunks=capacity.chunks,
                    options=options,
                    progress_for=progress_for,
                )
            rows.append(row)
    bounds = {r.run.num_chunks: r.run.hit_ratio for r in rows if r.run.policy == BOUND_POLICY}
    for row in rows:
        row.bound_hit_ratio = bounds.get(row.run.num_chunks)
    return rows


def warm_up(
    backends: Sequence[Backend],
    workload: Workload,
    policies: Sequence[str],
    *,
    num_chunks: int,
    options: ReplayOptions = DEFAULT_OPTIONS,
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
            replay(backend, head, policy=policy, num_chunks=num_chunks, options=options)


def compare_backends(
    expected: Backend,
    actual: Backend,
    workload: Workload,
    *,
    policy: str,
    num_chunks: int,
    options: ReplayOptions = DEFAULT_OPTIONS,
    progress_for: ProgressFactory | None = None,
) -> Comparison:
    """Record both backends' decisions on ``workload`` and compare them step by step."""
    logs = []
    for backend in (expected, actual):
        progress = (
            progress_for(f"{backend.name} {policy} {_chunks(num_chunks)}, recording")
            if progress_for
            else None
        )
        run = replay(
            backend,
            workload,
            policy=policy,
            num_chunks=num_chunks,
            options=options,
            record=True,
            progress=progress,
        )
        assert run.decisions is not None
        logs.append(run.decisions)
    return compare_decisions(logs[0], logs[1], expected_name=expected.name, actual_name=actual.name)
