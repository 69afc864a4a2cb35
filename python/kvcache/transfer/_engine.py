"""``TransferEngine``: asynchronous chunk moves between KV-cache tensors and a host pool."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Self

from kvcache import _core
from kvcache._core import (
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    PoolClosedError,
)
from kvcache.transfer._calibrate import Calibration, calibrate, round_trip
from kvcache.transfer._checks import bounded_list, check_count
from kvcache.transfer._cpu_backend import CpuBackend
from kvcache.transfer._cuda_backend import (
    DEFAULT_KERNEL_MIN_RUNS,
    DEFAULT_KERNEL_PROGRAMS,
    CudaBackend,
)
from kvcache.transfer._jobs import Backend, CopyMode, JobResult, Queue

if TYPE_CHECKING:
    from types import TracebackType

    import torch


logger = logging.getLogger(__name__)


def _reusable(value: Any, depth: int, name: str) -> Any:
    """``value`` with its one-shot iterators (generators, ``iter(...)``) turned into lists, down
    to ``depth`` levels of nesting: the engine reads ``groups``/``offsets`` twice (Rust checks
    them, then the scratch copy for the self-check is built from them). Anything else is left
    as given, so Rust still names a bad entry. An endless iterator is refused at the bound."""
    if isinstance(value, Iterator):
        value = bounded_list(name, value)
    if depth > 1 and isinstance(value, list | tuple):
        return [_reusable(item, depth - 1, name) for item in value]
    return value


def _layer_spec(t: torch.Tensor, index: int, *, host: bool) -> tuple[Any, ...]:
    """Describes one KV tensor for ``_core.TransferLayout`` (see there)."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"gpu_layers[{index}] is a {type(t).__name__}, not a torch.Tensor")
    if t.is_nested or t.layout != torch.strided:  # no pages at fixed strides to copy
        kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise InvalidArgumentError(f"gpu_layers[{index}] must be a dense tensor, got {kind}")
    if t.dim() == 0 or t.shape[0] == 0:
        raise InvalidArgumentError(f"gpu_layers[{index}] needs a leading block dimension")
    if t[0].numel() == 0:
        raise InvalidArgumentError(f"gpu_layers[{index}] has empty pages")
    if not t[0].is_contiguous():
        raise InvalidArgumentError(f"gpu_layers[{index}]: each block's page must be contiguous")
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


