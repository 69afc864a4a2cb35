"""``TransferEngine``: asynchronous chunk moves between KV-cache layers and a host pool."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self

import numpy as np

from kvcache import _core
from kvcache.transfer._cuda import MEMCPY_DEFAULT
from kvcache.transfer._pool import check_count

if TYPE_CHECKING:
    from types import TracebackType

    import torch

    from kvcache.transfer._cuda import Runtime

logger = logging.getLogger(__name__)

CopyMode = Literal["auto", "kernel", "dma"]

# Kernel vs DMA crossover (average bytes per run after coalescing) and the smallest batch worth
# a kernel launch. Starting points from published H100 figures, not measured on this project's
# hardware: `python -m kvcache.transfer bench` prints the measured crossover to set them from.
DEFAULT_KERNEL_MAX_RUN_BYTES = 32 * 1024
DEFAULT_KERNEL_MIN_RUNS = 16
# Programs (thread blocks) of the copy kernel: enough PCIe requests in flight without taking
# every SM away from the model.
DEFAULT_KERNEL_PROGRAMS = 32

_INT64_MAX = np.iinfo(np.int64).max


def as_ids(name: str, ids: object) -> np.ndarray:
    """A 1-d contiguous int64 copy-free view of ``ids`` when possible, else a typed error.

    Vectorised (no per-id Python work). Floats and bools are refused rather than truncated;
    integers beyond int64 are out of range (``IndexError``), like any other bad id.
    """
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a sequence of ints: {exc}") from exc
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-d, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype == object:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in arr.tolist()):
            raise TypeError(f"{name} must contain only ints")
        try:
            arr = np.asarray(arr.tolist(), dtype=np.int64)
        except OverflowError as exc:
            raise IndexError(f"{name} contains an id beyond int64") from exc
    elif arr.dtype.kind == "u":
        if int(arr.max()) > _INT64_MAX:
            raise IndexError(f"{name} contains an id beyond int64")
    elif arr.dtype.kind != "i":
        raise TypeError(f"{name} must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _layer_spec(t: torch.Tensor, index: int, *, host: bool) -> tuple[Any, ...]:
    """Describes one KV layer for ``_core.TransferLayout`` (see there)."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gpu_layers[{index}] is a {type(t).__name__}, not a torch.Tensor")
    if t.dim() == 0 or t.shape[0] == 0:
        raise ValueError(f"gpu_layers[{index}] needs a leading block dimension with blocks")
    if t[0].numel() == 0:
        raise ValueError(f"gpu_layers[{index}] has empty pages")
    if not t[0].is_contiguous():
        raise ValueError(f"gpu_layers[{index}]: each block's page must be contiguous")
    item = t.element_size()
    num_blocks = t.shape[0]
    page = t[0].numel() * item
    stride = t.stride(0) * item
    storage = t.untyped_storage()
    segment = storage.data_ptr()
    if not host:
        return (t.data_ptr(), stride, page, num_blocks, segment)
    # A (blocks, page bytes) uint8 view over the same storage; as_strided checks the bounds.
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    pages = flat.as_strided((num_blocks, page), (stride, 1), t.storage_offset() * item)
    return (pages.numpy(), segment)


class _Backend(Protocol):
    def submit(self, job_id: int, plan: _core.Plan, *, store: bool) -> None: ...

    def collect(self) -> list[tuple[int, bool]]: ...

    def wait(self, job_ids: set[int] | None) -> None: ...

    def in_flight(self) -> int: ...

    def close(self) -> None: ...


class _CpuBackend:
    """Copies in Rust on one worker thread (GIL released), in submission order."""

    def __init__(self) -> None:
        self._copier = _core.CpuCopier()

    def submit(self, job_id: int, plan: _core.Plan, *, store: bool) -> None:
        self._copier.submit(job_id, plan)

    def collect(self) -> list[tuple[int, bool]]:
        return self._copier.poll()

    def wait(self, job_ids: set[int] | None) -> None:
        self._copier.wait(None if job_ids is None else list(job_ids))

    def in_flight(self) -> int:
        return self._copier.in_flight()

    def close(self) -> None:
        self._copier.shutdown()


@dataclass
class _CudaJob:
    job_id: int
    plan: _core.Plan
    event: Any  # torch.cuda.Event, or None when submission failed before recording
    ok: bool
    keep: tuple[Any, ...] = field(default=())  # descriptor tensors used by the kernel


