"""The GPU check's copy paths: each runs the engine on one path and checks every byte it
moved against torch indexing of the source."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from check_devices import Device
from check_results import Row, Skip, check

KiB = 1024
PAGE = 16 * KiB  # functional paths: a page a kernel and DMA both take
SMALL_PAGE = 8 * KiB  # kernel paths
BLOCKS = 256  # device blocks per tensor in functional paths
LAYERS = 4


def run_jobs(engine: Any, submit: list[Callable[[], int]]) -> None:
    jobs = [s() for s in submit]
    engine.wait(jobs)
    results = engine.poll_results()
    bad = [r for r in results if not r.success]
    check(not bad, f"job failed: {bad[0].error if bad else ''}")
    check(len(results) == len(jobs), f"{len(results)} results for {len(jobs)} jobs")


def expect_chunk(
    device: Device, layers: list[Any], pool: Any, chunk: int, blocks: list[int], page: int
) -> int:
    """The chunk holds, per layer, the blocks' pages back to back (the default layout)."""
    torch = device.torch
    want = torch.cat([device.cpu(t[blocks]).reshape(-1) for t in layers])
    got = pool.tensor()[chunk][: want.numel()]
    check(torch.equal(got, want), f"chunk {chunk} holds wrong bytes")
    return int(want.numel())


def expect_blocks(device: Device, layers: list[Any], dst: list[int], src: list[int]) -> int:
    torch = device.torch
    n = 0
    for t in layers:
        c = device.cpu(t)
        check(torch.equal(c[dst], c[src]), "a loaded block holds wrong bytes")
        n += int(c[dst].numel())
    return n


def store_load(
    device: Device,
    row: Row,
    *,
    page: int,
    bpc: int = 4,
    seed: int,
    expedited: bool = False,
    **engine_kw: Any,
) -> Any:
    """Random blocks -> chunks, then the chunks back into other blocks; every byte checked."""
    layers = device.tensors(LAYERS, BLOCKS, page, seed)
    chunks = 8
    pool = device.pool(chunks * 2, LAYERS * bpc * page, "pinned")
    engine = device.engine(layers, pool, blocks_per_chunk=bpc, **engine_kw)
    rng = np.random.default_rng(seed)
    ids = [int(b) for b in rng.permutation(BLOCKS)]
    src, dst = ids[: chunks * bpc], ids[chunks * bpc : 2 * chunks * bpc]
    try:
        run_jobs(engine, [lambda: engine.store(src, list(range(chunks)))])
        for c in range(chunks):
            row.checked_bytes += expect_chunk(
                device, layers, pool, c, src[c * bpc : (c + 1) * bpc], page
            )
        run_jobs(engine, [lambda: engine.load(list(range(chunks)), dst, expedited=expedited)])
        row.checked_bytes += expect_blocks(device, layers, dst, src)
        row.methods = engine.jobs_by_method
        return engine
    finally:
        engine.close()
        pool.close()


def path_dma_batched(device: Device, row: Row) -> None:
    device.needs_cuda("DMA")
    store_load(device, row, page=PAGE, seed=1)
    check(
        row.methods.get("dma-batched") == 2,
        f"the batched driver call did not run both jobs: {row.methods}",
    )


def path_dma_per_run(device: Device, row: Row) -> None:
    device.needs_cuda("DMA")
    store_load(device, row, page=PAGE, seed=2, batch=False)
    check(row.methods.get("dma-per-run") == 2, f"not per run: {row.methods}")


def path_expedited(device: Device, row: Row) -> None:
    store_load(device, row, page=PAGE, seed=3, expedited=True)


def path_kernel_load(device: Device, row: Row) -> None:
    device.needs_cuda("the copy kernel")
    store_load(
        device,
        row,
        page=SMALL_PAGE,
        seed=4,
        copy="auto",
        kernel_max_run_bytes=1 << 20,
        kernel_min_runs=1,
    )
    check(row.methods.get("kernel") == 1, f"the load did not run by the kernel: {row.methods}")


