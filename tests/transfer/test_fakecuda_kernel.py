"""The fake CUDA library's copy kernel: copies in both directions, the word-size tail, and the
faults CUDA raises for misaligned, pageable, unmapped or foreign memory (sticky 700/716)."""

from __future__ import annotations

import numpy as np
import torch

from tests.support.fakecuda import (
    HOST_REGISTER_MAPPED,
    HOST_REGISTER_PORTABLE,
    ILLEGAL_ADDRESS,
    INVALID_HANDLE,
    MISALIGNED_ADDRESS,
    NON_UVA_OFFSET,
    SUCCESS,
    FakeCuda,
)
from tests.support.fakecuda_calls import (
    addr,
    at_gate,
)

# ---- the copy kernel ---------------------------------------------------------------------


class KernelSetup:
    """Device blocks, pinned chunks and the kernel's table and refs, as the engine lays out."""

    def __init__(self, cuda: FakeCuda, dev: int = 0, flags: int = HOST_REGISTER_MAPPED) -> None:
        self.cuda = cuda
        # Two layers of 4 blocks of 16 bytes; chunks hold 2 slots of 2 layers x 16 bytes.
        self.layers = [cuda.device_tensor(dev, torch.zeros(64, dtype=torch.uint8)) for _ in "ab"]
        self.chunks = np.zeros((2, 64), dtype=np.uint8)
        assert cuda.host_register(addr(self.chunks), self.chunks.nbytes, flags) == SUCCESS
        self.dev = dev

    def tables(self, blocks: list[tuple[int, int, int]], nbytes: int, host_shift: int = 0) -> None:
        """blocks: (device block id, chunk index, slot). Builds table and refs in device memory."""
        n = len(blocks)
        table = torch.zeros(3 * n, dtype=torch.int64)
        for i, (block, chunk, slot) in enumerate(blocks):
            table[i] = block
            table[n + i] = addr(self.chunks) + 64 * chunk + host_shift
            table[2 * n + i] = slot
        refs = torch.tensor(
            [[layer.data_ptr(), 16, 16 * li, 32, nbytes] for li, layer in enumerate(self.layers)],
            dtype=torch.int64,
        )
        self.table = self.cuda.device_tensor(self.dev, table)
        self.refs = self.cuda.device_tensor(self.dev, refs)
        self.n = n

    def launch(self, stream: int, to_device: bool) -> int:
        return self.cuda.launch_copy(
            stream, self.table.data_ptr(), self.n, self.refs.data_ptr(), 2, to_device
        )


