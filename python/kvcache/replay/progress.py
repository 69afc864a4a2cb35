"""A progress bar for a replay grid: which run of how many, and how long the rest will take.

One tqdm bar for the whole grid, counted in replayed requests: its description names the run
(``run 3/16: kvcache lru 8,858 chunks``) and tqdm supplies the time left. The driver calls the
per-run callback about 50 times per replay, inside the timed loop, so the bar must cost next to
nothing there: tqdm redraws at most every ``MININTERVAL`` seconds, and a call that does not
redraw costs well under a microsecond. rich's bar costs ~18x more per redraw and redraws from a
thread of its own, which would take the GIL from the timed replay (``bench/progress_cost.py``
measures both); tqdm's monitor thread is switched off for the same reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["MININTERVAL", "GridProgress", "RunLines"]

#: Seconds between redraws of the bar.
MININTERVAL = 0.5


class GridProgress:
    """``progress_for`` for :func:`kvcache.replay.runner.run_grid` that draws one bar.

    ``runs`` is the number of replays that will report (:func:`~kvcache.replay.runner.grid_runs`),
    ``requests`` the workload's request count (each replay reports that many).
    """

    def __init__(self, *, runs: int, requests: int, stream: TextIO) -> None:
        from tqdm import tqdm

        class _Bar(tqdm):  # type: ignore[misc]
            monitor_interval = 0  # no monitor thread: it would take the GIL from timed replays

        self._runs = runs
        self._requests = max(requests, 1)
        self._started = 0
        self._bar: Any = _Bar(
            total=runs * self._requests,
            file=stream,
            mininterval=MININTERVAL,
            unit="req",
            unit_scale=True,
            dynamic_ncols=True,
            leave=False,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}",
        )

    @property
    def started(self) -> int:
        """How many runs have started so far."""
        return self._started

    def __call__(self, label: str) -> Callable[[int, int], None]:
        self._started += 1
        base = (self._started - 1) * self._requests
        bar = self._bar
        bar.set_description_str(f"run {self._started}/{self._runs}: {label}", refresh=False)

        def update(done: int, total: int) -> None:
            # Runs report `total` == the workload's request count; position = base + done.
            bar.update(base + done - bar.n)

        return update

    def close(self) -> None:
        self._bar.close()


class RunLines:
    """``progress_for`` for a stream that is not a terminal (a log, a CI job): one short line
    per finished run, so a long grid is not silent. Between lines it costs one comparison per
    progress call."""

    def __init__(self, *, runs: int, stream: TextIO, prog: str = "kvcache replay") -> None:
        self._runs = runs
        self._stream = stream
        self._prog = prog
        self._started = 0

    @property
    def started(self) -> int:
        """How many runs have started so far."""
        return self._started

    def __call__(self, label: str) -> Callable[[int, int], None]:
        self._started += 1
        position = f"run {self._started}/{self._runs}"
        start = time.perf_counter()

        def update(done: int, total: int) -> None:
            if done == total:
                elapsed = time.perf_counter() - start
                self._stream.write(f"{self._prog}: {position} done in {elapsed:.1f} s: {label}\n")
                self._stream.flush()

        return update

    def close(self) -> None:
        pass