def path_kernel_store(device: Device, row: Row) -> None:
    device.needs_cuda("the copy kernel")
    store_load(device, row, page=SMALL_PAGE, seed=5, copy="kernel")
    check(row.methods.get("kernel") == 2, f"not both by the kernel: {row.methods}")


def path_pinning(device: Device, row: Row) -> None:
    chunk_bytes = 1 << 20
    pool, far, release = device.pinning_pool(chunk_bytes)
    layers = device.tensors(2, 64, 4 * KiB, 6)
    groups = [[(0, 4 * KiB), (1, 4 * KiB)]]
    engine = device.engine(layers, pool, groups=groups, offsets=[0, 4 * KiB])
    try:
        state = pool.pin_status()["state"]
        check(state == "pinning", f"the pool was {state} before the first copy")
        # A chunk past the first GiB: its stripe is not the piece being registered.
        run_jobs(engine, [lambda: engine.store([5], [far])])
        row.checked_bytes += expect_chunk(device, layers, pool, far, [5], 4 * KiB)
        release()
        check(pool.wait_pinned(120.0)["state"] == "pinned", "pinning did not finish")
        run_jobs(engine, [lambda: engine.store([6], [0])])
        row.checked_bytes += expect_chunk(device, layers, pool, 0, [6], 4 * KiB)
        run_jobs(engine, [lambda: engine.load([far], [40]), lambda: engine.load([0], [41])])
        row.checked_bytes += expect_blocks(device, layers, [40, 41], [5, 6])
        row.methods = engine.jobs_by_method
    finally:
        release()
        engine.close()
        pool.close()


def path_ordering(device: Device, row: Row) -> None:
    device.needs_cuda("stream ordering")
    layers = device.tensors(2, 16, PAGE, 7)
    pool = device.pool(4, 2 * PAGE, "pinned")
    engine = device.engine(layers, pool)
    try:
        with device.pending_write(layers[0][3], 0xA5):
            job = engine.store([3], [1])
        engine.wait([job])
        check([r.success for r in engine.poll_results()] == [True], "the store failed")
        got = pool.tensor()[1][:PAGE]
        check(bool((got == 0xA5).all()), "the store did not wait for the pending write")
        row.checked_bytes = PAGE
        row.methods = engine.jobs_by_method
    finally:
        engine.close()
        pool.close()