class TransferEngine:
    """Moves chunks between per-layer KV-cache tensors and a :class:`HostChunkPool`.

    ``gpu_layers`` are tensors whose first dimension is the block index, each block's page
    contiguous (any dtype; blocks may be strided apart). By default a chunk holds, for each
    layer in order, ``blocks_per_chunk`` consecutive pages (layer-major), so ``pool.chunk_bytes``
    must equal ``blocks_per_chunk * sum(page bytes)``, and every job moves whole chunks.

    KV-cache groups (``groups``): a list, per group, of ``(layer index, bytes per block)``
    references; a reference may copy less than the layer's page (a padded page moves its
    payload only), several groups may share a layer. ``offsets`` places each layer's segment
    inside a chunk (default: back to back); with either, ``pool.chunk_bytes`` only has to hold
    every segment. Jobs then name each group's blocks and where its first block sits
    (``group_sizes``, ``block_indices``: vLLM's ``GPULoadStoreSpec``), so a group may enter its
    first chunk part-way and end on a short chunk.

    ``store(gpu_block_ids, chunk_ids)`` and ``load(chunk_ids, gpu_block_ids)`` validate every id
    (``OutOfRangeError`` out of range, ``InvalidArgumentError`` for wrong counts or a
    destination named twice, ``InvalidTypeError`` for non-integers; all ``KvCacheError``
    subclasses and the matching builtins) before anything is copied, then return a job id at
    once. Finished jobs are reported once by :meth:`poll` as ``(job_id, success)`` or by
    :meth:`poll_results` with sizes and times; :meth:`wait` blocks without consuming them. A job
    reported failed may have written part of its destination: treat all of its chunks (or
    blocks) as invalid. Until a job is reported, its destination must be neither read nor
    written, and its source not written.

    Queues: stores, loads, and expedited loads (``load(..., expedited=True)``) each run in
    submission order on their own queue, so an expedited load never waits behind regular
    loads. CUDA layers: one stream per queue, each job after the work already queued on the
    current stream. Pages contiguous on both sides are merged. Stores use DMA; loads use a
    Triton kernel that reads pinned host memory directly when the job's DMA runs would be
    small (average bytes per run after coalescing, counted from the block ids, at most
    ``kernel_max_run_bytes``, chosen per device by a short calibration unless given) and DMA
    otherwise; DMA is one ``cuMemcpyBatchAsync`` per job where the driver has it, else one
    ``cudaMemcpyAsync`` per run. ``copy="kernel"``/``"dma"`` forces one method. A pageable pool
    makes copies effectively synchronous (a CUDA limitation).

    CPU layers: the same API; copies run in Rust on one thread per queue.

    Not thread-safe: use an engine from one thread at a time.
    """

    def __reduce__(self) -> Any:
        # Its pool, queues and threads live in this process only; a shallow copy would be a
        # second engine driving the same queues.
        _core._refuse_pickling(self)

    def __init__(
        self,
        gpu_layers: Sequence[torch.Tensor],
        pool: _core.HostChunkPool,
        *,
        blocks_per_chunk: int = 1,
        groups: Sequence[Sequence[tuple[int, int]]] | None = None,
        offsets: Sequence[int] | None = None,
        copy: CopyMode = "auto",
        kernel_max_run_bytes: int | None = None,
        kernel_min_runs: int = DEFAULT_KERNEL_MIN_RUNS,
        kernel_programs: int = DEFAULT_KERNEL_PROGRAMS,
        log_failures: bool = True,
    ) -> None:
        self._closed = True  # until fully built, so __del__ has nothing to do
        import torch

        check_count("blocks_per_chunk", blocks_per_chunk)
        if kernel_max_run_bytes is not None:
            if isinstance(kernel_max_run_bytes, bool) or not isinstance(kernel_max_run_bytes, int):
                raise InvalidTypeError("kernel_max_run_bytes must be an int or None")
            if kernel_max_run_bytes < 0:
                raise InvalidArgumentError("kernel_max_run_bytes must be >= 0")
        check_count("kernel_min_runs", kernel_min_runs)
        check_count("kernel_programs", kernel_programs)
        if copy not in ("auto", "kernel", "dma"):
            raise InvalidArgumentError(f"copy must be 'auto', 'kernel' or 'dma', got {copy!r}")
        if not isinstance(pool, _core.HostChunkPool):
            raise InvalidTypeError(f"pool must be a HostChunkPool, got {type(pool).__name__}")
        if pool.closed:
            raise PoolClosedError("the host chunk pool is closed")
        if isinstance(gpu_layers, torch.Tensor):
            raise InvalidTypeError("gpu_layers must be a sequence of tensors (one per layer)")
        layers = bounded_list("gpu_layers", gpu_layers)
        if not layers:
            raise InvalidArgumentError("gpu_layers is empty")
        for i, t in enumerate(layers):
            if not isinstance(t, torch.Tensor):
                raise InvalidTypeError(
                    f"gpu_layers[{i}] is a {type(t).__name__}, not a torch.Tensor"
                )
        devices = {t.device for t in layers}
        if len(devices) != 1:
            raise InvalidArgumentError(
                f"all layers must be on one device, got {sorted(map(str, devices))}"
            )
        (device,) = devices
        if device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"unsupported device {device}")
        host = device.type == "cpu"
        specs = [_layer_spec(t, i, host=host) for i, t in enumerate(layers)]
        # groups and offsets are checked in Rust (typed errors naming the bad entry).
        groups, offsets = _reusable(groups, 3, "groups"), _reusable(offsets, 1, "offsets")
        self._layout = _core.TransferLayout(pool, specs, blocks_per_chunk, groups, offsets)
        self._grouped = groups is not None or offsets is not None
        # What a scratch copy of this engine needs (see self_check).
        self._pages = [int(t[0].numel() * t.element_size()) for t in layers]
        self._group_refs = (
            [[(int(t), int(n)) for t, n in refs] for refs in groups]
            if groups is not None
            else [[(i, p) for i, p in enumerate(self._pages)]]
        )
        self._offsets = (
            [int(o) for o in offsets]
            if offsets is not None
            else [blocks_per_chunk * sum(self._pages[:i]) for i in range(len(layers))]
        )
        self._copy = copy
        self._backend: Backend
        if host:
            self._backend = CpuBackend()
        else:
            self._backend = CudaBackend(
                device,
                pool,
                self._layout,
                copy=copy,
                kernel_max_run_bytes=kernel_max_run_bytes,
                kernel_min_runs=kernel_min_runs,
                kernel_programs=kernel_programs,
                calibrate=_calibrate,
            )
        self._layers = layers  # keeps device memory alive while jobs may use it
        self._pool = pool
        self._report_pinning = getattr(pool, "report_pinning", None)
        self._device = device
        self._blocks_per_chunk = blocks_per_chunk
        self._log_failures = log_failures
        self._issued = 0
        self._unreported: set[int] = set()
        self._done: list[JobResult] = []
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
    def num_groups(self) -> int:
        return self._layout.num_groups

    @property
    def num_blocks(self) -> int:
        """Valid block ids are ``range(num_blocks)`` (the smallest layer's block count)."""
        return self._layout.num_blocks

    @property
    def closed(self) -> bool:
        return self._closed

    def describe(self) -> dict[str, Any]:
        """How copies run: ``backend`` (cpu/cuda) and, on CUDA, the DMA method and the
        kernel/DMA cut-off for loads."""
        if self._report_pinning is not None:
            self._report_pinning()
        return self._backend.describe()

    @property
    def jobs_by_method(self) -> dict[str, int]:
        """How many jobs each copy method ran so far: on CUDA ``"dma-batched"`` (one
        ``cuMemcpyBatchAsync``), ``"dma-per-run"`` (one ``cudaMemcpyAsync`` per run, where the
        driver has no batched call or it failed) and ``"kernel"``; on CPU ``"cpu"``. A DMA job
        counts once its queue's thread has put it on the stream. The method depends on the
        queue's state and the driver as well as on the job, so these counts, not a guess from
        the job's shape, say which method ran a job: the difference around it."""
        return dict(self._backend.jobs_by_method)

    def self_check(self) -> str | None:
        """Round trip of random bytes through scratch copies of this engine's layout, by
        every copy method its jobs may use (on CUDA: DMA stores and loads, and kernel loads
        when the kernel is enabled), each byte compared; live KV blocks and the pool are not
        touched. Returns None when every byte came back, else the cause (a copy raised,
        failed or moved wrong bytes). See ``kvcache.transfer._calibrate.round_trip``."""
        self._check_open()
        try:
            return round_trip(self)
        except Exception as exc:
            logger.debug("the transfer self-check raised", exc_info=True)
            return f"{type(exc).__name__}: {exc}"

    def _scratch_engine(self, layers: list[torch.Tensor], pool: Any, method: str) -> TransferEngine:
        """An engine like this one over scratch ``layers`` and ``pool``, forced to
        ``method`` ("dma", "kernel", or "cpu" for CPU layers)."""
        return TransferEngine(
            layers,
            pool,
            blocks_per_chunk=self._blocks_per_chunk,
            groups=self._group_refs,
            offsets=self._offsets,
            copy="auto" if method == "cpu" else method,  # type: ignore[arg-type]
            kernel_max_run_bytes=0,
            log_failures=False,
        )

    def store(
        self,
        gpu_block_ids: Iterable[int],
        chunk_ids: Iterable[int],
        *,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> int:
        """Device blocks -> host chunks. Returns the job id."""
        return self._submit("store", gpu_block_ids, chunk_ids, group_sizes, block_indices)

    def load(
        self,
        chunk_ids: Iterable[int],
        gpu_block_ids: Iterable[int],
        *,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
        expedited: bool = False,
    ) -> int:
        """Host chunks -> device blocks. Returns the job id. An expedited load runs on a queue
        of its own (it never waits behind regular loads)."""
        queue: Queue = "expedited" if expedited else "load"
        return self._submit(queue, gpu_block_ids, chunk_ids, group_sizes, block_indices)

    def block_ids_from_pointers(
        self,
        ptrs: object,
        sizes: object,
        *,
        group_block_counts: Sequence[int],
        group_data_ref_counts: Sequence[int],
    ) -> Any:
        """The device block ids (an int64 numpy array, group after group) that a job's device
        pointers name, for :meth:`store`/:meth:`load` with ``group_sizes=group_block_counts``.

        The layout of vLLM 0.34's ``DevicePointers``: ``ptrs`` and ``sizes`` are 1-d numpy
        uint64 arrays with one entry per (group, reference, block), in that order, where a
        group's references are the ``groups`` this engine was built with (repeats included).
        Nothing is trusted: every pointer must be ``base + b * block_stride`` of its
        reference's layer with ``0 <= b < num_blocks``, every reference of a group must name
        the same blocks, every size must be the reference's bytes and the counts must match
        the layout, else ``OutOfRangeError`` (a pointer outside its layer),
        ``InvalidTypeError`` (not uint64 arrays, a count that is not an int) or
        ``InvalidArgumentError`` (anything else). One Rust pass; nothing is queued."""
        self._check_open()
        return self._layout.block_ids_from_pointers(
            ptrs, sizes, group_block_counts, group_data_ref_counts
        )

    def plan(
        self,
        *,
        store: bool,
        gpu_block_ids: object,
        chunk_ids: object,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> _core.Plan:
        """Validates a request and returns its copy plan without running it (diagnostics:
        ``len(plan)`` runs after coalescing, ``plan.num_pages`` before). The plan keeps the
        pool from closing until it is dropped."""
        # The layout reads numpy id arrays in place and converts anything else with as_ids.
        self._check_open()
        return self._layout.plan(store, gpu_block_ids, chunk_ids, group_sizes, block_indices)

    def _submit(
        self,
        queue: Queue,
        gpu_block_ids: object,
        chunk_ids: object,
        group_sizes: Sequence[int] | None,
        block_indices: Sequence[int] | None,
    ) -> int:
        # The submitting thread's hot path (once per vLLM job): one Rust call validates and
        # plans, one queues; ids are numbered only once the job is queued.
        self._check_open()
        plan = self._layout.plan(
            queue == "store", gpu_block_ids, chunk_ids, group_sizes, block_indices
        )
        job_id = self._issued
        self._backend.submit(job_id, plan, queue)
        self._issued = job_id + 1
        self._unreported.add(job_id)
        return job_id

    def _collect(self) -> None:
        if self._report_pinning is not None:
            self._report_pinning()
        results = self._backend.collect()
        if self._log_failures:
            for r in results:
                if not r.success:
                    logger.error(
                        "transfer job %d (%s) failed: %s",
                        r.job_id,
                        "store, device -> host" if r.store else "load, host -> device",
                        r.error,
                    )
        self._done.extend(results)

    def poll_results(self) -> list[JobResult]:
        """Jobs finished since the last call (each reported once), with sizes and times."""
        self._collect()
        done, self._done = self._done, []
        for r in done:
            self._unreported.discard(r.job_id)
        return done

    def poll(self) -> list[tuple[int, bool]]:
        """Jobs finished since the last call, as ``(job_id, success)``; each reported once."""
        return [(r.job_id, r.success) for r in self.poll_results()]

    def wait(self, job_ids: Iterable[int] | None = None) -> None:
        """Blocks until the given jobs (default: all) have finished; :meth:`poll` still
        reports them. Ids never issued by this engine raise ``InvalidArgumentError``."""
        wanted: set[int] | None = None
        if job_ids is not None:
            wanted = set()
            for j in bounded_list("job_ids", job_ids):
                if isinstance(j, bool) or not isinstance(j, int):
                    raise InvalidTypeError(f"job ids are ints, got {type(j).__name__}")
                if not 0 <= j < self._issued:
                    raise InvalidArgumentError(f"job {j} was not issued by this engine")
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
            raise InvalidStateError("the transfer engine is closed")

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


def _calibrate(device: torch.device) -> Calibration | None:
    """The load cut-off measured on ``device`` with scratch engines (cached per device)."""
    return calibrate(device, TransferEngine)
