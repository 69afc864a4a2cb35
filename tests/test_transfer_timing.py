"""The timing harness shared by ``kvcache transfer bench`` and the GPU check scripts in gpu/:
what it calls, in which order, and what it counts (a scripted clock, no real timings)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvcache.transfer import _timing


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every clock read and sync appends to the returned log; perf_counter advances by 1 s
    per read, the CPU clocks by 10 s, so each interval says how many reads it spans."""
    log: list[str] = []
    wall = itertools.count()
    cpu = itertools.count(step=10)

    def perf_counter() -> float:
        log.append("clock")
        return float(next(wall))

    def cpu_clock(name: str) -> Any:
        def read() -> float:
            log.append(name)
            return float(next(cpu))

        return read

    monkeypatch.setattr(_timing.time, "perf_counter", perf_counter)
    monkeypatch.setattr(_timing.time, "thread_time", cpu_clock("thread"))
    monkeypatch.setattr(_timing.time, "process_time", cpu_clock("process"))
    return log


def test_a_timed_call_sits_between_two_syncs(clock: list[str]) -> None:
    seconds = _timing.timed(lambda: clock.append("fn"), lambda: clock.append("sync"))
    assert clock == ["sync", "clock", "fn", "sync", "clock"]
    assert seconds == 1.0


def test_repeat_drops_the_warmup_runs_and_keeps_the_rest(clock: list[str]) -> None:
    calls: list[int] = []
    times = _timing.repeat(lambda: calls.append(1), 3, warmup=2, sync=lambda: None)
    assert len(calls) == 5
    assert times == [1.0, 1.0, 1.0]
    assert clock.count("clock") == 10  # the warm-up runs are timed the same way


def test_time_job_times_submit_and_completion(clock: list[str]) -> None:
    def submit() -> str:
        clock.append("submit")
        return "job"

    def complete(job: str) -> int:
        clock.append(f"complete {job}")
        return 7

    done = _timing.time_job(submit, complete, sync=lambda: clock.append("sync"))
    assert clock == ["sync", "clock", "submit", "clock", "complete job", "clock"]
    assert (done.wall_s, done.submit_s, done.result) == (2.0, 1.0, 7)
    assert done.submit_thread_s is None
    assert done.submit_process_s is None


def test_time_job_reads_the_cpu_clocks_only_when_asked(clock: list[str]) -> None:
    done = _timing.time_job(lambda: clock.append("submit"), lambda _: True, cpu=True)
    # The wall clock brackets the submit call alone; the CPU clocks bracket it outside that.
    assert clock == ["thread", "process", "clock", "submit", "clock", "thread", "process", "clock"]
    assert (done.submit_thread_s, done.submit_process_s) == (20.0, 20.0)
    assert done.result is True


def test_gb_per_s() -> None:
    assert _timing.gb_per_s(3e9, 1.5) == 2.0


def test_budget(clock: list[str]) -> None:
    budget = _timing.Budget(2.0)  # started at 0
    assert budget.elapsed() == 1.0
    assert not budget.over()  # 2 s: not past the budget
    assert budget.over()  # 3 s


def test_device_sync_is_nothing_on_the_cpu() -> None:
    import torch

    sync = _timing.device_sync(torch, torch.device("cpu"))
    assert sync() is None
    assert sync is _timing.device_sync(torch, "cpu")