def grouped(
    device: Device,
    row: Row,
    *,
    bpc: int,
    pages: list[int],
    groups: list[Any],
    extra: int,
    seed: int,
    **engine_kw: Any,
) -> Any:
    """Store then load through ``groups`` with each group entering its first chunk at slot 1;
    every host byte compared with where the layout puts it."""
    torch = device.torch
    layers = [device.tensors(1, 64, p, seed + i)[0] for i, p in enumerate(pages)]
    offsets, at = [], 0
    for p in pages:
        offsets.append(at)
        at += bpc * p
    chunk_bytes = at + extra
    pool = device.pool(16, chunk_bytes, "pinned")
    engine = device.engine(
        layers, pool, blocks_per_chunk=bpc, groups=groups, offsets=offsets, **engine_kw
    )
    n = 5  # blocks per group: from slot 1 they span two chunks or more
    per_group = -(-(1 + n) // bpc)
    src = [list(range(g * n, (g + 1) * n)) for g in range(len(groups))]
    dst = [list(range(40 + g * n, 40 + (g + 1) * n)) for g in range(len(groups))]
    chunks = list(range(len(groups) * per_group))
    sizes, starts = [n] * len(groups), [1] * len(groups)
    try:
        flat = [b for s in src for b in s]
        run_jobs(
            engine, [lambda: engine.store(flat, chunks, group_sizes=sizes, block_indices=starts)]
        )
        host = pool.tensor()
        for g, refs in enumerate(groups):
            for j, block in enumerate(src[g]):
                chunk, slot = g * per_group + (1 + j) // bpc, (1 + j) % bpc
                for t, nbytes in refs:
                    at = offsets[t] + slot * pages[t]
                    want = device.cpu(layers[t][block])[:nbytes]
                    check(
                        torch.equal(host[chunk][at : at + nbytes], want),
                        f"group {g} block {block} tensor {t}: wrong host bytes",
                    )
                    row.checked_bytes += nbytes
        flat_dst = [b for d in dst for b in d]
        run_jobs(
            engine, [lambda: engine.load(chunks, flat_dst, group_sizes=sizes, block_indices=starts)]
        )
        for g, refs in enumerate(groups):
            for t, nbytes in refs:
                c = device.cpu(layers[t])
                check(
                    torch.equal(c[dst[g], :nbytes], c[src[g], :nbytes]),
                    f"group {g} tensor {t}: wrong loaded bytes",
                )
                row.checked_bytes += nbytes * n
        row.methods = engine.jobs_by_method
        return engine.describe()
    finally:
        engine.close()
        pool.close()


def path_two_groups(device: Device, row: Row) -> None:
    # Group 1 shares tensor 1 with group 0 and copies a padded payload of tensor 2.
    groups = [[(0, PAGE), (1, PAGE)], [(1, PAGE), (2, PAGE - 4 * KiB)]]
    grouped(device, row, bpc=4, pages=[PAGE, PAGE, PAGE], groups=groups, extra=0, seed=8)


def path_odd_chunks(device: Device, row: Row) -> None:
    groups = [[(0, PAGE), (1, PAGE)]]
    # The kernel is allowed for every load (any cut-off): only the geometry may refuse it.
    described = grouped(
        device, row, bpc=3, pages=[PAGE, PAGE], groups=groups, extra=4, seed=9,
        copy="auto", kernel_max_run_bytes=1 << 30, kernel_min_runs=1,
    )  # fmt: skip
    if device.kind != "cpu":
        check(row.methods.get("kernel") == 0, f"the kernel ran: {row.methods}")
        check(
            "chunk size" in str(described.get("kernel")),
            f"the kernel was not refused: {described.get('kernel')}",
        )


def path_three_queues(device: Device, row: Row) -> None:
    layers = device.tensors(LAYERS, BLOCKS, PAGE, 10)
    pool = device.pool(16, LAYERS * 2 * PAGE, "pinned")
    engine = device.engine(layers, pool, blocks_per_chunk=2)
    try:
        run_jobs(engine, [lambda: engine.store([10, 11, 12, 13], [4, 5])])
        run_jobs(
            engine,
            [
                lambda: engine.store([20, 21], [0]),
                lambda: engine.load([4], [100, 101]),
                lambda: engine.load([5], [102, 103], expedited=True),
            ],
        )
        row.checked_bytes += expect_chunk(device, layers, pool, 0, [20, 21], PAGE)
        row.checked_bytes += expect_blocks(device, layers, [100, 101, 102, 103], [10, 11, 12, 13])
        row.methods = engine.jobs_by_method
    finally:
        engine.close()
        pool.close()


def path_self_check(device: Device, row: Row) -> None:
    layers = device.tensors(LAYERS, BLOCKS, PAGE, 11)
    pool = device.pool(8, LAYERS * 2 * PAGE, "pinned")
    from kvcache.transfer import TransferEngine

    engine = TransferEngine(layers, pool, blocks_per_chunk=2) if device.kind != "fake" else None
    if engine is None:
        raise Skip("the self-check builds real engines; on the fake it runs in the test suite")
    try:
        cause = engine.self_check()
        check(cause is None, f"self-check: {cause}")
        row.methods = {"checked": len(engine._backend.check_methods()[1])}
    finally:
        engine.close()
        pool.close()


PATHS: list[tuple[str, Callable[..., None]]] = [
    ("dma-batched", path_dma_batched),
    ("dma-per-run", path_dma_per_run),
    ("expedited", path_expedited),
    ("kernel-load", path_kernel_load),
    ("kernel-store", path_kernel_store),
    ("pinning", path_pinning),
    ("ordering", path_ordering),
    ("two-groups", path_two_groups),
    ("odd-chunks", path_odd_chunks),
    ("three-queues", path_three_queues),
    ("self-check", path_self_check),
]
