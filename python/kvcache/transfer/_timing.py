"""The timing harness of ``kvcache transfer bench`` and of the GPU check scripts in ``gpu/``.

They measure on the machine that runs the installed wheel, so the harness lives here, in the
package, not beside the scripts. Each caller keeps its own statistic (median or best) and its
own number of runs; what they share is how one run is timed: the device drained before the
clock starts and, for a plain call, again before it stops, so that queued work of an earlier
run is never counted and asynchronous work of this one always is.

Needs no torch itself: a caller passes the synchronising function of its device
(:func:`device_sync`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def _nothing() -> None:
    pass


def device_sync(torch: Any, device: Any) -> Callable[[], None]:
    """What drains ``device``'s queued work: ``torch.cuda.synchronize`` on a CUDA device,
    nothing on the CPU (its copies have finished when they return)."""
    if torch.device(device).type != "cuda":
        return _nothing
    return lambda: torch.cuda.synchronize(device)


def gb_per_s(nbytes: float, seconds: float) -> float:
    """Bandwidth in GB/s (10^9 bytes per second)."""
    return nbytes / seconds / 1e9


def timed(fn: Callable[[], object], sync: Callable[[], None] = _nothing) -> float:
    """Wall seconds of one call of ``fn`` and the device work it queued."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def repeat(
    fn: Callable[[], object],
    runs: int,
    *,
    warmup: int = 0,
    sync: Callable[[], None] = _nothing,
) -> list[float]:
    """:func:`timed` seconds of ``runs`` calls, after ``warmup`` calls timed the same way and
    dropped (kernel compilation, page faults, first-touch allocation)."""
    times = [timed(fn, sync) for _ in range(warmup + runs)]
    return times[warmup:]


@dataclass(frozen=True)
class JobTime(Generic[R]):
    """One submitted job: wall seconds from submission to completion, wall seconds inside
    the submit call, and (when asked for) the CPU seconds inside it, of the calling thread
    and of the whole process (copy threads included); ``result`` is what completion
    returned."""

    wall_s: float
    submit_s: float
    submit_thread_s: float | None
    submit_process_s: float | None
    result: R


def time_job(
    submit: Callable[[], T],
    complete: Callable[[T], R],
    *,
    sync: Callable[[], None] = _nothing,
    cpu: bool = False,
) -> JobTime[R]:
    """Times ``complete(submit())``, the device drained first. The completion is the caller's
    (an engine's ``wait``, a worker's ``get_finished``), so the clock stops when the job is
    done as the caller sees it. ``cpu`` also reads the thread's and the process's CPU clocks
    around the submit call (they cost a system call each, so only where they are reported)."""
    sync()
    c0 = time.thread_time() if cpu else 0.0
    p0 = time.process_time() if cpu else 0.0
    t0 = time.perf_counter()
    job = submit()
    t1 = time.perf_counter()
    thread_s = time.thread_time() - c0 if cpu else None
    process_s = time.process_time() - p0 if cpu else None
    result = complete(job)
    t2 = time.perf_counter()
    return JobTime(t2 - t0, t1 - t0, thread_s, process_s, result)


class Budget:
    """A run's clock: seconds since it started, and whether its time budget is spent (the
    caller then skips the remaining measurements)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over(self) -> bool:
        return self.elapsed() > self.seconds
