"""The GPU check of kvcache's data path: every copy path, every byte, one table, one JSON.

Run on a CUDA machine with torch and Triton (no vLLM, no Rust needed: an installed abi3 wheel
of kvcache is enough, see ``bench/gpu_check.sh``)::

    python bench/gpu_check.py [--json PATH] [--budget-s 240]

Paths, each checked byte for byte against torch indexing of the source:

- ``dma-batched``: a store and a load by DMA through the driver's ``cuMemcpyBatchAsync``; the
  engine's record of what ran (``jobs_by_method``) must say the batched call ran both jobs;
- ``dma-per-run``: the same with one ``cudaMemcpyAsync`` per run;
- ``expedited``: a load on the expedited queue;
- ``kernel-load``, ``kernel-store``: small pages through the Triton copy kernel;
- ``pinning``: copies submitted while the pool is still being pinned in the background, then
  after it has finished;
- ``ordering``: a store of a block the compute stream is still writing (a sleep kernel, then
  the write): the store must see the written bytes;
- ``two-groups``: two KV groups sharing a tensor, one padded, entering their first chunk
  part-way; ``odd-chunks``: 3 blocks per chunk and a chunk size that is not a multiple of 8
  (the kernel must refuse it, DMA must move it);
- ``three-queues``: a store, a load and an expedited load in flight together;
- ``worker-0.33``, ``worker-0.34``: kvcache's vLLM worker under each release's contract
  (block ids; device pointers), through the project's stand-ins for vLLM's types
  (``bench/vllm_standins.py``), each in a child process;
- ``self-check``: the worker's start-up self-check on this device;
- ``bandwidth``: each page size (4-128 KiB) stored and loaded next to one large copy in each
  direction, the machine's limit. vLLM's own worker cannot run here (its compiled ops need the
  torch it was built for), so the figures are compared with the large copy, not with vLLM.

``--device cpu`` runs what needs no GPU (the Rust CPU copier, the worker contracts) and marks
the rest skipped with why; ``--device fake`` runs the CUDA backend on the fake CUDA runtime of
``tests/fakecuda`` (DMA, kernel model, pinning, ordering), bandwidth skipped. Both exit 0 when
nothing failed; ``make test`` runs them. Exit status: 0 every path run passed, 1 a path
failed, 2 ``--device cuda`` without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
KiB = 1024
PAGE = 16 * KiB  # functional paths: a page a kernel and DMA both take
SMALL_PAGE = 8 * KiB  # kernel paths
BLOCKS = 256  # device blocks per tensor in functional paths
LAYERS = 4
NOTE = (
    "vLLM's own worker is not run: its compiled ops need the torch it was built for, so the "
    "bandwidth is compared with one large copy in each direction (the machine's limit)."
)


def out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Skip(Exception):
    """A path that cannot run on this device (the message says why)."""


@dataclass
class Row:
    name: str
    status: str = "passed"
    why: str = ""
    methods: dict[str, int] = field(default_factory=dict)
    checked_bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "why": self.why,
            "methods": self.methods,
            "checked_bytes": self.checked_bytes,
            "seconds": round(self.seconds, 3),
        }


class Failed(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Failed(what)


# --- devices ----------------------------------------------------------------------------------


class Device:
    """Where the "GPU" tensors live and how engines reach them."""

    kind = "cpu"

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def tensors(self, count: int, blocks: int, page: int, seed: int) -> list[Any]:
        gen = self.torch.Generator().manual_seed(seed)
        host = [
            self.torch.randint(0, 256, (blocks, page), dtype=self.torch.uint8, generator=gen)
            for _ in range(count)
        ]
        return [self.place(t) for t in host]

    def place(self, t: Any) -> Any:
        return t

    def cpu(self, t: Any) -> Any:
        return t.cpu()

    def pool(self, num_chunks: int, chunk_bytes: int, pin: str) -> Any:
        from kvcache.transfer import HostChunkPool

        return HostChunkPool(num_chunks, chunk_bytes, pin=False)

    def engine(self, layers: list[Any], pool: Any, **kw: Any) -> Any:
        from kvcache.transfer import TransferEngine

        kw.pop("batch", None)
        kw.pop("copy", None)
        kw.pop("kernel_max_run_bytes", None)
        kw.pop("kernel_min_runs", None)
        return TransferEngine(layers, pool, **kw)

    def sync(self) -> None:
        pass

    def needs_cuda(self, what: str) -> None:
        raise Skip(f"{what} needs CUDA or the fake runtime (--device cuda|fake)")

    def needs_gpu(self, what: str) -> None:
        raise Skip(f"{what} needs a GPU (--device cuda)")

    @contextlib.contextmanager
    def pending_write(self, block: Any, value: int) -> Iterator[None]:
        """Within the block, the compute stream is still writing ``value`` into ``block``."""
        self.needs_cuda("a pending compute-stream write")
        yield

    def pinning_pool(self, chunk_bytes: int) -> tuple[Any, int, Callable[[], None]]:
        """A pool whose background pinning is still running, a chunk copies may use meanwhile,
        and a function that lets the pinning finish."""
        self.needs_cuda("background pinning")
        raise AssertionError

    def info(self) -> dict[str, Any]:
        return {"type": "cpu", "torch": self.torch.__version__}


class CudaDevice(Device):
    kind = "cuda"

    def __init__(self) -> None:
        super().__init__()
        self.dev = self.torch.device("cuda", self.torch.cuda.current_device())

    def place(self, t: Any) -> Any:
        return t.to(self.dev)

    def pool(self, num_chunks: int, chunk_bytes: int, pin: str) -> Any:
        from kvcache.transfer import HostChunkPool

        mode: Any = {"pinned": True, "background": "background", "pageable": False}[pin]
        return HostChunkPool(num_chunks, chunk_bytes, pin=mode, device=self.dev.index)

    def engine(self, layers: list[Any], pool: Any, **kw: Any) -> Any:
        from kvcache.transfer import TransferEngine

        batch = kw.pop("batch", True)
        engine = TransferEngine(layers, pool, **kw)
        if not batch:
            for q in engine._backend._dma.values():
                q.stop_batching()
        return engine

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.dev)

    def needs_cuda(self, what: str) -> None:
        return None

    def needs_gpu(self, what: str) -> None:
        return None

    @contextlib.contextmanager
    def pending_write(self, block: Any, value: int) -> Iterator[None]:
        # ~50 ms of device time before the write: the store is submitted long before it lands.
        self.torch.cuda._sleep(100_000_000)
        block.fill_(value)
        yield

    def pinning_pool(self, chunk_bytes: int) -> tuple[Any, int, Callable[[], None]]:
        num = (8 << 30) // chunk_bytes  # 8 GiB: pinning takes a while (~0.1 s per GiB)
        pool = self.pool(num, chunk_bytes, "background")
        return pool, num - 1, lambda: None

    def info(self) -> dict[str, Any]:
        props = self.torch.cuda.get_device_properties(self.dev)
        driver = ctypes.c_int(0)
        with contextlib.suppress(OSError):
            ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(driver))
        return {
            "type": "cuda",
            "name": props.name,
            "index": self.dev.index,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "torch": self.torch.__version__,
            "cuda": self.torch.version.cuda,
            "driver": f"{driver.value // 1000}.{driver.value % 1000 // 10}",
            "triton": _version("triton"),
        }


class FakeDevice(Device):
    """The CUDA backend on the fake CUDA runtime of tests/fakecuda (CPU memory declared as
    device memory; streams on threads; the kernel's model)."""

    kind = "fake"

    def __init__(self) -> None:
        super().__init__()
        sys.path.insert(0, str(REPO))
        from tests.fakecuda import shim

        self.shim = shim
        shim.fake().reset(1)
        self.cuda = shim.TorchCuda(1)
        self.corrupt = False

    def pool(self, num_chunks: int, chunk_bytes: int, pin: str) -> Any:
        from kvcache.transfer import HostChunkPool

        pool = HostChunkPool(num_chunks, chunk_bytes, pin=False)
        if pin == "pinned":
            self.shim.pin(pool)
        return pool

    def engine(self, layers: list[Any], pool: Any, **kw: Any) -> Any:
        kw.setdefault("copy", "dma")
        if self.corrupt:
            self.shim.fake().corrupt_copy(1)
        return self.shim.engine_on_fake(layers, pool, cuda=self.cuda, **kw)

    def needs_cuda(self, what: str) -> None:
        return None

    @contextlib.contextmanager
    def pending_write(self, block: Any, value: int) -> Iterator[None]:
        f = self.shim.fake()
        staged = self.torch.full_like(block, value)
        f.device_tensor(0, staged)
        compute = self.cuda.compute[0].cuda_stream
        gate = f.stream_gate(compute)
        check(
            f.memcpy_async(block.data_ptr(), staged.data_ptr(), block.numel(), compute) == 0,
            "queueing the compute write",
        )
        try:
            yield
        finally:
            f.gate_open(gate)
            f.stream_synchronize(compute)

    def pinning_pool(self, chunk_bytes: int) -> tuple[Any, int, Callable[[], None]]:
        from kvcache.transfer import HostChunkPool

        f = self.shim.fake()
        num = (2 << 30) // chunk_bytes  # two 1 GiB pieces: copies wait only for their own
        pool = HostChunkPool(num, chunk_bytes, pin=False)
        f.register_gate(True)
        self.shim.pin(pool, background=True)
        for _ in range(2000):
            if f.registers_waiting():
                break
            time.sleep(0.005)
        return pool, num - 1, lambda: f.register_gate(False)

    def info(self) -> dict[str, Any]:
        return {"type": "fake", "torch": self.torch.__version__, "runtime": "tests/fakecuda"}


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


# --- helpers ----------------------------------------------------------------------------------


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


# --- paths ------------------------------------------------------------------------------------


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


def path_worker(device: Device, row: Row, contract: str, args: argparse.Namespace) -> None:
    """kvcache's worker under a release's contract, in a child process (the release is chosen
    at import)."""
    child = subprocess.run(
        [sys.executable, __file__, "--device", args.device, "--worker-contract", contract],
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [ln for ln in child.stdout.splitlines() if ln.startswith("WORKER ")]
    if child.returncode != 0 or not lines:
        raise Failed(f"the worker child failed: {(child.stdout + child.stderr)[-1500:]}")
    result = json.loads(lines[-1][len("WORKER ") :])
    row.checked_bytes = result["checked_bytes"]
    row.methods = result["methods"]
    if result.get("failed"):
        raise Failed(result["failed"])


def worker_child(device_kind: str, contract: str) -> int:
    """Runs in the child: the stand-ins of vLLM ``contract``, then kvcache's worker."""
    sys.path.insert(0, str(REPO / "bench"))
    import vllm_standins

    vllm_standins.install(f"{contract}.0")
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    CPUOffloadingWorker = vllm_standins.import_worker().CPUOffloadingWorker

    device = make_device(device_kind)
    torch = device.torch
    page, bpc = PAGE, 4
    raw = device.tensors(3, BLOCKS, page, 12)
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t.view(torch.int8), page) for t in raw],
        [
            [CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)],
            [CanonicalKVCacheRef(2, page - 4 * KiB)],
        ],
    )
    worker = CPUOffloadingWorker(caches, blocks_per_chunk=bpc, num_chunks=16, pin="blocking")
    if device.kind == "fake":
        eng = worker.engine
        on_fake = device.engine(
            eng._layers,
            eng.pool,
            blocks_per_chunk=bpc,
            groups=eng._group_refs,
            offsets=eng._offsets,
        )
        eng._backend.close()
        eng._backend, on_fake._backend = on_fake._backend, eng._backend
        on_fake._closed = True

    def device_side(spec: Any) -> Any:
        if contract == "0.33":
            return spec
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

        return resolve_device_pointers(spec, caches)

    checked = 0
    failed = None
    try:
        src = GPULoadStoreSpec([3, 4, 5, 6, 7, 9, 10], [4, 3], [1, 0])
        worker.submit_store(1, device_side(src), CPULoadStoreSpec([0, 1, 2]))
        worker.wait({1})
        dst = GPULoadStoreSpec([30, 31, 32, 33, 40, 41, 42], [4, 3], [1, 0])
        worker.submit_load(2, CPULoadStoreSpec([0, 1, 2]), device_side(dst), expedited=True)
        worker.wait({2})
        results = worker.get_finished() + worker.get_finished()
        if sorted((r.job_id, r.success) for r in results) != [(1, True), (2, True)]:
            failed = f"results {results}"
        for t, pairs in (
            (0, [(3, 30), (4, 31), (5, 32), (6, 33)]),
            (1, [(3, 30), (4, 31), (5, 32), (6, 33)]),
        ):
            c = device.cpu(raw[t])
            for s, d in pairs:
                if not torch.equal(c[d], c[s]):
                    failed = f"tensor {t} block {s} -> {d}"
                checked += page
        c = device.cpu(raw[2])
        for s, d in ((7, 40), (9, 41), (10, 42)):
            if not torch.equal(c[d][: page - 4 * KiB], c[s][: page - 4 * KiB]):
                failed = f"tensor 2 block {s} -> {d}"
            checked += page - 4 * KiB
        methods = worker.engine.jobs_by_method
    finally:
        worker.shutdown()
    out("WORKER " + json.dumps({"checked_bytes": checked, "methods": methods, "failed": failed}))
    return 0


