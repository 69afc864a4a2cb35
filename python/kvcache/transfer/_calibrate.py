"""Start-up calibration of the kernel/DMA cut-off for loads, per device.

Why: the page size below which the copy kernel beats DMA for host -> device copies moves with
the GPU, the PCIe generation and the batch (vLLM fixes it at 28 KiB, tuned on one H100). At
engine start-up, with a private 32 MiB pinned buffer, the same scattered load (one page per
run, nothing coalesces) is timed through the kernel and through DMA at 4-128 KiB pages; the
cut-off is the largest page size at which the kernel was faster, and every smaller size
measured must agree (0: the kernel is never used). About 0.3 s, plus the kernel's first
compilation when Triton's cache is cold. The result is cached per device for the process.

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
SCRATCH_BYTES = 32 << 20
REPEATS = 3


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
    time_load: Callable[[str, int], float], page_sizes: Sequence[int] = PAGE_SIZES
) -> list[tuple[int, float, float]]:
    """``(page, kernel GB/s, DMA GB/s)`` per page size; ``time_load(method, page)`` returns the
    GB/s of one scattered load of that page size through ``method`` ("kernel" or "dma")."""
    return [(p, time_load("kernel", p), time_load("dma", p)) for p in page_sizes]


@functools.cache
def calibrate(device: torch.device, engine_cls: Callable[..., Any]) -> Calibration | None:
    """Measures the cut-off on ``device`` (cached) with engines of ``engine_cls`` (the
    ``TransferEngine``, passed in so that this module does not import the engine's); None when
    it cannot be measured (no pinned memory, no Triton): the caller keeps its default."""
    try:
        return _calibrate(device, engine_cls)
    except Exception:
        logger.warning(
            "calibrating the kernel/DMA cut-off failed; using the default", exc_info=True
        )
        return None


def _calibrate(device: torch.device, engine_cls: Callable[..., Any]) -> Calibration | None:
    import numpy as np
    import torch

    from kvcache.transfer._pool import HostChunkPool

    started = time.perf_counter()
    rng = np.random.default_rng(0)
    page_max = max(PAGE_SIZES)
    slots = SCRATCH_BYTES // page_max
    n = slots // 2
    with HostChunkPool(slots, page_max, pin=True) as pool:
        if not pool.kernel_ready:
            return None
        layer = torch.empty((slots, page_max), dtype=torch.uint8, device=device)

        def time_load(method: str, page: int) -> float:
            # The first `page` bytes of scattered (slots, page_max) slots: one run per page,
            # nothing coalesces, as with a churned block pool.
            engine = engine_cls(
                [layer],
                pool,
                copy=method,  # type: ignore[arg-type]
                groups=[[(0, page)]],
                offsets=[0],
                kernel_max_run_bytes=page_max,
                log_failures=False,
            )
            src = rng.permutation(slots)[:n]
            dst = rng.permutation(slots)[:n]
            best = 0.0
            try:
                for rep in range(REPEATS + 1):  # the first run warms up (compilation)
                    torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    job = engine.load(src, dst, group_sizes=[n], block_indices=[0])
                    engine.wait([job])
                    elapsed = time.perf_counter() - t0
                    if not all(r.success for r in engine.poll_results()):
                        raise RuntimeError(f"calibration load via {method} failed")
                    if rep:
                        best = max(best, n * page / elapsed / 1e9)
            finally:
                engine.close()
            return best

        table = measure(time_load)
    cutoff = choose_cutoff(table)
    cal = Calibration(cutoff, tuple(table), time.perf_counter() - started)
    logger.info(
        "kernel/DMA cut-off for loads on %s: %d KiB (%s; %.2f s)",
        device,
        cutoff // KiB,
        ", ".join(f"{p // KiB} KiB kernel {k:.1f} / DMA {d:.1f} GB/s" for p, k, d in table),
        cal.seconds,
    )
    return cal
