"""The CUDA backend of ``TransferEngine``: DMA queues, the copy kernel, and the one function
that chooses between them (:meth:`CudaBackend.choose`).

Per queue (store, load, expedited load): a DMA stream fed by a Rust thread
(``_core.CudaQueue``: the caller records an event on its current stream and returns; the thread
builds the runs and enqueues one batched copy, or one copy per run), and a stream for jobs the
copy kernel runs (loads whose DMA runs would be small), launched on the caller's thread from
per-block tables. Jobs of one queue run in submission order whichever method runs them: a DMA
job after kernel jobs makes its stream wait for the kernel stream; a job the kernel would run
while DMA jobs of its queue are still waiting for the queue's thread goes to DMA too (its copies
could not be ordered after theirs without waiting for the thread), and otherwise the kernel
stream waits for the DMA stream.

Faults. An illegal or misaligned access on the device loses the CUDA context for the whole
process: nothing can fall back after one. So the kernel is never launched unless every address
it can compute is proven in bounds and 8-byte aligned beforehand (``TransferLayout.kernel_problem``
for the geometry, ``Plan.write_block_table`` for each job's indices), and a fault that happens
anyway is reported as what it is: the job fails, one ERROR names it, and the engine refuses
every later job (:attr:`CudaBackend.lost`). A kernel that fails to *launch* for another reason
(Triton cannot compile here) fails its job, says so in a WARNING, and later jobs use DMA.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kvcache import _core
from kvcache._core import InvalidArgumentError, TransferError
from kvcache.transfer._cuda import SRC_ACCESS_ORDER_ANY, SRC_ACCESS_ORDER_STREAM
from kvcache.transfer._jobs import QUEUES, CopyMode, JobResult, Queue

if TYPE_CHECKING:
    import torch

    from kvcache.transfer._calibrate import Calibration
    from kvcache.transfer._cuda import CudaRuntime

logger = logging.getLogger("kvcache.transfer._engine")

# The kernel/DMA cut-off for loads when it is not calibrated: vLLM 0.33.0's fixed threshold,
# tuned on one H100. It is compared with the job's average bytes per DMA run after coalescing
# (counted from the block ids, see CudaBackend.choose): the number of runs, not the page size,
# is what limits DMA.
DEFAULT_KERNEL_MAX_RUN_BYTES = 28 * 1024
# The smallest batch worth a kernel launch.
DEFAULT_KERNEL_MIN_RUNS = 16
# Programs (thread blocks) of the copy kernel: enough PCIe requests in flight without taking
# every SM away from the model.
DEFAULT_KERNEL_PROGRAMS = 32

# Words of a launch failure's message that mean the device faulted (the context is lost), as
# torch and Triton word CUDA's sticky errors.
_FAULT_WORDS = ("illegal memory access", "illegal address", "misaligned", "unspecified launch")


class KernelLauncher(Protocol):
    """Enqueues the copy kernel for one group of a job on the current stream."""

    def launch(
        self,
        plan: _core.Plan,
        group: int,
        num_blocks: int,
        refs: list[tuple[int, int, int, int, int]],
        *,
        to_device: bool,
        programs: int,
        max_page_bytes: int,
    ) -> tuple[Any, ...]:
        """Returns what must stay alive until the kernel has run (its tables)."""
        ...


class TritonLauncher:
    """The Triton kernel (``_kernel.py``): a pinned per-block table uploaded asynchronously, a
    per-tensor table kept on the device."""

    def __init__(self, device: torch.device) -> None:
        from kvcache.transfer import _kernel  # noqa: F401  (Triton must import here)

        self._device = device
        self._refs_dev: dict[int, Any] = {}

    def launch(
        self,
        plan: _core.Plan,
        group: int,
        num_blocks: int,
        refs: list[tuple[int, int, int, int, int]],
        *,
        to_device: bool,
        programs: int,
        max_page_bytes: int,
    ) -> tuple[Any, ...]:
        import torch

        from kvcache.transfer import _kernel

        # Pinned so that the upload is asynchronous; a host device (tests under Triton's
        # interpreter) reads the table in place and has nothing to pin with.
        pinned = self._device.type == "cuda"
        host = torch.empty(3 * num_blocks, dtype=torch.int64, pin_memory=pinned)
        plan.write_block_table(group, host.numpy())  # proves every index in bounds first
        table = host.to(self._device, non_blocking=True)
        refs_dev = self._refs_dev.get(group)
        if refs_dev is None:
            refs_dev = torch.tensor(refs, dtype=torch.int64).reshape(-1).to(self._device)
            self._refs_dev[group] = refs_dev
        _kernel.launch(
            table,
            refs_dev,
            num_blocks,
            to_device=to_device,
            programs=programs,
            max_page_bytes=max_page_bytes,
        )
        return (host, table)


@dataclass
class _KernelJob:
    job_id: int
    plan: _core.Plan
    start: Any  # an event (timing), or None when submission failed before recording
    end: Any
    ok: bool
    error: str | None
    keep: tuple[Any, ...] = field(default=())  # tables the kernel reads


class CudaBackend:
    """See the module docs. ``runtime``, ``cuda`` (a ``torch.cuda`` stand-in) and ``launcher``
    let tests run the backend over the fake CUDA runtime of ``tests/support/fakecuda``; by
    default the real ones are used. ``calibrate(device)`` measures the load cut-off when none
    is given (``TransferEngine`` passes its own, which builds scratch engines; None: the
    default)."""

    def __init__(
        self,
        device: torch.device,
        pool: _core.HostChunkPool,
        layout: _core.TransferLayout,
        *,
        copy: CopyMode,
        kernel_max_run_bytes: int | None,
        kernel_min_runs: int,
        kernel_programs: int,
        runtime: CudaRuntime | None = None,
        cuda: Any = None,
        launcher: KernelLauncher | None = None,
        calibrate: Callable[[torch.device], Calibration | None] | None = None,
    ) -> None:
        import torch

        from kvcache.transfer import _cuda

        rt = runtime if runtime is not None else _cuda.runtime()
        if rt is None:
            raise TransferError("CUDA layers given but the CUDA runtime is not available")
        self._rt = rt
        self._cuda = torch.cuda if cuda is None else cuda
        self._device = device
        self._device_index = device.index if device.index is not None else 0
        self._pool = pool
        self._layout = layout
        self._copy = copy
        #: Why the kernel is off for this engine (None: Triton is there and has not failed).
        self._kernel_off: str | None = "copy='dma'" if copy == "dma" else None
        self._launcher: KernelLauncher | None = launcher
        if self._kernel_off is None and launcher is None:
            try:
                self._launcher = TritonLauncher(device)
            except Exception as exc:
                logger.warning("Triton unavailable: all GPU copies use DMA", exc_info=True)
                self._kernel_off = f"Triton unavailable ({type(exc).__name__})"
        # Per group: the kernel's tensor table and its largest page, and why its geometry
        # cannot take the kernel (an address or size that is not a multiple of 8; None: it can).
        self._refs: list[tuple[list[tuple[int, int, int, int, int]], int]] = []
        self._geometry_problem: list[str | None] = []
        for g in range(layout.num_groups):
            rows = layout.group_refs(g)
            self._refs.append((rows, max((row[4] for row in rows), default=0)))
            self._geometry_problem.append(layout.kernel_problem(g))
        if copy == "kernel":
            # A pool still pinning in the background is accepted: its jobs use DMA until the
            # pinning has finished, then the kernel.
            if self._kernel_off is not None:
                raise InvalidArgumentError(f"copy='kernel' needs Triton: {self._kernel_off}")
            problem = self.kernel_blocker(range(layout.num_groups), pool=False)
            if problem is not None:
                raise InvalidArgumentError(f"copy='kernel' is impossible here: {problem}")
            if not self._pool_kernel_ready() and self._pool_state() != "pinning":
                raise InvalidArgumentError(
                    "copy='kernel' needs a pool pinned with pin=True, 'auto' or 'background'"
                )
        self.calibration: Calibration | None = None
        if kernel_max_run_bytes is None:
            kernel_max_run_bytes = DEFAULT_KERNEL_MAX_RUN_BYTES
            measurable = copy == "auto" and self._kernel_off is None and cuda is None
            if measurable and calibrate is not None:
                self.calibration = calibrate(device)
                if self.calibration is not None:
                    kernel_max_run_bytes = self.calibration.kernel_max_run_bytes
        self.kernel_max_run_bytes = kernel_max_run_bytes
        self._kernel_min_runs = kernel_min_runs
        self._kernel_programs = kernel_programs
        with self._cuda.device(device):
            self._streams = {q: self._cuda.Stream(device) for q in QUEUES}
            self._kernel_streams = {q: self._cuda.Stream(device) for q in QUEUES}
        self._dma = {
            q: _core.CudaQueue(rt.api, self._streams[q].cuda_stream, self._device_index)
            for q in QUEUES
        }
        self._kernel_jobs: dict[Queue, deque[_KernelJob]] = {q: deque() for q in QUEUES}
        # job id -> (bytes as vLLM counts them, store?) for DMA jobs in flight.
        self._sizes: dict[int, tuple[int, bool]] = {}
        self._kernel_launched = 0
        #: Why the queues went from batched copies to one copy per run (None: they did not).
        self.batch_stopped: str | None = None
        #: Why the CUDA context is unusable (a device fault): no job is accepted any more.
        self.lost: str | None = None

    # --- state ---------------------------------------------------------------------------

    def _pool_state(self) -> str:
        status = getattr(self._pool, "pin_status", None)
        return str(status()["state"]) if status is not None else "unpinned"

    def _pool_kernel_ready(self) -> bool:
        ready = getattr(self._pool, "kernel_ready", None)
        if ready is not None:
            return bool(ready)
        return bool(self._pool.pinned and getattr(self._pool, "device_can_use_host_pointer", 0))

    def _lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            logger.error("%s; the CUDA context is lost, this engine refuses new jobs", reason)

    @property
    def jobs_by_method(self) -> dict[str, int]:
        """Jobs each method put on the device so far: one batched DMA call, one DMA call per
        run, or the copy kernel (a DMA job counts once its queue's thread has enqueued it)."""
        batched = per_run = 0
        for q in QUEUES:
            b, p = self._dma[q].jobs_by_method()
            batched += b
            per_run += p
        return {"dma-batched": batched, "dma-per-run": per_run, "kernel": self._kernel_launched}

    def describe(self) -> dict[str, Any]:
        if self.batch_stopped is not None:
            dma = f"per-run ({self.batch_stopped})"
        elif self._rt.batched:
            dma = "batched"
        else:
            dma = "per-run (the driver has no cuMemcpyBatchAsync)"
        blocker = self.kernel_blocker(range(self._layout.num_groups), pool=False)
        return {
            "backend": "cuda",
            "dma": dma,
            "copy": self._copy,
            "kernel": "enabled" if blocker is None else f"off: {blocker}",
            "kernel_max_run_bytes": self.kernel_max_run_bytes if blocker is None else 0,
            "calibrated": self.calibration is not None,
            "lost": self.lost,
        }

    # --- the choice of copy method -------------------------------------------------------

    def kernel_blocker(self, groups: Iterable[int], *, pool: bool = True) -> str | None:
        """Why the copy kernel may not run a job touching ``groups`` (None: it may). Every
        kernel decision asks this: :meth:`choose` per job, :meth:`check_methods` (the methods
        the start-up self-check tries) for every group, so production never uses a method
        the self-check did not try. ``pool=False`` leaves out the pool's pinning state, which
        the self-check meets with a scratch pool of its own."""
        if self._kernel_off is not None:
            return self._kernel_off
        if self._copy == "auto" and self.kernel_max_run_bytes <= 0:
            return "the load cut-off is 0"
        for g in groups:
            problem = self._geometry_problem[g]
            if problem is not None:
                return f"group {g}: {problem}"
        if pool and not self._pool_kernel_ready():
            return "the pool is not pinned (yet), or the device cannot use its host addresses"
        return None

    def check_methods(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The copy methods jobs may use: (stores, loads)."""
        kernel = self.kernel_blocker(range(self._layout.num_groups), pool=False) is None
        stores = ("dma", "kernel") if kernel and self._copy == "kernel" else ("dma",)
        loads = ("dma", "kernel") if kernel else ("dma",)
        return stores, loads

    def choose(self, plan: _core.Plan, queue: Queue) -> Literal["kernel", "dma"]:
        """The copy method of one job. Stores use DMA (bandwidth-bound: the copy engines beat
        SMs and leave them to the model) unless ``copy='kernel'``; a load uses the kernel when
        its DMA runs would be small: at least ``kernel_min_runs`` pages and an average run
        after coalescing of at most ``kernel_max_run_bytes``. Either needs
        :meth:`kernel_blocker` to find nothing, and no DMA job of its queue still waiting for
        the queue's thread (the kernel's copies could not be ordered after those)."""
        if self._dma[queue].queued() or not self.suits_kernel(plan):
            return "dma"
        return "kernel"

    def suits_kernel(self, plan: _core.Plan) -> bool:
        """Whether the kernel may and should run ``plan`` whatever its queue's state (the
        part of :meth:`choose` that depends on the job alone)."""
        if plan.num_pages == 0:
            return False
        groups = [g for g, n in enumerate(plan.group_blocks) if n]
        if self.kernel_blocker(groups) is not None:
            return False
        if self._copy == "kernel":
            return True
        if plan.store or plan.num_pages < self._kernel_min_runs:
            return False
        # Runs are never smaller than pages: the per-page average settles large pages cheaply.
        if plan.nbytes > plan.num_pages * self.kernel_max_run_bytes:
            return False
        # Average bytes per DMA run after coalescing (at least, as max_runs is an upper bound):
        # counted from the block ids in Rust, without building the runs on this thread.
        return bool(plan.nbytes <= plan.max_runs * self.kernel_max_run_bytes)

    # --- submission ----------------------------------------------------------------------

    def submit(self, job_id: int, plan: _core.Plan, queue: Queue) -> None:
        if self.lost is not None:
            raise TransferError(f"the transfer engine refuses new jobs: {self.lost}")
        if self.choose(plan, queue) == "kernel":
            self._submit_kernel(job_id, plan, queue)
            return
        if self._kernel_jobs[queue]:
            with self._cuda.device(self._device):
                self._streams[queue].wait_stream(self._kernel_streams[queue])
        order = SRC_ACCESS_ORDER_STREAM if plan.store else SRC_ACCESS_ORDER_ANY
        current = self._cuda.current_stream(self._device).cuda_stream
        dma = self._dma[queue]
        try:
            dma.submit(job_id, plan, current, order)
        except TransferError:
            lost = dma.context_lost()
            if lost is None:
                raise
            self._lose(f"the {queue} queue: {lost}")
            raise TransferError(f"the transfer engine refuses new jobs: {self.lost}") from None
        self._sizes[job_id] = (plan.logical_nbytes, plan.store)

    def _launch(self, plan: _core.Plan) -> tuple[Any, ...]:
        assert self._launcher is not None
        keep: list[Any] = []
        for group, n in enumerate(plan.group_blocks):
            if n == 0:
                continue
            rows, biggest = self._refs[group]
            keep += self._launcher.launch(
                plan,
                group,
                n,
                rows,
                to_device=not plan.store,
                programs=self._kernel_programs,
                max_page_bytes=biggest,
            )
        return tuple(keep)

    def _submit_kernel(self, job_id: int, plan: _core.Plan, queue: Queue) -> None:
        cuda = self._cuda
        stream = self._kernel_streams[queue]
        start = end = None
        keep: tuple[Any, ...] = ()
        error = None
        try:
            with cuda.device(self._device):
                stream.wait_stream(cuda.current_stream(self._device))
                if self._dma[queue].in_flight():
                    # After this queue's DMA jobs (all on their stream: see choose).
                    stream.wait_stream(self._streams[queue])
                with cuda.stream(stream):
                    start = cuda.Event(enable_timing=True)
                    end = cuda.Event(enable_timing=True)
                    start.record(stream)
                    keep = self._launch(plan)
                    end.record(stream)
            self._kernel_launched += 1
        except Exception as exc:
            error = f"the copy kernel could not be launched: {type(exc).__name__}: {exc}"
            start = end = None
            code = self._rt.clear_error()
            if _core.CudaApi.is_sticky(code) or any(w in str(exc).lower() for w in _FAULT_WORDS):
                self._lose(f"the copy kernel of job {job_id} faulted ({error})")
            elif self._copy == "auto":
                self._kernel_off = f"the copy kernel failed to launch for job {job_id}"
                logger.warning("%s (%s); later jobs use DMA", self._kernel_off, error)
            if self.lost is None:
                try:
                    stream.synchronize()  # nothing of this job may still run when we drop it
                except Exception as sync_exc:
                    self._lose(f"the device reported an error after job {job_id}: {sync_exc}")
        self._kernel_jobs[queue].append(
            _KernelJob(job_id, plan, start, end, error is None, error, keep)
        )

    # --- completion ----------------------------------------------------------------------

    def _finish_kernel(self, job: _KernelJob, error: str | None) -> JobResult:
        job.plan.release()
        ok = job.ok and error is None
        seconds = None
        if ok and job.start is not None:
            try:
                seconds = job.start.elapsed_time(job.end) * 1e-3
            except Exception:
                seconds = None
        return JobResult(
            job.job_id, ok, job.plan.logical_nbytes, seconds, job.plan.store, job.error or error
        )

    def _report_batch_failures(self, queue: Queue, dma: _core.CudaQueue) -> None:
        for job_id, code, name, index, copies, stopped in dma.take_batch_failures():
            at = f"copy {index} of {copies}" if index is not None else f"one of {copies} copies"
            what = (
                f"cuMemcpyBatchAsync failed on the {queue} queue for job {job_id}: {name} "
                f"({code}) at {at}"
            )
            if stopped:
                if self.batch_stopped is None:
                    self.batch_stopped = f"{name} ({code}) at {at} of job {job_id}"
                logger.warning(
                    "%s; that job and every later one issue one cudaMemcpyAsync per run", what
                )
            else:
                logger.debug("%s while the pool is being pinned; that job went run by run", what)

    def collect(self) -> list[JobResult]:
        done: list[JobResult] = []
        for queue in QUEUES:
            dma = self._dma[queue]
            for job_id, ok, seconds, error in dma.poll():
                nbytes, store = self._sizes.pop(job_id)
                done.append(JobResult(job_id, ok, nbytes, seconds, store, error))
            self._report_batch_failures(queue, dma)
            lost = dma.context_lost()
            if lost is not None:
                self._lose(f"the {queue} queue: {lost}")
            jobs = self._kernel_jobs[queue]
            while jobs:
                job = jobs[0]
                error = None
                try:
                    finished = job.end is None or job.end.query()
                except Exception as exc:
                    finished, error = True, f"the device reported: {exc}"
                    self._lose(f"the device faulted during the copy kernel of job {job.job_id}")
                if not finished:
                    break  # jobs on one stream finish in order
                jobs.popleft()
                done.append(self._finish_kernel(job, error))
        return done

    def wait(self, job_ids: set[int] | None) -> None:
        ids = None if job_ids is None else list(job_ids)
        for queue in QUEUES:
            self._dma[queue].wait(ids)
            for job in list(self._kernel_jobs[queue]):
                if job.end is not None and (job_ids is None or job.job_id in job_ids):
                    try:
                        job.end.synchronize()
                    except Exception as exc:
                        job.ok = False
                        job.error = f"the device reported: {exc}"
                        job.end = None
                        self._lose(f"the device faulted during the copy kernel of job {job.job_id}")

    def stop_batching(self, reason: str) -> None:
        """Every later DMA job goes one copy per run (one WARNING says why)."""
        if not self._rt.batched or self.batch_stopped is not None:
            return
        for q in QUEUES:
            self._dma[q].stop_batching()
        self.batch_stopped = reason
        logger.warning("DMA issues one cudaMemcpyAsync per run from now on: %s", reason)

    def in_flight(self) -> int:
        return sum(self._dma[q].in_flight() + len(self._kernel_jobs[q]) for q in QUEUES)

    def close(self) -> None:
        for q in QUEUES:
            self._dma[q].shutdown()
        self.wait(None)