# --- bandwidth --------------------------------------------------------------------------------


def bandwidth(device: Device, budget_end: float) -> list[dict[str, Any]]:
    """GB/s of a store and a load of ~256 MiB at each page size (scattered blocks, the method
    the engine chooses), and of one large pinned copy in each direction."""
    torch = device.torch
    rows: list[dict[str, Any]] = []
    job_bytes = 256 << 20

    def timed(fn: Callable[[], Any]) -> float:
        best = float("inf")
        for _ in range(4):
            device.sync()
            t0 = time.perf_counter()
            fn()
            device.sync()
            best = min(best, time.perf_counter() - t0)
        return best

    def large_copies() -> tuple[float, float]:
        host = torch.empty(job_bytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(job_bytes, dtype=torch.uint8, device=device.dev)  # type: ignore[attr-defined]
        h2d = job_bytes / timed(lambda: dev.copy_(host, non_blocking=True)) / 1e9
        d2h = job_bytes / timed(lambda: host.copy_(dev, non_blocking=True)) / 1e9
        return h2d, d2h

    h2d, d2h = large_copies()
    rows.append({"page_kib": None, "what": "large copy", "store_gbps": d2h, "load_gbps": h2d})
    for page_kib in (4, 8, 16, 32, 64, 128):
        if time.monotonic() > budget_end:
            rows.append({"page_kib": page_kib, "skipped": "time budget"})
            continue
        page = page_kib * KiB
        layers_n, bpc = 8, 16
        chunk = layers_n * bpc * page
        chunks = job_bytes // chunk
        blocks = 2 * chunks * bpc
        layers = [
            torch.empty((blocks, page), dtype=torch.uint8, device=device.dev)  # type: ignore[attr-defined]
            for _ in range(layers_n)
        ]
        pool = device.pool(chunks, chunk, "pinned")
        engine = device.engine(layers, pool, blocks_per_chunk=bpc)
        rng = np.random.default_rng(page_kib)
        ids = rng.permutation(blocks)[: chunks * bpc]
        cids = np.arange(chunks)
        try:
            store_s, load_s, before, after = _time_jobs(engine, ids, cids, timed)
        finally:
            engine.close()
            pool.close()
        ran = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
        nbytes = chunks * chunk
        rows.append(
            {
                "page_kib": page_kib,
                "what": "scattered job",
                "job_mib": nbytes >> 20,
                "store_gbps": nbytes / store_s / 1e9,
                "load_gbps": nbytes / load_s / 1e9,
                "store_pct_of_large": 100 * nbytes / store_s / 1e9 / d2h,
                "load_pct_of_large": 100 * nbytes / load_s / 1e9 / h2d,
                "methods": ran,
            }
        )
    return rows


def _time_jobs(
    engine: Any, ids: Any, cids: Any, timed: Callable[[Callable[[], Any]], float]
) -> tuple[float, float, dict[str, int], dict[str, int]]:
    """Best store and load times of one job over ``ids``/``cids``, and the engine's method
    counts around them."""

    def one(store: bool) -> None:
        job = engine.store(ids, cids) if store else engine.load(cids, ids)
        engine.wait([job])
        check(all(r.success for r in engine.poll_results()), "bandwidth job failed")

    before = engine.jobs_by_method
    store_s = timed(lambda: one(True))
    load_s = timed(lambda: one(False))
    return store_s, load_s, before, engine.jobs_by_method


# --- main -------------------------------------------------------------------------------------


def make_device(kind: str) -> Device:
    if kind == "cuda":
        return CudaDevice()
    if kind == "fake":
        return FakeDevice()
    return Device()


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu", "fake"], default="cuda")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--worker-contract", choices=["0.33", "0.34"], help=argparse.SUPPRESS)
    # A negative control for the test suite: on the fake, every DMA job's first copy flips a
    # byte, which the byte checks must catch.
    parser.add_argument("--corrupt", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_contract:
        return worker_child(args.device, args.worker_contract)
    started = time.monotonic()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            out("no CUDA device: run with --device cpu or --device fake")
            return 2
    device = make_device(args.device)
    if args.corrupt:
        if not isinstance(device, FakeDevice):
            parser.error("--corrupt needs --device fake")
        device.corrupt = True
    out(f"kvcache GPU check on {args.device}: {NOTE}")
    rows: list[Row] = []
    for name, fn in PATHS:
        rows.append(run_path(name, lambda row, fn=fn: fn(device, row)))
    for contract in ("0.33", "0.34"):
        rows.append(
            run_path(
                f"worker-{contract}", lambda row, c=contract: path_worker(device, row, c, args)
            )
        )
    bw_row = Row("bandwidth")
    bw: list[dict[str, Any]] = []
    if args.device != "cuda":
        bw_row.status, bw_row.why = "skipped", "needs a GPU (--device cuda)"
    else:
        t0 = time.perf_counter()
        try:
            bw = bandwidth(device, started + args.budget_s)
            skipped = [r["page_kib"] for r in bw if "skipped" in r]
            if skipped:
                bw_row.status, bw_row.why = "failed", f"time budget: {skipped} KiB not measured"
        except Exception as exc:
            bw_row.status, bw_row.why = "failed", f"{type(exc).__name__}: {exc}"
        bw_row.seconds = time.perf_counter() - t0
    rows.append(bw_row)
    print_table(rows, bw)
    passed = all(r.status != "failed" for r in rows)
    report = {
        "device": device.info(),
        "kvcache": _version("kvcache-offload"),
        "kvcache_path": str(Path(sys.modules["kvcache"].__file__ or "").parent),
        "note": NOTE,
        "paths": [r.as_dict() for r in rows],
        "bandwidth": bw,
        "passed": passed and all(r.status == "passed" for r in rows),
        "seconds": round(time.monotonic() - started, 1),
    }
    target = args.json or Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=1) + "\n")
    out(f"JSON: {target}")
    return 0 if passed else 1


