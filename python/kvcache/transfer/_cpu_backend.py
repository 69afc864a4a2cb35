"""The CPU backend of ``TransferEngine``: copies between CPU tensors and the host pool in Rust,
so the engine's API runs (and is tested) on machines without a GPU."""

from __future__ import annotations

from typing import Any

from kvcache import _core
from kvcache.transfer._jobs import QUEUES, JobResult, Queue


class CpuBackend:
    """Copies in Rust on one worker thread per queue (GIL released), each in submission order."""

    def __init__(self, *, execute: bool = True) -> None:
        """``execute=False`` builds every job's runs (on the copy threads) without copying:
        the planning cost alone, for benchmarks."""
        self._copiers = {q: _core.CpuCopier(execute=execute) for q in QUEUES}
        self._plans: dict[int, tuple[int, bool]] = {}
        self.jobs_by_method = {"cpu": 0}

    def submit(self, job_id: int, plan: _core.Plan, queue: Queue) -> None:
        self._copiers[queue].submit(job_id, plan)
        self._plans[job_id] = (plan.logical_nbytes, queue == "store")
        self.jobs_by_method["cpu"] += 1

    def collect(self) -> list[JobResult]:
        out = []
        for copier in self._copiers.values():
            for job_id, ok, seconds, error in copier.poll():
                nbytes, store = self._plans.pop(job_id)
                out.append(JobResult(job_id, ok, nbytes, seconds, store, error))
        return out

    def wait(self, job_ids: set[int] | None) -> None:
        ids = None if job_ids is None else list(job_ids)
        for copier in self._copiers.values():
            copier.wait(ids)

    def in_flight(self) -> int:
        return sum(c.in_flight() for c in self._copiers.values())

    def close(self) -> None:
        for copier in self._copiers.values():
            copier.shutdown()

    def describe(self) -> dict[str, Any]:
        return {"backend": "cpu"}

    def check_methods(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("cpu",), ("cpu",)