def test_kernel_copies_both_directions(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    k = KernelSetup(cuda)
    k.chunks[:] = np.arange(128, dtype=np.uint8).reshape(2, 64)
    # Block 3 <- chunk 1 slot 1; block 0 <- chunk 0 slot 0.
    k.tables([(3, 1, 1), (0, 0, 0)], nbytes=16)
    gate = cuda.stream_gate(s)
    assert k.launch(s, to_device=True) == SUCCESS
    at_gate(cuda, gate)
    assert all((layer == 0).all() for layer in k.layers)
    cuda.gate_open(gate)
    assert cuda.stream_synchronize(s) == SUCCESS
    chunk_rows = k.chunks.reshape(2, 2, 2, 16)  # chunk, slot, layer, bytes
    for li, layer in enumerate(k.layers):
        blocks = layer.numpy().reshape(4, 16)
        assert (blocks[3] == chunk_rows[1, 1, li]).all()
        assert (blocks[0] == chunk_rows[0, 0, li]).all()
        assert (blocks[1:3] == 0).all()
    # And back: device -> host into zeroed chunks.
    expected = k.chunks.copy()
    k.chunks[:] = 0
    assert k.launch(s, to_device=False) == SUCCESS
    assert cuda.stream_synchronize(s) == SUCCESS
    assert (k.chunks[1].reshape(2, 2, 16)[1] == expected[1].reshape(2, 2, 16)[1]).all()
    assert (k.chunks[0].reshape(2, 2, 16)[0] == expected[0].reshape(2, 2, 16)[0]).all()
    assert cuda.count("kernel_launches") == 2
    assert cuda.sticky() == 0


def test_kernel_drops_the_tail_that_is_not_a_whole_word(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    k = KernelSetup(cuda)
    k.chunks[:] = 0xAB
    k.tables([(1, 0, 0)], nbytes=13)
    assert k.launch(s, to_device=True) == SUCCESS
    assert cuda.stream_synchronize(s) == SUCCESS
    block = k.layers[0].numpy().reshape(4, 16)[1]
    assert (block[:8] == 0xAB).all()
    assert (block[8:] == 0).all()


def test_kernel_misaligned_access_is_a_sticky_716(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    k = KernelSetup(cuda)
    k.tables([(0, 0, 0)], nbytes=16, host_shift=4)
    assert k.launch(s, to_device=True) == SUCCESS
    assert cuda.stream_synchronize(s) == MISALIGNED_ADDRESS
    assert cuda.sticky() == MISALIGNED_ADDRESS
    assert cuda.get_last_error() == MISALIGNED_ADDRESS
    assert cuda.memcpy_async(0, 0, 0, s) == MISALIGNED_ADDRESS


def test_kernel_on_pageable_or_unmapped_host_memory_is_a_sticky_700(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    k = KernelSetup(cuda, flags=HOST_REGISTER_PORTABLE)  # pinned but not mapped
    k.tables([(0, 0, 0)], nbytes=16)
    assert k.launch(s, to_device=True) == SUCCESS
    assert cuda.stream_synchronize(s) == ILLEGAL_ADDRESS
    assert cuda.sticky() == ILLEGAL_ADDRESS


def test_kernel_on_pageable_host_memory_faults(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    k = KernelSetup(cuda)
    assert cuda.host_unregister(addr(k.chunks)) == SUCCESS
    k.tables([(0, 0, 0)], nbytes=16)
    assert k.launch(s, to_device=False) == SUCCESS
    assert cuda.stream_synchronize(s) == ILLEGAL_ADDRESS
    assert (k.chunks == 0).all()


def test_kernel_outside_device_memory_faults(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    k = KernelSetup(cuda)
    k.tables([(4, 0, 0)], nbytes=16)  # one block past the end of the layer
    assert k.launch(s, to_device=True) == SUCCESS
    assert cuda.stream_synchronize(s) == ILLEGAL_ADDRESS


def test_kernel_tables_must_be_device_memory(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    k = KernelSetup(cuda)
    k.tables([(0, 0, 0)], nbytes=16)
    cuda.remove_device_memory(k.table.data_ptr())
    assert k.launch(s, to_device=True) == SUCCESS
    assert cuda.stream_synchronize(s) == ILLEGAL_ADDRESS
    assert all((layer == 0).all() for layer in k.layers)


def test_kernel_needs_a_stream_of_the_current_device(cuda: FakeCuda) -> None:
    cuda.reset(2)
    assert cuda.set_device(1) == SUCCESS
    s1 = cuda.stream_create()
    k = KernelSetup(cuda, dev=1)
    k.tables([(0, 0, 0)], nbytes=16)
    assert cuda.set_device(0) == SUCCESS
    assert k.launch(s1, to_device=True) == INVALID_HANDLE
    assert cuda.get_last_error() == INVALID_HANDLE
    assert cuda.sticky() == 0
    assert cuda.count("kernel_launches") == 0
    assert cuda.set_device(1) == SUCCESS
    assert k.launch(s1, to_device=True) == SUCCESS
    assert cuda.stream_synchronize(s1) == SUCCESS


def test_kernel_device_memory_of_another_device_faults(cuda: FakeCuda) -> None:
    cuda.reset(2)
    s0 = cuda.stream_create()
    k = KernelSetup(cuda, dev=1)
    k.tables([(0, 0, 0)], nbytes=16)
    assert k.launch(s0, to_device=True) == SUCCESS
    assert cuda.stream_synchronize(s0) == ILLEGAL_ADDRESS


def test_kernel_without_uva_needs_device_aliases(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    k = KernelSetup(cuda)
    k.chunks[:] = 0x5A
    cuda.set_uva(False)
    k.tables([(0, 0, 0)], nbytes=16, host_shift=NON_UVA_OFFSET)
    assert k.launch(s, to_device=True) == SUCCESS
    assert cuda.stream_synchronize(s) == SUCCESS
    assert (k.layers[0].numpy()[:16] == 0x5A).all()
    # The plain host address is not mapped on the device.
    k.tables([(1, 0, 0)], nbytes=16)
    assert k.launch(s, to_device=True) == SUCCESS
    assert cuda.stream_synchronize(s) == ILLEGAL_ADDRESS