class _CudaBackend:
    """One stream per direction; each job is a batch of DMA copies or one kernel launch."""

    def __init__(
        self,
        device: torch.device,
        pool: _core.HostChunkPool,
        *,
        copy: CopyMode,
        kernel_max_run_bytes: int,
        kernel_min_runs: int,
        kernel_programs: int,
        runtime: Runtime | None = None,
        cuda: Any = None,
    ) -> None:
        """``runtime`` and ``cuda`` (a ``torch.cuda`` stand-in) let tests drive the stream and
        event bookkeeping without a GPU; by default the real ones are used."""
        import torch

        from kvcache.transfer import _cuda

        rt = runtime if runtime is not None else _cuda.runtime()
        if rt is None:
            raise RuntimeError("CUDA layers given but the CUDA runtime is not available")
        self._rt: Runtime = rt
        self._torch = torch
        self._cuda = torch.cuda if cuda is None else cuda
        self._device = device
        self._pool = pool
        kernel_ok = bool(pool.pinned and getattr(pool, "device_can_use_host_pointer", False))
        if copy == "kernel" and not kernel_ok:
            raise ValueError("copy='kernel' needs a pool pinned with pin=True or 'auto'")
        self._kernel_allowed = copy != "dma" and kernel_ok and self._triton_available()
        if copy == "kernel" and not self._kernel_allowed:
            raise ValueError("copy='kernel' needs Triton")
        self._copy = copy
        self._kernel_max_run_bytes = kernel_max_run_bytes
        self._kernel_min_runs = kernel_min_runs
        self._kernel_programs = kernel_programs
        with self._cuda.device(device):
            self._streams = {True: self._cuda.Stream(device), False: self._cuda.Stream(device)}
        self._queues: dict[bool, deque[_CudaJob]] = {True: deque(), False: deque()}

    @staticmethod
    def _triton_available() -> bool:
        try:
            from kvcache.transfer import _kernel  # noqa: F401
        except Exception:
            logger.warning("Triton unavailable: all GPU copies use DMA", exc_info=True)
            return False
        return True

    def _use_kernel(self, plan: _core.Plan) -> bool:
        if not self._kernel_allowed or plan.alignment < 8:
            return False
        if self._copy == "kernel":
            return True
        runs = len(plan)
        return runs >= self._kernel_min_runs and plan.nbytes <= runs * self._kernel_max_run_bytes

    def _enqueue(
        self, plan: _core.Plan, stream: Any, *, kernel: bool
    ) -> tuple[bool, tuple[Any, ...]]:
        torch = self._torch
        if len(plan) == 0:
            return True, ()
        if kernel:
            from kvcache.transfer import _kernel

            n = plan.num_pieces(_kernel.PIECE_BYTES)
            host = torch.empty(3 * n, dtype=torch.int64, pin_memory=True)
            plan.write_runs(host.numpy(), _kernel.PIECE_BYTES)
            dev = host.to(self._device, non_blocking=True)
            _kernel.launch(dev, n, programs=self._kernel_programs, max_run_bytes=plan.max_run_bytes)
            return True, (host, dev)
        issued, err = _core._cuda_memcpy_runs(
            plan, self._rt.memcpy_async, stream.cuda_stream, MEMCPY_DEFAULT
        )
        if err:
            self._rt.clear_error()
            logger.error(
                "cudaMemcpyAsync failed after %d of %d runs: %s",
                issued,
                len(plan),
                self._rt.error_string(err),
            )
            return False, ()
        return True, ()

    def submit(self, job_id: int, plan: _core.Plan, *, store: bool) -> None:
        cuda = self._cuda
        stream = self._streams[store]
        event = None
        ok = False
        keep: tuple[Any, ...] = ()
        kernel = self._use_kernel(plan)
        try:
            with cuda.device(self._device):
                # A store reads KV the model may still be writing; a load overwrites blocks
                # whose previous users may still be queued. Both wait for the current stream.
                stream.wait_stream(cuda.current_stream(self._device))
                with cuda.stream(stream):
                    ok, keep = self._enqueue(plan, stream, kernel=kernel)
                    event = cuda.Event()
                    event.record(stream)
        except Exception:
            logger.exception("submitting transfer job %d failed", job_id)
            ok = False
            event = None
            self._rt.clear_error()
            if kernel and self._copy == "auto":
                # Most likely Triton could not compile or launch here: keep working on DMA.
                self._kernel_allowed = False
                logger.warning("the copy kernel failed; later jobs use DMA")
            try:
                stream.synchronize()  # nothing of this job may still run when we drop it
            except Exception:
                logger.exception("synchronising the transfer stream failed")
        self._queues[store].append(_CudaJob(job_id, plan, event, ok, keep))

    def _finish(self, job: _CudaJob, ok: bool) -> tuple[int, bool]:
        job.plan.release()
        return (job.job_id, job.ok and ok)

    def collect(self) -> list[tuple[int, bool]]:
        done: list[tuple[int, bool]] = []
        for queue in self._queues.values():
            while queue:
                job = queue[0]
                try:
                    finished = job.event is None or job.event.query()
                    ok = True
                except Exception:
                    logger.exception("transfer job %d failed on the device", job.job_id)
                    finished, ok = True, False
                if not finished:
                    break  # jobs on one stream finish in order
                queue.popleft()
                done.append(self._finish(job, ok))
        return done

    def wait(self, job_ids: set[int] | None) -> None:
        for queue in self._queues.values():
            for job in list(queue):
                if job.event is not None and (job_ids is None or job.job_id in job_ids):
                    try:
                        job.event.synchronize()
                    except Exception:
                        logger.exception("transfer job %d failed on the device", job.job_id)
                        job.ok = False
                        job.event = None

    def in_flight(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def close(self) -> None:
        self.wait(None)


class TransferEngine:
    """Moves chunks between per-layer KV-cache tensors and a :class:`HostChunkPool`.

    ``gpu_layers`` are tensors whose first dimension is the block index, each block's page
    contiguous (any dtype; blocks may be strided apart). A chunk holds, for each layer in
    order, ``blocks_per_chunk`` consecutive pages (layer-major), so ``pool.chunk_bytes`` must
    equal ``blocks_per_chunk * sum(page bytes)``.

    ``store(gpu_block_ids, chunk_ids)`` and ``load(chunk_ids, gpu_block_ids)`` validate every id
    (``IndexError`` out of range, ``ValueError`` for wrong lengths or a destination named twice,
    ``TypeError`` for non-integers) before anything is copied, then return a job id at once.
    ``gpu_block_ids`` lists ``blocks_per_chunk`` blocks per chunk, in chunk order. Finished jobs
    are reported once by :meth:`poll` as ``(job_id, success)``; :meth:`wait` blocks without
    consuming them. A job reported ``False`` may have written part of its destination: treat
    all of its chunks (or blocks) as invalid. Until a job is reported, its destination must be
    neither read nor written, and its source not written.

    CUDA layers: copies run on two dedicated streams (one per direction, each in submission
    order) after the work already queued on the current stream. Pages contiguous on both sides
    are merged; small runs go through a Triton kernel that reads/writes pinned host memory
    directly, larger ones through ``cudaMemcpyAsync`` (``copy="kernel"``/``"dma"`` forces one).
    A pageable pool makes copies effectively synchronous (a CUDA limitation).

    CPU layers: the same API; copies run in Rust on a worker thread, one job after another.

    Not thread-safe: use an engine from one thread at a time.
    """

    def __init__(
        self,
        gpu_layers: Sequence[torch.Tensor],
        pool: _core.HostChunkPool,
        *,
        blocks_per_chunk: int = 1,
        copy: CopyMode = "auto",
        kernel_max_run_bytes: int = DEFAULT_KERNEL_MAX_RUN_BYTES,
        kernel_min_runs: int = DEFAULT_KERNEL_MIN_RUNS,
        kernel_programs: int = DEFAULT_KERNEL_PROGRAMS,
    ) -> None:
        self._closed = True  # until fully built, so __del__ has nothing to do
        import torch

        check_count("blocks_per_chunk", blocks_per_chunk)
        check_count("kernel_max_run_bytes", kernel_max_run_bytes)
        check_count("kernel_min_runs", kernel_min_runs)
        check_count("kernel_programs", kernel_programs)
        if copy not in ("auto", "kernel", "dma"):
            raise ValueError(f"copy must be 'auto', 'kernel' or 'dma', got {copy!r}")
        if not isinstance(pool, _core.HostChunkPool):
            raise TypeError(f"pool must be a HostChunkPool, got {type(pool).__name__}")
        if pool.closed:
            raise ValueError("the host chunk pool is closed")
        if isinstance(gpu_layers, torch.Tensor):
            raise TypeError("gpu_layers must be a sequence of tensors (one per layer)")
        layers = list(gpu_layers)
        if not layers:
            raise ValueError("gpu_layers is empty")
        for i, t in enumerate(layers):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"gpu_layers[{i}] is a {type(t).__name__}, not a torch.Tensor")
        devices = {t.device for t in layers}
        if len(devices) != 1:
            raise ValueError(f"all layers must be on one device, got {sorted(map(str, devices))}")
        (device,) = devices
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {device}")
        host = device.type == "cpu"
        specs = [_layer_spec(t, i, host=host) for i, t in enumerate(layers)]
        self._layout = _core.TransferLayout(pool, specs, blocks_per_chunk)
        self._backend: _Backend
        if host:
            self._backend = _CpuBackend()
        else:
            self._backend = _CudaBackend(
                device,
                pool,
                copy=copy,
                kernel_max_run_bytes=kernel_max_run_bytes,
                kernel_min_runs=kernel_min_runs,
                kernel_programs=kernel_programs,
            )
        self._layers = layers  # keeps device memory alive while jobs may use it
        self._pool = pool
        self._device = device
        self._blocks_per_chunk = blocks_per_chunk
        self._next_id = itertools.count()
        self._issued = 0
        self._unreported: set[int] = set()
        self._done: list[tuple[int, bool]] = []
        self._closed = False

    @property
    def pool(self) -> _core.HostChunkPool:
        return self._pool

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def blocks_per_chunk(self) -> int:
        return self._blocks_per_chunk

    @property
    def num_blocks(self) -> int:
        """Valid block ids are ``range(num_blocks)`` (the smallest layer's block count)."""
        return self._layout.num_blocks

    @property
    def closed(self) -> bool:
        return self._closed

    def store(self, gpu_block_ids: Iterable[int], chunk_ids: Iterable[int]) -> int:
        """Device blocks -> host chunks. Returns the job id."""
        return self._submit(True, gpu_block_ids, chunk_ids)

    def load(self, chunk_ids: Iterable[int], gpu_block_ids: Iterable[int]) -> int:
        """Host chunks -> device blocks. Returns the job id."""
        return self._submit(False, gpu_block_ids, chunk_ids)

    def plan(self, *, store: bool, gpu_block_ids: object, chunk_ids: object) -> _core.Plan:
        """Validates a request and returns its copy plan without running it (diagnostics:
        ``len(plan)`` runs after coalescing, ``plan.num_pages`` before). The plan keeps the
        pool from closing until it is dropped."""
        self._check_open()
        g = as_ids("gpu_block_ids", gpu_block_ids)
        c = as_ids("chunk_ids", chunk_ids)
        return self._layout.plan(store, g, c)

    def _submit(self, store: bool, gpu_block_ids: object, chunk_ids: object) -> int:
        plan = self.plan(store=store, gpu_block_ids=gpu_block_ids, chunk_ids=chunk_ids)
        job_id = next(self._next_id)
        self._backend.submit(job_id, plan, store=store)
        self._issued = job_id + 1
        self._unreported.add(job_id)
        return job_id

    def _collect(self) -> None:
        self._done.extend(self._backend.collect())

    def poll(self) -> list[tuple[int, bool]]:
        """Jobs finished since the last call, as ``(job_id, success)``; each reported once."""
        self._collect()
        done, self._done = self._done, []
        for job_id, _ in done:
            self._unreported.discard(job_id)
        return done

    def wait(self, job_ids: Iterable[int] | None = None) -> None:
        """Blocks until the given jobs (default: all) have finished; :meth:`poll` still
        reports them. Ids never issued by this engine raise ``ValueError``."""
        wanted: set[int] | None = None
        if job_ids is not None:
            wanted = set()
            for j in job_ids:
                if isinstance(j, bool) or not isinstance(j, int):
                    raise TypeError(f"job ids are ints, got {type(j).__name__}")
                if not 0 <= j < self._issued:
                    raise ValueError(f"job {j} was not issued by this engine")
                wanted.add(j)
            wanted &= self._unreported
            if not wanted:
                return
        self._backend.wait(wanted)
        self._collect()

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet finished."""
        return self._backend.in_flight()

    def close(self) -> None:
        """Waits for every job (results stay available to :meth:`poll`) and stops accepting
        new ones. Idempotent."""
        if self._closed:
            return
        self._backend.close()
        self._collect()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the transfer engine is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # Jobs still running must finish before their memory can be released.
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                logger.exception("closing a collected transfer engine failed")
