"""Triton copy kernel between device blocks and pinned host chunks, addressed per block.

Why a kernel: each DMA descriptor costs the copy engine a fixed overhead, so scattered 4-16 KiB
pages reach a fraction of PCIe bandwidth. GPU threads can load and store registered host
memory directly (unified addressing), and many SMs keep enough PCIe requests in flight to hide
that overhead. Large pages go to DMA instead (the engine picks by page size).

Why per block: the kernel computes every page's two addresses itself from a per-block table
(device block id, address of the chunk holding the block, slot in that chunk) and a per-tensor
table (device base, block stride, segment offset in a chunk, page slot bytes, bytes copied), so
the CPU prepares three integers per block, not three per page: a job's submission cost does not
grow with the number of layers.

Imported only on the CUDA path (and by tests under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Words (8 bytes) each program moves per loop iteration, bounds.
MIN_BLOCK_WORDS = 128
MAX_BLOCK_WORDS = 1024
REF_FIELDS = 5


# Block and tensor counts change with every job: do not compile a variant per value class.
@triton.jit(do_not_specialize=["num_blocks", "num_refs"])
def _copy_blocks(
    table_ptr, refs_ptr, num_blocks, num_refs, TO_DEVICE: tl.constexpr, BLOCK: tl.constexpr
):
    # Program p handles (block, tensor) items p, p + P, p + 2P, ...; BLOCK words per step.
    lanes = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), num_blocks * num_refs, tl.num_programs(0)):
        i = item // num_refs
        r = (item % num_refs) * 5
        block = tl.load(table_ptr + i)
        chunk = tl.load(table_ptr + num_blocks + i)
        slot = tl.load(table_ptr + 2 * num_blocks + i)
        dev = tl.load(refs_ptr + r) + block * tl.load(refs_ptr + r + 1)
        host = chunk + tl.load(refs_ptr + r + 2) + slot * tl.load(refs_ptr + r + 3)
        words = tl.load(refs_ptr + r + 4) // 8
        if TO_DEVICE:
            src = host.to(tl.pointer_type(tl.int64))
            dst = dev.to(tl.pointer_type(tl.int64))
        else:
            src = dev.to(tl.pointer_type(tl.int64))
            dst = host.to(tl.pointer_type(tl.int64))
        for first in range(0, words, BLOCK):
            idx = first + lanes
            inside = idx < words
            tl.store(dst + idx, tl.load(src + idx, mask=inside), mask=inside)


def block_words(max_page_bytes: int) -> int:
    """Words per step: the smallest power of two covering a page, within the bounds."""
    words = max(1, max_page_bytes // 8)
    return max(MIN_BLOCK_WORDS, min(MAX_BLOCK_WORDS, triton.next_power_of_2(words)))


def launch(
    table: torch.Tensor,
    refs: torch.Tensor,
    num_blocks: int,
    *,
    to_device: bool,
    programs: int,
    max_page_bytes: int,
) -> None:
    """Copies, on the current stream, every (block, tensor) page described by ``table`` (int64
    on the executing device: device block ids, then chunk addresses, then slots, ``num_blocks``
    each) and ``refs`` (int64, five fields per tensor; every address and size a multiple of 8)."""
    num_refs = refs.numel() // REF_FIELDS
    if num_blocks == 0 or num_refs == 0:
        return
    grid = (max(1, min(programs, num_blocks * num_refs)),)
    _copy_blocks[grid](
        table,
        refs,
        num_blocks,
        num_refs,
        TO_DEVICE=to_device,
        BLOCK=block_words(max_page_bytes),
    )