def run_path(name: str, fn: Callable[[Row], None]) -> Row:
    row = Row(name)
    t0 = time.perf_counter()
    try:
        fn(row)
    except Skip as why:
        row.status, row.why = "skipped", str(why)
    except Exception as exc:
        row.status = "failed"
        row.why = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    row.seconds = time.perf_counter() - t0
    return row


def print_table(rows: list[Row], bw: list[dict[str, Any]]) -> None:
    out(f"{'path':<14} {'status':<8} {'bytes checked':>14} {'s':>6}  methods / why")
    for r in rows:
        detail = (
            r.why
            if r.status != "passed"
            else ", ".join(f"{k}={v}" for k, v in r.methods.items() if v)
        )
        out(f"{r.name:<14} {r.status:<8} {r.checked_bytes:>14,} {r.seconds:>6.2f}  {detail}")
    if bw:
        out()
        head = ("page", "store GB/s", "% large", "load GB/s", "% large")
        out("{:>8} {:>11} {:>8} {:>10} {:>8}  methods".format(*head))
        for b in bw:
            if "skipped" in b:
                out(f"{b['page_kib']:>6}KiB  skipped ({b['skipped']})")
            elif b["page_kib"] is None:
                out(f"{'large':>8} {b['store_gbps']:>11.1f} {'':>8} {b['load_gbps']:>10.1f}")
            else:
                store = f"{b['store_gbps']:>11.1f} {b['store_pct_of_large']:>7.0f}%"
                load = f"{b['load_gbps']:>10.1f} {b['load_pct_of_large']:>7.0f}%"
                out(f"{b['page_kib']:>6}KiB {store} {load}  {b['methods']}")


if __name__ == "__main__":
    sys.exit(main())
