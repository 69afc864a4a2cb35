"""Start-up calibration of the kernel/DMA cut-off for loads, per device, and the start-up
self-check of the copy paths.

Why: the page size below which the copy kernel beats DMA for host -> device copies moves with
the GPU, the PCIe generation and the batch (vLLM fixes it at 28 KiB, tuned on one H100). At
engine start-up the same scattered load (random device block ids: one DMA run per page,
nothing coalesces, as with a churned block pool) is timed through the kernel and through DMA
at 4-128 KiB pages. Each job is sized like a real one: ``LAYERS`` KV tensors and
``JOB_BYTES`` (16 MiB) per job at every page size (4,096 pages at 4 KiB, 128 at 128 KiB), so
the figures are bandwidths, not launch latencies; the best of ``REPEATS`` runs counts, after
one warm-up run (the kernel's first compilation when Triton's cache is cold). The cut-off is
the largest page size at which the kernel was faster, every smaller size measured agreeing
(0: the kernel is never used). Scratch: ``2 * JOB_BYTES`` of device memory and
``JOB_BYTES`` of pinned host memory, released afterwards. The copies themselves take tens
of milliseconds at PCIe speeds; setting up the engines and pinning the scratch add to that,
and larger page sizes are skipped once ``BUDGET_S`` has passed (the measured sizes decide).
The result is cached per device for the process and logged at DEBUG level (the worker's
start-up line shows the cut-off).

Override: pass ``kernel_max_run_bytes`` to the engine (``kvcache_kernel_max_run_bytes`` in
vLLM's ``kv_connector_extra_config``); 0 keeps every load on DMA.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

KiB = 1024
PAGE_SIZES = (4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB)
#: KV tensors (layers) in a calibration job, and bytes per job at every page size.
LAYERS = 8
JOB_BYTES = 16 << 20
REPEATS = 3
#: Seconds after which no further page size is measured.
BUDGET_S = 5.0


@dataclass(frozen=True)
class Calibration:
    """The chosen cut-off and what it was chosen from: ``(page bytes, kernel GB/s, DMA GB/s)``."""

    kernel_max_run_bytes: int
    measured: tuple[tuple[int, float, float], ...]
    seconds: float


def choose_cutoff(measured: Sequence[tuple[int, float, float]]) -> int:
    """The largest page size up to which the kernel beat DMA at every measured size (0 when it
    lost at the smallest). Sizes must be ascending."""
    cutoff = 0
    for page, kernel_gbps, dma_gbps in measured:
        if kernel_gbps <= dma_gbps:
            break
        cutoff = page
    return cutoff


def measure(
    time_load: Callable[[str, int], float],
    page_sizes: Sequence[int] = PAGE_SIZES,
    *,
    budget_s: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[tuple[int, float, float]]:
    """``(page, kernel GB/s, DMA GB/s)`` per page size; ``time_load(method, page)`` returns the
    GB/s of one scattered load of that page size through ``method`` ("kernel" or "dma"). Once
    ``budget_s`` seconds have passed, the remaining (larger) sizes are not measured."""
    started = clock()
    table: list[tuple[int, float, float]] = []
    for p in page_sizes:
        if table and budget_s is not None and clock() - started > budget_s:
            logger.debug("calibration budget reached: sizes from %d KiB not measured", p // KiB)
            break
        table.append((p, time_load("kernel", p), time_load("dma", p)))
    return table


@functools.cache
def calibrate(
    device: torch.device,
    engine_cls: Callable[..., Any],
    *,
    layers: int = LAYERS,
    job_bytes: int = JOB_BYTES,
    budget_s: float = BUDGET_S,
) -> Calibration | None:
    """Measures the cut-off on ``device`` (cached) with engines of ``engine_cls`` (the
    ``TransferEngine``, passed in so that this module does not import the engine's); None when
    it cannot be measured (no pinned memory, no Triton): the caller keeps its default."""
    try:
        return _calibrate(device, engine_cls, layers, job_bytes, budget_s)
    except Exception:
        logger.warning(
            "calibrating the kernel/DMA cut-off failed; using the default", exc_info=True
        )
        return None


def _calibrate(
    device: torch.device,
    engine_cls: Callable[..., Any],
    layers: int,
    job_bytes: int,
    budget_s: float,
) -> Calibration | None:
    import numpy as np
    import torch

    from kvcache.transfer._pool import HostChunkPool

    started = time.perf_counter()
    rng = np.random.default_rng(0)
    page_max = max(PAGE_SIZES)
    # A chunk holds, per tensor, page_max // page slots of any page size: one pool serves all.
    chunk_bytes = layers * page_max
    chunks = max(1, job_bytes // chunk_bytes)
    with HostChunkPool(chunks, chunk_bytes, pin=True, device=device.index) as pool:
        if not pool.kernel_ready:
            return None
        # Device blocks: twice a job's, so that a job's random ids are scattered.
        flat = torch.empty(2 * chunks * chunk_bytes, dtype=torch.uint8, device=device)

        def time_load(method: str, page: int) -> float:
            bpc = page_max // page
            blocks = chunks * bpc
            tensors = list(flat.view(layers, 2 * blocks, page).unbind(0))
            engine = engine_cls(
                tensors,
                pool,
                blocks_per_chunk=bpc,
                copy=method,
                groups=[[(i, page) for i in range(layers)]],
                offsets=[i * page_max for i in range(layers)],
                kernel_max_run_bytes=page_max,
                log_failures=False,
            )
            dst = rng.permutation(2 * blocks)[:blocks]
            src = np.arange(chunks)
            nbytes = blocks * layers * page
            best = 0.0
            try:
                for rep in range(REPEATS + 1):  # the first run warms up (compilation)
                    torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    job = engine.load(src, dst, group_sizes=[blocks], block_indices=[0])
                    engine.wait([job])
                    elapsed = time.perf_counter() - t0
                    if not all(r.success for r in engine.poll_results()):
                        raise RuntimeError(f"calibration load via {method} failed")
                    if rep:
                        best = max(best, nbytes / elapsed / 1e9)
            finally:
                engine.close()
            return best

        table = measure(time_load, budget_s=budget_s)
    cutoff = choose_cutoff(table)
    cal = Calibration(cutoff, tuple(table), time.perf_counter() - started)
    logger.debug(
        "kernel/DMA cut-off for loads on %s: %d KiB (%s; %.2f s)",
        device,
        cutoff // KiB,
        ", ".join(f"{p // KiB} KiB kernel {k:.1f} / DMA {d:.1f} GB/s" for p, k, d in table),
        cal.seconds,
    )
    return cal


# --- start-up self-check ------------------------------------------------------------------

#: Blocks per group in the self-check's job: with a first logical index of 1 they enter their
#: first chunk part-way and, when blocks_per_chunk <= 3, end on a second one.
CHECK_BLOCKS = 3


def round_trip(engine: Any) -> str | None:
    """Random bytes through scratch copies of ``engine``'s layout (``TransferEngine``), by
    every method its jobs may use: each store method writes the same source blocks to scratch
    chunks (every host byte compared with where the layout puts it), then each load method
    reads them back into other scratch blocks (every payload byte compared). Scratch: a
    device tensor per KV tensor with ``CHECK_BLOCKS`` blocks per group and use, and a host
    pool of a few chunks, pinned when the engine's pool is (or is being) pinned. Returns None
    when every byte matched, else the cause; exceptions propagate to the caller."""
    import torch

    from kvcache.transfer._pool import HostChunkPool

    stores, loads = engine._backend.check_methods()
    bpc = engine.blocks_per_chunk
    groups = engine._group_refs
    pages = engine._pages
    k = CHECK_BLOCKS
    start = 1 if bpc > 1 else 0
    per_group_chunks = -(-(start + k) // bpc)
    num_groups = len(groups)
    uses = 1 + len(loads)
    num_blocks = uses * num_groups * k
    device = engine.device
    gen = torch.Generator(device=device).manual_seed(20260101)
    layers = [
        torch.randint(-128, 127, (num_blocks, page), dtype=torch.int8, device=device, generator=gen)
        for page in pages
    ]
    # Group g's source blocks, and its destination blocks for load method i (reversed, so
    # nothing coalesces on the way back).
    src = [list(range(g * k, (g + 1) * k)) for g in range(num_groups)]

    def dst(i: int, g: int) -> list[int]:
        first = ((1 + i) * num_groups + g) * k
        return list(range(first + k - 1, first - 1, -1))

    chunks = list(range(num_groups * per_group_chunks))
    sizes = [k] * num_groups
    starts = [start] * num_groups
    # The pool modes jobs meet: pinned (or being pinned), and pageable (before or without
    # pinning); the kernel runs on a pinned pool only.
    state = engine.pool.pin_status()["state"] if device.type == "cuda" else "unpinned"
    modes: list[Any] = []
    if engine.pool.pinned or state in ("pinning", "pinned"):
        modes.append("auto")
    if not engine.pool.pinned:
        modes.append(False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    cpu_layers = [t.cpu() for t in layers]
    for pin in modes:
        index = device.index if device.type == "cuda" else None
        with HostChunkPool(len(chunks), engine.pool.chunk_bytes, pin=pin, device=index) as pool:
            kernel_ok = device.type != "cuda" or pool.kernel_ready
            if not kernel_ok:
                logger.debug("self-check: the scratch pool is not kernel-ready; kernel skipped")
            cause = _round_trip_on(
                engine,
                pool,
                [m for m in stores if kernel_ok or m != "kernel"],
                [m for m in loads if kernel_ok or m != "kernel"],
                layers,
                cpu_layers,
                src,
                dst,
                chunks,
                sizes,
                starts,
            )
            if cause is not None:
                return cause if pin is False or len(modes) == 1 else f"{cause} (pinned pool)"
    return None


def _round_trip_on(
    engine: Any,
    pool: Any,
    stores: list[str],
    loads: list[str],
    layers: list[Any],
    cpu_layers: list[Any],
    src: list[list[int]],
    dst: Callable[[int, int], list[int]],
    chunks: list[int],
    sizes: list[int],
    starts: list[int],
) -> str | None:
    import numpy as np
    import torch

    bpc = engine.blocks_per_chunk
    groups = engine._group_refs
    pages = engine._pages
    offsets = engine._offsets
    per_group_chunks = len(chunks) // len(groups)
    start = starts[0]
    host = pool.tensor().view(torch.int8)

    def run(method: str, store: bool, blocks: list[list[int]]) -> str | None:
        scratch = engine._scratch_engine(layers, pool, method)
        try:
            ids = np.asarray([b for group in blocks for b in group], dtype=np.int64)
            if store:
                job = scratch.store(ids, chunks, group_sizes=sizes, block_indices=starts)
            else:
                job = scratch.load(chunks, ids, group_sizes=sizes, block_indices=starts)
            scratch.wait([job])
            results = scratch.poll_results()
            ran = scratch.jobs_by_method
            stopped = getattr(scratch._backend, "batch_stopped", None)
        finally:
            scratch.close()
        what = f"{method} {'store' if store else 'load'}"
        bad = [r for r in results if not r.success]
        if bad or not results:
            return f"{what} failed: " + (str(bad[0].error) if bad else "no result")
        # The method checked must be the method that ran (a kernel job that went to DMA would
        # leave the kernel untried).
        if method in ("dma", "kernel") and not any(
            n for name, n in ran.items() if name.split("-")[0] == method
        ):
            return f"{what}: the job did not run by {method} ({ran})"
        if stopped is not None:
            # The bytes came through one copy per run; the live queues stop batching now
            # rather than fail their first job's batched call later.
            engine._backend.stop_batching(f"the batched copy failed in the self-check: {stopped}")
        return None

    for method in stores:
        host.zero_()
        cause = run(method, True, src)
        if cause:
            return cause
        for g, refs in enumerate(groups):
            for j, block in enumerate(src[g]):
                chunk = g * per_group_chunks + (start + j) // bpc
                slot = (start + j) % bpc
                for t, nbytes in refs:
                    at = offsets[t] + slot * pages[t]
                    expected = cpu_layers[t][block, :nbytes]
                    if not torch.equal(host[chunk, at : at + nbytes], expected):
                        return (
                            f"{method} store wrote wrong bytes (group {g}, tensor {t}, "
                            f"block {block} -> chunk {chunk} slot {slot})"
                        )
    for i, method in enumerate(loads):
        targets = [dst(i, g) for g in range(len(groups))]
        # Every destination byte differs from its source before the load.
        for g, refs in enumerate(groups):
            to = torch.as_tensor(targets[g], device=layers[0].device)
            source = torch.as_tensor(src[g], device=layers[0].device)
            for t, _nbytes in refs:
                layers[t][to] = torch.bitwise_xor(layers[t][source], 0x5A)
        cause = run(method, False, targets)
        if cause:
            return cause
        after = [t.cpu() for t in layers]
        for g, refs in enumerate(groups):
            for block, source_block in zip(targets[g], src[g], strict=True):
                for t, nbytes in refs:
                    if not torch.equal(
                        after[t][block, :nbytes], cpu_layers[t][source_block, :nbytes]
                    ):
                        return (
                            f"{method} load wrote wrong bytes (group {g}, tensor {t}, "
                            f"block {source_block} -> {block})"
                        )
    return None
