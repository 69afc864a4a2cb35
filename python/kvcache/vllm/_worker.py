"""``CPUOffloadingWorker``: vLLM's ``OffloadingWorker`` contract on ``kvcache.transfer``.

One class serves both supported releases, each with its own contract: under vLLM 0.33 a
job's device side is a ``GPULoadStoreSpec`` (block ids), under vLLM 0.34 ``DevicePointers``
(one device address per group, data reference and block, resolved by the connector). A small
per-release front (``kvcache.vllm._fronts``), picked once at import from the running vLLM,
reads that side; everything after it is the same for both.

Under 0.34 the worker recovers validated block ids from the pointers (in Rust, one pass:
every pointer must start a block of the registered KV tensor its reference names, the
references of a group must agree, sizes and counts must match) and plans them exactly as a
0.33 job. We chose that over copying from the pointers as given: vLLM's connector resolves
the pointers from block ids with nothing between, so the ids are the job; an untrusted
address never reaches a copy; and the one planner (validation, partial chunks, padded
pages, shared tensors, merging of contiguous pages) and its conformance tests serve both
releases. vLLM's own 0.34 worker ignores the pointers' sizes (it copies each reference's page
bytes); ours refuses a job whose sizes are not those bytes.

vLLM's worker builds one descriptor per (block, layer reference) in numpy on every job and
copies them through ``cuMemcpyBatchAsync`` or a Triton kernel. This one plans the job in Rust
and submits it with one call; host memory is a pool of this rank's chunks, pinned in the
background. Imports vLLM (through ``kvcache.vllm``); ``import kvcache`` does not.

Host layout: chunk ``c`` of this rank holds, for every KV tensor in order, ``blocks_per_chunk``
page slots of the tensor's (padded) page size, back to back: the layout of this rank's slot
in vLLM's shared region, so the bytes of a chunk are identical to vLLM's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvcache._core import (
    InvalidArgumentError,
    InvalidTypeError,
    KvCacheError,
    TransferError,
    _refuse_pickling,
)
from kvcache.transfer import HostChunkPool, TransferEngine
from kvcache.transfer._checks import as_ids, bounded_list
from kvcache.vllm._fronts import Front, front_for
from kvcache.vllm._version import RUNNING_VLLM_SEMANTICS

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvcache.vllm")

PinSetting = Literal["background", "blocking", "off"]
_PIN_MODES: dict[str, Any] = {"background": "background", "blocking": "auto", "off": False}


class HostRegionView(NamedTuple):
    """Host memory the worker's chunks live in when it is not a pool of its own: vLLM's shared
    host region (tiered offloading, where the secondary tiers read and write the same rows).
    Chunk ``c`` is row ``c`` of ``row_bytes`` bytes in ``buffer``; this rank's slot starts
    ``slot_offset`` bytes into the row; ``release`` is called once the worker has let go."""

    buffer: Any
    row_bytes: int
    slot_offset: int
    release: Callable[[], None]


class SelfCheckError(TransferError):
    """The worker's start-up self-check found a copy path that raised, failed or moved wrong
    bytes (``cause`` says which); the worker was not built."""

    def __init__(self, cause: str) -> None:
        super().__init__(f"start-up self-check failed: {cause}")
        self.cause = cause


def build_worker(
    kv_caches: CanonicalKVCaches,
    fallback: Callable[[], OffloadingWorker],
    **kwargs: Any,
) -> tuple[OffloadingWorker, str | None]:
    """kvcache's worker, or, when its start-up self-check fails, ``fallback()`` (vLLM's
    worker) after one WARNING naming the cause. Returns the worker and why it is vLLM's
    (None: it is kvcache's)."""
    try:
        return CPUOffloadingWorker(kv_caches, **kwargs), None
    except SelfCheckError as exc:
        logger.warning(
            "kvcache's worker failed its start-up self-check (%s); vLLM's worker moves the KV "
            "bytes instead",
            exc.cause,
        )
        return fallback(), f"kvcache's start-up self-check failed: {exc.cause}"


def worker_layout(
    kv_caches: CanonicalKVCaches, blocks_per_chunk: int
) -> tuple[list[torch.Tensor], list[list[tuple[int, int]]], list[int], int]:
    """The engine's view of vLLM's canonical KV caches: one ``(num_blocks, page)`` int8 view
    per tensor (as vLLM's worker takes them), each group's ``(tensor, payload bytes)``
    references, the tensors' segment offsets in a chunk, and the chunk size."""
    import torch

    views = []
    offsets = []
    offset = 0
    for t in kv_caches.tensors:
        page = int(t.page_size_bytes)
        views.append(t.tensor.view(torch.int8).view((-1, page)))
        offsets.append(offset)
        offset += page * blocks_per_chunk
    groups = [
        [(int(ref.tensor_idx), int(ref.page_size_bytes)) for ref in refs]
        for refs in kv_caches.group_data_refs
    ]
    return views, groups, offsets, offset


def _split_repeats(
    blocks_per_chunk: int,
    chunk_ids: Any,
    block_ids: Any,
    group_sizes: Any,
    block_indices: Any,
) -> list[dict[str, Any]] | None:
    """A load that names a destination block more than once (vLLM's scheduler can: a Mamba
    group's null block fills the gaps between states), as engine loads that each name every
    destination once: per group, consecutive stretches without a repeat, in order, so a
    block named twice is written twice, the later occurrence last (the jobs of one engine
    queue run in submission order, whichever copy method runs them; vLLM's worker, whose
    batched copies have no order among themselves, gives no order either). None when
    nothing repeats (the load was refused for another reason) or the spec does not parse,
    within the bounds the engine reads its arguments with (a refused load may have been
    refused for naming more ids than those)."""
    try:
        ids = as_ids("gpu_block_ids", block_ids).tolist()
        chunks = as_ids("chunk_ids", chunk_ids).tolist()
        sizes = [int(n) for n in bounded_list("group_sizes", group_sizes)]
        starts = [int(i) for i in bounded_list("block_indices", block_indices)]
    except (KvCacheError, TypeError, ValueError, OverflowError):
        return None
    if (
        len(set(ids)) == len(ids)
        or len(sizes) != len(starts)
        or min(sizes, default=0) < 0
        or sum(sizes) != len(ids)  # every group's blocks are there: no slice runs short
    ):
        return None
    bpc = blocks_per_chunk
    parts = []
    b_off = c_off = 0
    for g, (n, start) in enumerate(zip(sizes, starts, strict=True)):
        group_ids = ids[b_off : b_off + n]
        num_chunks = 0 if n == 0 else -(-(start % bpc + n) // bpc)
        group_chunks = chunks[c_off : c_off + num_chunks]
        b_off += n
        c_off += num_chunks
        a = 0
        while a < n:
            seen: set[int] = set()
            b = a
            while b < n and group_ids[b] not in seen:
                seen.add(group_ids[b])
                b += 1
            first = (start + a) // bpc - start // bpc
            last = (start + b - 1) // bpc - start // bpc
            part_sizes = [0] * len(sizes)
            part_starts = [0] * len(sizes)
            part_sizes[g] = b - a
            part_starts[g] = start + a
            parts.append(
                {
                    "chunk_ids": group_chunks[first : last + 1],
                    "gpu_block_ids": group_ids[a:b],
                    "group_sizes": part_sizes,
                    "block_indices": part_starts,
                }
            )
            a = b
    if b_off != len(ids) or c_off != len(chunks):
        return None
    return parts


def _chunk_ids(cpu: object) -> Any:
    if not isinstance(cpu, CPULoadStoreSpec):
        raise InvalidTypeError(f"the CPU side must be a CPULoadStoreSpec, got {type(cpu).__name__}")
    return cpu.block_ids


class CPUOffloadingWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` on kvcache's transfer engine (see the module docs).

    ``submit_store``/``submit_load`` validate the job completely before anything is queued
    and raise a ``KvCacheError`` subclass on a bad one (vLLM's connector would otherwise hit
    a bare ``assert``); they never wait for copies. ``get_finished`` reports each job once with
    vLLM's ``transfer_size`` accounting and the copy time; a failed copy is reported as
    ``success=False`` (never as success) and logged with the job id, direction and cause.
    Regular loads, expedited loads and stores run on three queues.

    The device side of a job is the running release's (see the module docs): ``device`` is
    a ``DevicePointers`` under vLLM 0.34, a ``GPULoadStoreSpec`` under 0.33; any other type
    raises ``InvalidTypeError``. A failed job is reported in that release's shape (0.34:
    ``success=False`` without size or time).

    Start-up self-check (``self_check=True``): before returning, random bytes make a round
    trip through scratch memory by every copy method the worker's jobs may use
    (:meth:`TransferEngine.self_check`); if any raises, fails or moves a wrong byte, the worker
    releases what it built and raises :class:`SelfCheckError` (``kvcache.vllm`` then falls back
    to vLLM's worker).
    """

    #: How this vLLM release hands over a job's device side (chosen once, at import).
    front: Front = front_for(RUNNING_VLLM_SEMANTICS)

    def __reduce__(self) -> Any:
        # Its engine and host pool live in this process only (as vLLM's worker's do).
        _refuse_pickling(self)

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
        blocks_per_chunk: int,
        num_chunks: int,
        pin: PinSetting = "background",
        copy: Literal["auto", "kernel", "dma"] = "auto",
        kernel_max_run_bytes: int | None = None,
        self_check: bool = True,
        host_region: HostRegionView | None = None,
    ) -> None:
        self._host_region = host_region
        if pin not in _PIN_MODES:
            raise InvalidArgumentError(
                f"kvcache_pin must be 'background', 'blocking' or 'off', got {pin!r}"
            )
        views, groups, offsets, chunk_bytes = worker_layout(kv_caches, blocks_per_chunk)
        self.chunk_bytes = chunk_bytes
        # The KV tensors' device pins the pool, whatever device the calling thread has.
        device = views[0].device.index if views and views[0].device.type == "cuda" else None
        if host_region is None:
            self.pool = HostChunkPool(num_chunks, chunk_bytes, pin=_PIN_MODES[pin], device=device)
        else:
            # Rows of vLLM's shared region; this rank's slot at its offset in each row.
            offsets = [o + host_region.slot_offset for o in offsets]
            self.pool = HostChunkPool(
                num_chunks,
                host_region.row_bytes,
                pin=_PIN_MODES[pin],
                device=device,
                buffer=host_region.buffer,
            )
        try:
            self.engine = TransferEngine(
                views,
                self.pool,
                blocks_per_chunk=blocks_per_chunk,
                groups=groups,
                offsets=offsets,
                copy=copy,
                kernel_max_run_bytes=kernel_max_run_bytes,
                log_failures=False,
            )
        except BaseException:
            self.pool.close()
            raise
        if self_check:
            cause = self.engine.self_check()
            if cause is not None:
                self.shutdown()
                raise SelfCheckError(cause)
        # engine job id -> (vLLM job id, direction); vLLM job id -> its engine job ids (one,
        # or several for a load split around repeated destinations); a split job's results
        # so far: [engine jobs left, success, bytes, seconds or None, first error].
        self._jobs: dict[int, tuple[int, str]] = {}
        self._by_vllm: dict[int, list[int]] = {}
        self._partial: dict[int, list[Any]] = {}
        # Engine jobs of a split load whose submission failed part-way (dropped when done).
        self._orphans: set[int] = set()

    def _track(self, job_id: int, engine_jobs: list[int], direction: str) -> None:
        for engine_job in engine_jobs:
            self._jobs[engine_job] = (job_id, direction)
        self._by_vllm[job_id] = engine_jobs
        if len(engine_jobs) > 1:
            self._partial[job_id] = [len(engine_jobs), True, 0, 0.0, None]

    def _check_new(self, job_id: int) -> None:
        # vLLM's connector numbers jobs with ints; anything else (None included) is a bug.
        if isinstance(job_id, bool) or not isinstance(job_id, int):
            raise InvalidTypeError(f"job_id must be an int, got {type(job_id).__name__}")
        if job_id in self._by_vllm:
            raise InvalidArgumentError(f"transfer job {job_id} is already in flight")

    def submit_store(self, job_id: int, device: object, dst_spec: LoadStoreSpec) -> bool:
        """GPU blocks -> host chunks, asynchronously."""
        self._check_new(job_id)
        chunks = _chunk_ids(dst_spec)
        job = self.front.device_job(self.engine, device)
        engine_job = self.engine.store(
            job.block_ids,
            chunks,
            group_sizes=job.group_sizes,
            block_indices=job.block_indices,
        )
        self._track(job_id, [engine_job], "store, GPU -> CPU")
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        device: object,
        expedited: bool = False,
    ) -> bool:
        """Host chunks -> GPU blocks, asynchronously; an expedited load has a queue of its
        own."""
        self._check_new(job_id)
        chunks = _chunk_ids(src_spec)
        job = self.front.device_job(self.engine, device)
        try:
            engine_jobs = [
                self.engine.load(
                    chunks,
                    job.block_ids,
                    group_sizes=job.group_sizes,
                    block_indices=job.block_indices,
                    expedited=expedited,
                )
            ]
        except InvalidArgumentError:
            parts = _split_repeats(
                self.engine.blocks_per_chunk,
                chunks,
                job.block_ids,
                job.group_sizes,
                job.block_indices,
            )
            if parts is None:
                raise
            for part in parts:  # all of them valid before any is queued
                self.engine.plan(store=False, **part)
            engine_jobs = []
            try:
                for part in parts:
                    engine_jobs.append(self.engine.load(**part, expedited=expedited))
            except BaseException:
                # Parts already queued still finish; their results then belong to no job.
                self._orphans.update(engine_jobs)
                raise
        direction = "expedited load, CPU -> GPU" if expedited else "load, CPU -> GPU"
        self._track(job_id, engine_jobs, direction)
        return True

    def get_finished(self) -> list[TransferResult]:
        out = []
        for r in self.engine.poll_results():
            if r.job_id in self._orphans:
                self._orphans.discard(r.job_id)
                continue
            job_id, direction = self._jobs.pop(r.job_id)
            ok, nbytes, seconds, error = r.success, r.nbytes, r.seconds, r.error
            partial = self._partial.get(job_id)
            if partial is not None:  # one part of a split load: report the whole once
                partial[0] -= 1
                partial[1] = partial[1] and ok
                partial[2] += nbytes
                partial[3] = None if partial[3] is None or seconds is None else partial[3] + seconds
                partial[4] = partial[4] or error
                if partial[0]:
                    continue
                del self._partial[job_id]
                _left, ok, nbytes, seconds, error = partial
            del self._by_vllm[job_id]
            if not ok:
                logger.error("kvcache transfer job %d (%s) failed: %s", job_id, direction, error)
                out.append(self.front.failed(job_id, nbytes, seconds))
                continue
            out.append(
                TransferResult(
                    job_id=job_id,
                    success=True,
                    transfer_size=nbytes,
                    transfer_time=seconds,
                )
            )
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Blocks until the given jobs have finished (ids this worker does not own are
        ignored, anything that is not an int included); :meth:`get_finished` still reports
        them. Read within the engine's bound: an endless iterable is refused
        (``InvalidArgumentError``), not spun on."""
        owned = self._by_vllm
        mine = [
            e
            for j in bounded_list("job_ids", job_ids)
            if isinstance(j, int) and j in owned
            for e in owned[j]
        ]
        if mine:
            self.engine.wait(mine)

    def shutdown(self) -> None:
        """Waits for every job, then releases the host memory (a shared region's owner is
        told once the pool has let go of it)."""
        try:
            self.engine.close()
        finally:
            self.pool.close()
            region, self._host_region = self._host_region, None
            if region is not None:
                del self.pool, self.engine  # the pool's buffer export goes with them
                region.release()

    def describe(self) -> dict[str, Any]:
        """What runs: pool size, pinning state, DMA method and the load cut-off."""
        engine = self.engine.describe()  # first: reports a finished background pinning
        status = self.pool.pin_status()["state"]
        if self.pool.pinned:
            status = "pinned"
        return {
            "pool_bytes": self.pool.nbytes,
            "num_chunks": self.pool.num_chunks,
            "chunk_bytes": self.chunk_bytes,
            "pinned": status,
            **engine,
        }
