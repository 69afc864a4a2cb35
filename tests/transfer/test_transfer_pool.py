"""HostChunkPool: exact-size mapping, buffer protocol, residency, close/GC safety."""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

from kvcache.transfer import HostChunkPool, TransferEngine

MiB = 1 << 20


def mapped_bytes(address: int, length: int) -> int:
    """How much of ``[address, address + length)`` is mapped, per /proc/self/maps. (The kernel
    may merge our mapping with a neighbour, so look at overlap, not at exact boundaries.)"""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            total += max(0, min(end, address + length) - max(start, address))
    return total


def present_bytes(address: int, length: int) -> int:
    """Resident bytes of the range according to /proc/self/pagemap (bit 63: page present),
    independent of the pool's own mincore-based count."""
    page = 4096
    first, count = address // page, -(-length // page)
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read(count * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * page


def test_import_pulls_in_neither_torch_nor_cuda() -> None:
    code = (
        "import sys, kvcache, kvcache.transfer as t\n"
        "p = t.HostChunkPool(4, 4096, pin=False)\n"
        "assert memoryview(p).nbytes == 4 * 4096\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_buffer_protocol_exports_exactly_the_requested_bytes() -> None:
    import torch

    with HostChunkPool(7, 3000, pin=False) as pool:
        view = memoryview(pool)
        assert view.nbytes == 7 * 3000 == pool.nbytes
        assert (view.format, view.itemsize, view.ndim, view.readonly) == ("B", 1, 1, False)
        assert view.c_contiguous
        assert pool.address % 4096 == 0
        assert pool.nbytes <= pool.mapped_bytes < pool.nbytes + 4096

        arr = np.frombuffer(pool, dtype=np.uint8)
        arr[3000:6000] = 9  # chunk 1
        flat = torch.frombuffer(pool, dtype=torch.uint8)
        tensor = pool.tensor()
        assert tensor.shape == (7, 3000)
        assert tensor.dtype == torch.uint8
        assert tensor.data_ptr() == pool.address == flat.data_ptr()
        assert bool((tensor[1] == 9).all())
        assert int(tensor[0].sum()) == 0 == int(tensor[2].sum())
        tensor[6, -1] = 5
        assert view[-1] == 5
        assert flat[-1] == 5
        del view, arr, flat, tensor


@pytest.mark.parametrize(
    ("args", "kwargs", "exc"),
    [
        ((0, 4096), {}, ValueError),
        ((4, 0), {}, ValueError),
        ((-1, 4096), {}, ValueError),
        ((4.0, 4096), {}, TypeError),
        ((True, 4096), {}, TypeError),
        ((4, "4096"), {}, TypeError),
        ((1 << 40, 1 << 40), {}, ValueError),
        ((4, 4096), {"pin": "yes"}, ValueError),
        ((4, 4096), {"pin": None}, ValueError),
    ],
)
def test_bad_construction_arguments(args: tuple, kwargs: dict, exc: type) -> None:
    with pytest.raises(exc):
        HostChunkPool(*args, **kwargs)


def test_resident_size_follows_touched_bytes_and_never_exceeds_request() -> None:
    chunk = 1 * MiB
    with HostChunkPool(64, chunk, pin=False) as pool:
        assert pool.resident_bytes() == 0
        assert present_bytes(pool.address, pool.mapped_bytes) == 0
        arr = np.frombuffer(pool, dtype=np.uint8)
        arr[: 16 * chunk] = 1  # touch a quarter
        touched = 16 * chunk
        for rss in (pool.resident_bytes(), present_bytes(pool.address, pool.mapped_bytes)):
            # Transparent huge pages may round the edges of the touched range up to 2 MiB.
            assert touched <= rss <= touched + 2 * MiB
        arr[:] = 2  # touch everything
        for rss in (pool.resident_bytes(), present_bytes(pool.address, pool.mapped_bytes)):
            assert pool.nbytes <= rss <= pool.mapped_bytes
        del arr
        pool.close()
        assert pool.resident_bytes() == 0
        assert present_bytes(pool.address, pool.mapped_bytes) == 0


def test_close_with_live_views_keeps_memory_mapped_and_readable() -> None:
    import torch

    pool = HostChunkPool(4, 8192, pin=False)
    address, length = pool.address, pool.mapped_bytes
    tensor = pool.tensor()
    raw = torch.frombuffer(pool, dtype=torch.uint8)  # holds the pool, not an export
    arr = np.frombuffer(pool, dtype=np.uint8)
    arr[:] = 7
    pool.close()
    pool.close()  # idempotent
    assert pool.closed
    assert not pool.pinned
    # Stale views read zeros instead of faulting, and can even be written.
    assert int(tensor.sum()) == 0
    assert int(raw.sum()) == 0
    assert int(arr.sum()) == 0
    arr[0] = 1
    assert int(tensor[0, 0]) == 1
    with pytest.raises(BufferError):
        memoryview(pool)
    with pytest.raises(ValueError, match="closed"):
        TransferEngine([torch.zeros(4, 8192, dtype=torch.uint8)], pool)
    del pool
    gc.collect()
    assert mapped_bytes(address, length) == length  # the views keep the range mapped
    del tensor, arr
    gc.collect()
    assert mapped_bytes(address, length) == length  # `raw` still refers to the pool object
    del raw
    gc.collect()
    assert mapped_bytes(address, length) == 0


def test_collecting_the_pool_unmaps_it() -> None:
    pool = HostChunkPool(3, 4096, pin=False)
    address = pool.address
    memoryview(pool)[0] = 1
    assert mapped_bytes(address, 3 * 4096) == 3 * 4096
    del pool
    gc.collect()
    assert mapped_bytes(address, 3 * 4096) == 0


def test_close_is_refused_while_a_transfer_holds_the_pool() -> None:
    import torch

    layer = torch.arange(8 * 64, dtype=torch.uint8).reshape(8, 64)
    pool = HostChunkPool(8, 64, pin=False)
    engine = TransferEngine([layer], pool)
    plan = engine.plan(store=True, gpu_block_ids=[1, 2], chunk_ids=[0, 5])  # holds a lease
    with pytest.raises(RuntimeError, match="in flight"):
        pool.close()
    assert not pool.closed
    del plan
    engine.wait([engine.store([1, 2], [0, 5])])
    pool.close()
    assert pool.closed
    with pytest.raises(ValueError, match="closed"):
        engine.store([3], [1])


def test_pin_auto_without_cuda_stays_pageable_quietly(caplog: pytest.LogCaptureFixture) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; covered by the GPU check")
    with caplog.at_level("WARNING"), HostChunkPool(2, 4096) as pool:
        assert not pool.pinned
    assert not caplog.records
    with pytest.raises(RuntimeError, match="CUDA"):
        HostChunkPool(2, 4096, pin=True)


def test_a_pool_over_a_callers_buffer_copies_into_it_and_leaves_it_on_close() -> None:
    """``buffer=``: the chunks are the caller's memory (vLLM's shared region under tiering):
    copies land there, the pool keeps the export while it lives, and closing it leaves the
    bytes alone."""
    import mmap

    import numpy as np
    import torch

    from kvcache.transfer import TransferEngine

    mapping = mmap.mmap(-1, 4 * 4096)
    pool = HostChunkPool(4, 4096, pin=False, buffer=mapping)
    layer = torch.arange(8 * 4096, dtype=torch.int32).to(torch.uint8).view(8, 4096)
    with TransferEngine([layer], pool) as engine:
        engine.wait([engine.store([5, 2], [3, 0])])
        assert engine.poll() == [(0, True)]
    view = np.frombuffer(mapping, dtype=np.uint8).reshape(4, 4096)
    assert (view[3] == layer[5].numpy()).all()
    assert (view[0] == layer[2].numpy()).all()
    with pytest.raises(BufferError):
        mapping.close()  # exported to the pool
    pool.close()
    assert (view[3] == layer[5].numpy()).all(), "closing the pool emptied the caller's memory"
    del view, pool, engine  # the engine's layout holds the pool too
    gc.collect()
    mapping.close()  # the pool let go of it
