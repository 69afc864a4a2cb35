"""The types every part of ``TransferEngine`` shares: a finished job, the copy modes, the
queues, and what a backend (CPU or CUDA) must offer the engine. A leaf: it imports nothing of
the engine, so each backend and the engine import it and not each other."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

if TYPE_CHECKING:
    from kvcache import _core

CopyMode = Literal["auto", "kernel", "dma"]
Queue = Literal["store", "load", "expedited"]
QUEUES: tuple[Queue, ...] = ("store", "load", "expedited")


class JobResult(NamedTuple):
    """One finished job."""

    job_id: int
    success: bool
    #: Bytes as vLLM's worker reports them (a padded page counts its payload only).
    nbytes: int
    #: Seconds the copies took (device time on CUDA, copy-thread time on CPU); None if unknown.
    seconds: float | None
    store: bool
    #: Why the job failed (None on success).
    error: str | None


class Backend(Protocol):
    """What runs the engine's planned jobs: copies on CPU threads or on CUDA streams."""

    def submit(self, job_id: int, plan: _core.Plan, queue: Queue) -> None: ...

    def collect(self) -> list[JobResult]: ...

    def wait(self, job_ids: set[int] | None) -> None: ...

    def in_flight(self) -> int: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...

    def check_methods(self) -> tuple[tuple[str, ...], tuple[str, ...]]: ...

    #: Jobs each copy method ran so far (see TransferEngine.jobs_by_method).
    @property
    def jobs_by_method(self) -> dict[str, int]: ...
