"""Triton gather/scatter kernel: copies many small runs between device and pinned host memory.

Why a kernel: each DMA descriptor costs the copy engine a fixed overhead, so scattered 4-16 KiB
pages reach a fraction of PCIe bandwidth. GPU threads can load and store registered host
memory directly (unified addressing), and many SMs keep enough PCIe requests in flight to
hide that overhead. Large runs go to DMA instead (the engine picks by average run size).

Imported only on the CUDA path (and by tests under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Runs are cut into pieces of at most this many bytes so that long coalesced runs spread over
# programs instead of serialising on one.
PIECE_BYTES = 64 * 1024
# Words (8 bytes) each program moves per loop iteration, bounds.
MIN_BLOCK_WORDS = 128
MAX_BLOCK_WORDS = 1024


# The run count changes with every job: do not compile a variant per value class of it.
@triton.jit(do_not_specialize=["num_runs"])
def _copy_runs(src_ptr, dst_ptr, len_ptr, num_runs, BLOCK: tl.constexpr):
    # Program p handles runs p, p + P, p + 2P, ...; within a run, BLOCK words per step.
    lanes = tl.arange(0, BLOCK)
    for run in range(tl.program_id(0), num_runs, tl.num_programs(0)):
        src = tl.load(src_ptr + run).to(tl.pointer_type(tl.int64))
        dst = tl.load(dst_ptr + run).to(tl.pointer_type(tl.int64))
        words = tl.load(len_ptr + run) // 8
        for first in range(0, words, BLOCK):
            idx = first + lanes
            inside = idx < words
            tl.store(dst + idx, tl.load(src + idx, mask=inside), mask=inside)


def block_words(max_run_bytes: int) -> int:
    """Words per step: the smallest power of two covering a run, within the bounds."""
    words = max(1, min(max_run_bytes, PIECE_BYTES) // 8)
    return max(MIN_BLOCK_WORDS, min(MAX_BLOCK_WORDS, triton.next_power_of_2(words)))


def launch(descriptors: torch.Tensor, num_runs: int, *, programs: int, max_run_bytes: int) -> None:
    """Copies ``num_runs`` runs described by ``descriptors`` (int64 on the executing device:
    sources, then destinations, then byte lengths, all multiples of 8) on the current stream.
    """
    if num_runs == 0:
        return
    grid = (max(1, min(programs, num_runs)),)
    _copy_runs[grid](
        descriptors,
        descriptors[num_runs:],
        descriptors[2 * num_runs :],
        num_runs,
        BLOCK=block_words(max_run_bytes),
    )
