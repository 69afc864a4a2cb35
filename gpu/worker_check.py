"""GPU A/B of kvcache's vLLM worker against the installed vLLM's (0.33.0 or 0.34.0), on
identical layouts, with byte checks. One script, sized for under 5 minutes on one H200.

For each page size (4-64 KiB), both workers get identical KV tensors (16 layers, one group,
16 blocks per chunk) through their specs' ``get_worker`` and run the same jobs: 1, 64, 1024
and 6256 blocks (16 to 100,096 page descriptors), fresh (consecutive) and churned (random)
ids, stores then loads (into other blocks), each job's device side in the installed release's
form (0.34.0: the device pointers vLLM's ``resolve_device_pointers`` makes of its block ids,
outside the timed submit, as the connector does before calling either worker). Every store's
chunks are compared byte for byte between the two workers' host memory (vLLM's per-tensor
host views vs kvcache's pool; the layouts are the same), every load's destination blocks on
the GPU. Bandwidth is the job's bytes over submit-to-completion wall time (median of a few
runs), also as a percentage of the same run's large single copy in each direction. Next to
it, each worker's submit CPU per job: the calling thread's CPU time inside ``submit_*`` (what
the model runner's step pays), and the whole process's CPU time over the same interval (copy
threads included).
Start-up is reported too: how long kvcache's worker takes to return (pinning runs in the
background), how long pinning took, and the calibrated kernel/DMA cut-off for loads.

Targets: kvcache >= vLLM bandwidth at every page size; kvcache >= 90 % of the large copy at
>= 64 KiB pages, judged on jobs of at least 1024 page descriptors only (a job of 16
descriptors, 1 MiB at 64 KiB, is bound by launch and completion latency, not bandwidth; the
verdict line and the JSON say how many rows it left out). The table's method column is the
copy method kvcache's engine actually chose for the job (its per-method job counts around
it), not a guess from the page size. Prints a table and writes JSON (``--json``, else
``$OUT/gpu_worker_check.json`` when ``OUT`` is set, else ``./gpu_worker_check.json``),
rewritten after every row so that a run cut short still leaves its rows. A time budget
(``--budget-s``) skips the remaining rows on a slower machine.

Before anything runs, it checks that the A/B can: vLLM 0.33.0 or 0.34.0 importable with its
compiled ops (``vllm._C``), and enough free space in /dev/shm for vLLM's shared host region;
if not, it says why and exits with status 3. ``--without-vllm`` runs kvcache's side alone
instead (byte checks against torch indexing).

vLLM's worker is built in this one process as the only rank (world size 1). Its shared host
region then waits at a barrier over vLLM's world group, which only vLLM's distributed set-up
creates; for one rank that barrier has no one to wait for, so the script replaces it with a
no-op (counted in the JSON) while vLLM's worker is built, on CPU and on CUDA alike.

Exit status: 0 when every job succeeded and every byte check passed, and (unless
``--without-vllm``) vLLM's side ran for every page size and, on a GPU, every verdict could be
computed; 1 when a job failed or a byte check found a difference (before 4); 2 when CUDA is
not there; 3 when the A/B cannot start (above); 4 when the A/B was requested but came back
incomplete: vLLM's worker could not be built, a row lacks vLLM's figures, or (on a GPU) a
verdict could not be computed, rows were skipped by the time budget, or vLLM's host region
ended up pageable (its figures would not be vLLM's). The reasons are printed and listed
under ``ab_problems`` in the JSON. A missed target is reported in the verdicts, not in the
exit status: the figures are the result.

``--device cpu --quick`` is the dry run CI executes (small sizes, vLLM's worker on CPU tensors
through ``tests/support/vllm_worker_oracle.py``), so the script cannot rot.

Run: ``python gpu/worker_check.py`` (needs kvcache importable: an installed abi3 wheel is
enough; ``bash gpu/run.sh worker`` installs one privately and runs this, see ``gpu/README.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvcache.transfer._timing import Budget, device_sync, gb_per_s, repeat, time_job

KiB = 1024
REPO = Path(__file__).resolve().parent.parent
# The large-copy target applies from this page size, to jobs of at least this many page
# descriptors (smaller ones measure latency, not bandwidth).
LARGE_PAGE_KIB = 64
LARGE_JOB_DESCRIPTORS = 1024
EXIT_AB_INCOMPLETE = 4


# The vLLM releases whose worker the A/B runs against (kvcache supports both).
VLLM_RELEASES = ("0.33.0", "0.34.0")


def installed_vllm() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


def device_side(gpu: Any, caches: Any) -> Any:
    """A job's device side as the installed release's connector passes it: the
    ``GPULoadStoreSpec`` itself under 0.33.0; under 0.34.0 the device pointers vLLM resolves
    from it on the worker's canonical caches."""
    try:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers
    except ImportError:  # 0.33.0: no pointers
        return gpu
    return resolve_device_pointers(gpu, caches)


def out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def one_rank_barrier(calls: list[int]) -> Iterator[None]:
    """vLLM's shared host region, once mapped, waits for every rank at a barrier over vLLM's
    world group, which exists only after vLLM's distributed set-up (else ``get_world_group``
    asserts). Here one process is the only rank, so the barrier has no one to wait for: a
    no-op is what it means at world size 1, and nothing else of vLLM's worker is touched.
    ``calls[0]`` counts the calls, so a run shows that vLLM's worker went through it."""
    from vllm.v1.kv_offload.cpu import spec

    original = spec._all_workers_barrier  # an AttributeError here: vLLM changed, look again

    def barrier() -> None:
        calls[0] += 1

    spec._all_workers_barrier = barrier
    try:
        yield
    finally:
        spec._all_workers_barrier = original


class Runner:
    """One worker behind a small API: vLLM's or ours through their specs (vLLM installed), or
    ours through kvcache.transfer directly (no vLLM: same engine, same layout)."""

    def __init__(self, worker: Any, *, caches: Any = None, host_tensors: Any = None) -> None:
        self.worker = worker
        self.caches = caches  # the canonical caches it was built on (pointers resolve there)
        self.host_tensors = host_tensors  # vLLM's per-tensor host views, for byte checks

    def jobs_by_method(self) -> dict[str, int]:
        """kvcache's engine's per-method job counts; empty for vLLM's worker (and for a wheel
        older than the counts: its rows then say "?")."""
        return dict(getattr(getattr(self.worker, "engine", None), "jobs_by_method", {}))

    def job(self, blocks: list[int], chunks: list[int]) -> tuple[Any, Any]:
        """A job's arguments, made before its submission is timed (the connector builds and
        resolves them before calling the worker)."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        gpu = device_side(GPULoadStoreSpec(blocks, [len(blocks)], [0]), self.caches)
        return gpu, CPULoadStoreSpec(chunks)

    def submit(self, job_id: int, store: bool, job: tuple[Any, Any]) -> None:
        gpu, cpu = job
        if store:
            assert self.worker.submit_store(job_id, gpu, cpu)
        else:
            assert self.worker.submit_load(job_id, cpu, gpu)

    def finish(self, job_id: int) -> bool:
        self.worker.wait({job_id})
        results: list[Any] = []
        while not results:
            results = self.worker.get_finished()
        assert [r.job_id for r in results] == [job_id], results
        return bool(results[0].success)

    def host_chunk(self, chunk: int) -> Any:
        import torch

        if self.host_tensors is not None:
            return torch.cat([t[chunk] for t in self.host_tensors])
        return self.worker.pool.tensor()[chunk].view(torch.int8)

    def shutdown(self) -> None:
        self.worker.shutdown()


class EngineRunner(Runner):
    """kvcache's worker logic without vLLM: the engine the worker wraps, built the same way."""

    def job(self, blocks: list[int], chunks: list[int]) -> tuple[Any, Any]:
        return np.asarray(blocks, dtype=np.int64), np.asarray(chunks, dtype=np.int64)

    def submit(self, job_id: int, store: bool, job: tuple[Any, Any]) -> None:
        gpu, cpu = job
        sizes, starts = [len(gpu)], [0]
        engine = self.worker["engine"]
        if store:
            j = engine.store(gpu, cpu, group_sizes=sizes, block_indices=starts)
        else:
            j = engine.load(cpu, gpu, group_sizes=sizes, block_indices=starts)
        self.worker["jobs"][job_id] = j

    def jobs_by_method(self) -> dict[str, int]:
        return dict(getattr(self.worker["engine"], "jobs_by_method", {}))

    def finish(self, job_id: int) -> bool:
        engine = self.worker["engine"]
        j = self.worker["jobs"].pop(job_id)
        engine.wait([j])
        results: list[Any] = []
        while not results:
            results = engine.poll_results()
        assert [r.job_id for r in results] == [j]
        return bool(results[0].success)

    def host_chunk(self, chunk: int) -> Any:
        import torch

        return self.worker["pool"].tensor()[chunk].view(torch.int8)

    def shutdown(self) -> None:
        self.worker["engine"].close()
        self.worker["pool"].close()


class Check:
    """Settings, clock, results."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.quick = args.quick
        self.budget = Budget(args.budget_s)
        self.sync = device_sync(torch, self.device)
        self.rng = np.random.default_rng(7)
        self.skipped = 0
        self.barrier_calls = [0]
        if self.cuda:
            self.layers = 16
            self.pages = [4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB]
            self.job_blocks = [1, 64, 1024, 6256]
            self.reps = 3
        else:
            self.layers = 4
            self.pages = [4 * KiB, 16 * KiB]
            self.job_blocks = [1, 8, 32]
            self.reps = 1
        if self.quick and self.cuda:
            self.pages = [4 * KiB, 64 * KiB]
            self.job_blocks = [1, 1024]
        self.bpc = 16
        self.num_blocks = 2 * max(self.job_blocks) + self.bpc
        self.num_chunks = 2 * -(-max(self.job_blocks) // self.bpc) + 2
        self.vllm = "--without-vllm given" if args.without_vllm else self._vllm_status()

    def _vllm_status(self) -> str | None:
        """None when the installed vLLM's worker can run here, else why not."""
        try:
            import vllm
        except Exception as exc:
            return f"vLLM not importable ({type(exc).__name__}: {exc})"
        version = getattr(vllm, "__version__", "?")
        if version not in VLLM_RELEASES:
            return f"vLLM {version} installed, not {' or '.join(VLLM_RELEASES)}"
        if self.cuda:
            try:
                import vllm._C  # the compiled ops its worker needs on a GPU
            except Exception as exc:
                return f"vllm._C (vLLM's compiled ops) not importable: {exc}"
        need = self.num_chunks * self.layers * max(self.pages) * self.bpc
        try:
            free = os.statvfs("/dev/shm")
            free_bytes = free.f_bavail * free.f_frsize
        except OSError as exc:
            return f"/dev/shm unusable ({exc}); vLLM's worker keeps its host memory there"
        if free_bytes < need + (64 << 20):
            return (
                f"/dev/shm has {free_bytes / 2**30:.2f} GiB free, vLLM's worker needs "
                f"{need / 2**30:.2f} GiB there (docker: --shm-size)"
            )
        return None

    def elapsed(self) -> float:
        return self.budget.elapsed()

    def over_budget(self) -> bool:
        return self.budget.over()

    # --- set-up ---------------------------------------------------------------------------

    def tensors(self, page: int, seed: int) -> list[Any]:
        torch = self.torch
        gen = torch.Generator(device=self.device).manual_seed(seed)
        return [
            torch.randint(
                -128, 127, (self.num_blocks, page), dtype=torch.int8, device=self.device,
                generator=gen,
            )
            for _ in range(self.layers)
        ]  # fmt: skip

    def config(self, page: int, **extra: Any) -> Any:
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        from tests.support.vllm_configs import offloading_config

        chunk = self.layers * page * self.bpc
        return offloading_config(
            {
                "cpu_bytes_to_use": self.num_chunks * self.aligned(chunk),
                "kvcache_worker": True,  # opt-in until a GPU run has passed
                **extra,
            },
            worker_kv_bytes_per_block=self.layers * page,
            group_layers=("g",),
            blocks_per_chunk=self.bpc,
            engine_id=f"kvcache-gpu-check-{uuid.uuid4().hex}",
            dtype="bfloat16",
        )

    def aligned(self, chunk: int) -> int:
        """A chunk's bytes as vLLM's spec sizes it (rounded to its block alignment)."""
        align = 4096  # vLLM's CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT (0.33.0 and 0.34.0)
        if self.vllm is None or not self.cuda:
            try:
                from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as VllmSpec

                align = int(VllmSpec.BLOCK_SIZE_ALIGNMENT)
            except (ImportError, AttributeError):
                pass
        return -(-chunk // align) * align

    def canonical(self, tensors: list[Any], page: int) -> Any:
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
        )

        return CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in tensors],
            group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page)
                              for i in range(len(tensors))]],
        )  # fmt: skip

    @contextlib.contextmanager
    def vllm_context(self) -> Iterator[None]:
        """What building vLLM's worker here needs: on CPU, the oracle's fakes of its CUDA
        edges; on both, the one-rank barrier (applied last, so that on CPU too it is the
        script's barrier vLLM's worker goes through, not the oracle's)."""
        if self.vllm is not None:
            yield
            return
        with contextlib.ExitStack() as stack:
            if not self.cuda:
                sys.path.insert(0, str(REPO))
                from tests.support.vllm_worker_oracle import vllm_on_cpu

                stack.enter_context(vllm_on_cpu())
            stack.enter_context(one_rank_barrier(self.barrier_calls))
            yield

    def build(self, page: int) -> dict[str, Any]:
        """Both workers over identical tensors (ours first, timed)."""
        seed = int(self.rng.integers(1 << 30))
        ours_t = self.tensors(page, seed)
        t0 = time.perf_counter()
        if self.vllm is None:  # a tested vLLM is here: ours as vLLM builds it, through the spec
            import kvcache.vllm

            spec = kvcache.vllm.CPUOffloadingSpec(self.config(page))
            if spec.num_chunks < self.num_chunks:
                raise RuntimeError(
                    f"the spec bought {spec.num_chunks} chunks, the jobs need {self.num_chunks}"
                )
            caches = self.canonical(ours_t, page)
            worker = spec.get_worker(caches)
            if not isinstance(worker, kvcache.vllm.CPUOffloadingWorker):
                raise RuntimeError(f"kvcache's spec handed over {type(worker).__name__}")
            ours: Runner = Runner(worker, caches=caches)
            pool, describe = worker.pool, worker.describe
        else:
            from kvcache.transfer import HostChunkPool, TransferEngine

            chunk = self.layers * page * self.bpc
            pool = HostChunkPool(self.num_chunks, chunk, pin="background" if self.cuda else False)
            engine = TransferEngine(
                ours_t,
                pool,
                blocks_per_chunk=self.bpc,
                groups=[[(i, page) for i in range(self.layers)]],
                offsets=[i * self.bpc * page for i in range(self.layers)],
                log_failures=False,
            )
            ours = EngineRunner({"engine": engine, "pool": pool, "jobs": {}})
            # What the worker runs at start-up (through the spec it is part of get_worker).
            cause = engine.self_check()
            if cause is not None:
                raise RuntimeError(f"kvcache's start-up self-check failed: {cause}")

            def describe() -> dict[str, Any]:
                return {"pool_bytes": pool.nbytes, **engine.describe()}

        returned = time.perf_counter() - t0
        pinned = pool.wait_pinned(600.0) if self.cuda else {"state": "cpu"}
        pinned_s = time.perf_counter() - t0
        pool.kernel_ready  # noqa: B018 - finishes the pinning bookkeeping (and logs)
        built: dict[str, Any] = {
            "ours": ours,
            "ours_t": ours_t,
            "startup": {
                "page_kib": page // KiB,
                "pool_gib": pool.nbytes / 2**30,
                "returned_s": returned,
                "pinned_s": pinned_s,
                "pin_state": pinned.get("state"),
                **describe(),
            },
        }
        if self.vllm is None:
            from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as VllmSpec

            vllm_t = self.tensors(page, seed)
            t0 = time.perf_counter()
            barriers = self.barrier_calls[0]
            caches = self.canonical(vllm_t, page)
            try:
                worker = VllmSpec(self.config(page)).get_worker(caches)
            except Exception as exc:  # e.g. a /dev/shm too small for vLLM's shared region
                # The rows of this page size then lack vLLM's figures; main turns that into
                # a failed run (EXIT_AB_INCOMPLETE), with this reason.
                built["startup"]["vllm_error"] = f"{type(exc).__name__}: {exc}"
                out(f"vLLM's worker could not be built at {page // KiB} KiB: {exc}")
                return built
            built["startup"]["vllm_returned_s"] = time.perf_counter() - t0
            built["startup"]["vllm_barrier_calls"] = self.barrier_calls[0] - barriers
            region = getattr(worker, "_mmap_region", None)
            built["startup"]["vllm_pinned"] = bool(region is not None and region.is_pinned)
            # Its host views: 0.34.0's handler calls them cpu_tensors, 0.33.0's dst_tensors.
            handler = worker._store_handler
            host = getattr(handler, "cpu_tensors", None) or handler.dst_tensors
            built["vllm"] = Runner(worker, caches=caches, host_tensors=host)
            built["vllm_t"] = vllm_t
        return built

    # --- jobs -------------------------------------------------------------------------------

    def job(self, blocks: int, pattern: str, exclude: set[int]) -> tuple[list[int], list[int]]:
        chunks = -(-blocks // self.bpc)
        if pattern == "fresh":
            if exclude:  # a range clear of the excluded ids (sources sit in the lower half)
                starts = np.arange(self.num_blocks - blocks + 1)
                lo, hi = min(exclude), max(exclude) + 1
                starts = starts[(starts + blocks <= lo) | (starts >= hi)]
            else:
                starts = np.arange(self.num_blocks // 2 - blocks + 1)
            b0 = int(self.rng.choice(starts))
            c0 = int(self.rng.integers(0, self.num_chunks - chunks + 1))
            return list(range(b0, b0 + blocks)), list(range(c0, c0 + chunks))
        free = np.setdiff1d(np.arange(self.num_blocks), np.fromiter(exclude, dtype=np.int64))
        ids = self.rng.choice(free, blocks, replace=False).tolist()
        return ids, self.rng.choice(self.num_chunks, chunks, replace=False).tolist()

    def run(
        self, runner: Runner, store: bool, blocks: list[int], chunks: list[int]
    ) -> tuple[float, float, float, bool, set[str]]:
        """Wall time, the calling thread's submit CPU, the process's CPU over the submit call,
        success, and the copy methods kvcache's engine handed the job to (empty for vLLM)."""
        job_id = int(self.rng.integers(1 << 40))
        job = runner.job(blocks, chunks)
        before = runner.jobs_by_method()
        timing = time_job(
            lambda: runner.submit(job_id, store, job),
            lambda _: runner.finish(job_id),
            sync=self.sync,
            cpu=True,
        )
        after = runner.jobs_by_method()
        methods = {m for m, n in after.items() if n > before.get(m, 0)}
        thread_s, process_s = timing.submit_thread_s, timing.submit_process_s
        assert thread_s is not None  # cpu=True measured both
        assert process_s is not None
        return timing.wall_s, thread_s, process_s, timing.result, methods

    def expected_chunk(self, tensors: list[Any], blocks: list[int], k: int, page: int) -> Any:
        """Chunk ``k`` of a store of ``blocks`` from ``tensors``, built with torch indexing."""
        torch = self.torch
        ids = blocks[k * self.bpc : (k + 1) * self.bpc]
        parts = []
        for t in tensors:
            seg = torch.zeros(self.bpc * page, dtype=torch.int8)
            seg[: len(ids) * page] = t[torch.as_tensor(ids, device=t.device)].reshape(-1).cpu()
            parts.append(seg)
        return torch.cat(parts)

    def check_store(
        self, built: dict[str, Any], blocks: list[int], chunks: list[int], page: int
    ) -> str:
        torch = self.torch
        sample = (
            range(len(chunks))
            if len(chunks) <= 16
            else self.rng.choice(len(chunks), 16, replace=False)
        )
        for k in sample:
            ours = built["ours"].host_chunk(chunks[k])
            if "vllm" in built:
                want = built["vllm"].host_chunk(chunks[k])
            else:
                want = self.expected_chunk(built["ours_t"], blocks, int(k), page)
            n = min(len(blocks) - int(k) * self.bpc, self.bpc)
            for layer in range(self.layers):
                a = ours[layer * self.bpc * page : layer * self.bpc * page + n * page]
                b = want[layer * self.bpc * page : layer * self.bpc * page + n * page]
                if not torch.equal(a, b):
                    return f"chunk {chunks[k]} layer {layer} differs after store"
        return ""

    def check_load(self, built: dict[str, Any], blocks: list[int], src: list[int]) -> str:
        torch = self.torch
        idx = torch.as_tensor(blocks, device=self.device)
        for layer in range(self.layers):
            ours = built["ours_t"][layer][idx]
            if "vllm" in built:
                want = built["vllm_t"][layer][idx]
            else:
                want = built["ours_t"][layer][torch.as_tensor(src, device=self.device)]
            if not torch.equal(ours, want):
                return f"layer {layer} differs after load"
        return ""

    def baseline(self) -> dict[str, float]:
        """One large copy each way between pinned host memory and the device."""
        torch = self.torch
        nbytes = (1 << 30) if self.cuda and not self.quick else (64 << 20)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        result = {}
        for name, (dst, src) in (("store", (host, dev)), ("load", (dev, host))):

            def copy(dst: Any = dst, src: Any = src) -> None:
                dst.copy_(src, non_blocking=True)

            times = repeat(copy, 3, warmup=1, sync=self.sync)
            result[f"{name}_gbps"] = gb_per_s(nbytes, min(times))
        return result

    def grid(
        self, baseline: dict[str, float], rows: list[dict[str, Any]], startups: list[dict[str, Any]]
    ) -> None:
        """Appends every row and start-up record, calling ``self.saved()`` after each."""
        with self.vllm_context():
            for page in self.pages:
                if self.over_budget():
                    self.skipped += len(self.job_blocks) * 4
                    continue
                built = self.build(page)
                startups.append(built["startup"])
                self.saved()
                try:
                    for row in self.page_rows(built, page, baseline):
                        rows.append(row)
                        self.saved()
                finally:
                    built["ours"].shutdown()
                    if "vllm" in built:
                        built["vllm"].shutdown()
                    built.clear()
                    if self.cuda:
                        self.torch.cuda.empty_cache()

    def saved(self) -> None:
        """Rewrites the JSON report (set up by main)."""

    def page_rows(
        self, built: dict[str, Any], page: int, baseline: dict[str, float]
    ) -> Iterator[dict[str, Any]]:
        workers = ["ours"] + (["vllm"] if "vllm" in built else [])
        for blocks in self.job_blocks:
            for pattern in ("fresh", "churned"):
                if self.over_budget():
                    self.skipped += 1
                    continue
                src, chunks = self.job(blocks, pattern, set())
                dst, _ = self.job(blocks, pattern, set(src))
                nbytes = len(src) * self.layers * page
                for store in (True, False):
                    row: dict[str, Any] = {
                        "page_kib": page // KiB,
                        "blocks": blocks,
                        "descriptors": blocks * self.layers,
                        "ids": pattern,
                        "direction": "store" if store else "load",
                        "bytes": nbytes,
                    }
                    for who in workers:
                        walls, submits, processes = [], [], []
                        methods: set[str] = set()
                        for _ in range(self.reps):
                            ids = src if store else dst
                            wall, submit, process, ok, used = self.run(
                                built[who], store, ids, chunks
                            )
                            if not ok:
                                row[f"{who}_error"] = "job reported failure"
                            walls.append(wall)
                            submits.append(submit)
                            processes.append(process)
                            methods |= used
                        if who == "ours":
                            # Several methods: the repetitions did not all take the same one.
                            row["ours_method"] = "+".join(sorted(methods)) or "?"
                        row[f"{who}_gbps"] = gb_per_s(nbytes, statistics.median(walls))
                        row[f"{who}_submit_us"] = statistics.median(submits) * 1e6
                        row[f"{who}_submit_process_us"] = statistics.median(processes) * 1e6
                    ref = baseline[f"{row['direction']}_gbps"]
                    row["ours_pct_of_large_copy"] = 100 * row["ours_gbps"] / ref
                    row["check"] = (
                        self.check_store(built, src, chunks, page)
                        if store
                        else self.check_load(built, dst, src)
                    ) or "ok"
                    self.print_row(row)
                    yield row

    def print_row(self, r: dict[str, Any]) -> None:
        vllm = (
            f"{r['vllm_gbps']:>7.1f} {r['vllm_submit_us']:>9.0f}"
            if "vllm_gbps" in r
            else f"{'-':>7} {'-':>9}"
        )
        ratio = f"{r['ours_gbps'] / r['vllm_gbps']:>5.2f}" if "vllm_gbps" in r else f"{'-':>5}"
        out(
            f"{r['page_kib']:>4}Ki {r['descriptors']:>7} {r['ids']:<7} {r['direction']:<5} "
            f"{r['ours_method']:<6} {r['ours_gbps']:>7.1f} {r['ours_submit_us']:>9.0f} {vllm} "
            f"{ratio} {r['ours_pct_of_large_copy']:>6.0f}%  {r['check']}"
        )


def verdicts(
    rows: list[dict[str, Any]], pages: list[int], *, cuda: bool, ab: bool
) -> list[dict[str, Any]]:
    """The targets, per page size: ``passed`` True/False, or None when the rows to judge are
    missing (then ``reason`` says why). On CPU nothing is judged: the figures mean nothing
    for a GPU."""
    if not cuda:
        return []
    found = []
    for page in sorted(p // KiB for p in pages):
        at_page = [r for r in rows if r["page_kib"] == page]
        if ab:
            mine = [r for r in at_page if "vllm_gbps" in r]
            worse = [r for r in mine if r["ours_gbps"] < r["vllm_gbps"]]
            v: dict[str, Any] = {
                "target": "kvcache >= vLLM",
                "page_kib": page,
                "rows": len(mine),
                "passed": not worse if mine else None,
            }
            if mine:
                v["text"] = f"kvcache >= vLLM in {len(mine) - len(worse)}/{len(mine)} rows" + (
                    f" (below in: {[(r['descriptors'], r['ids'], r['direction']) for r in worse]})"
                    if worse
                    else ""
                )
            else:
                v["reason"] = "no row with vLLM's figures"
            found.append(v)
        if page >= LARGE_PAGE_KIB:
            big = [r for r in at_page if r["descriptors"] >= LARGE_JOB_DESCRIPTORS]
            low = [r for r in big if r["ours_pct_of_large_copy"] < 90]
            v = {
                "target": ">= 90 % of the large copy",
                "page_kib": page,
                "scope": f"jobs of >= {LARGE_JOB_DESCRIPTORS} page descriptors",
                "rows": len(big),
                "rows_not_judged": len(at_page) - len(big),
                "passed": not low if big else None,
            }
            if big:
                v["text"] = (
                    f">= 90 % of the large copy in {len(big) - len(low)}/{len(big)} rows of "
                    f">= {LARGE_JOB_DESCRIPTORS} page descriptors ({len(at_page) - len(big)} "
                    "smaller, latency-bound rows not judged)"
                )
            else:
                v["reason"] = f"no row of >= {LARGE_JOB_DESCRIPTORS} page descriptors"
            found.append(v)
    return found


def ab_problems(
    check: Check, rows: list[dict[str, Any]], startups: list[dict[str, Any]],
    judged: list[dict[str, Any]],
) -> list[str]:  # fmt: skip
    """Why the A/B asked for is incomplete (empty: it is complete)."""
    problems = [
        f"vLLM's worker could not be built at {s['page_kib']} KiB: {s['vllm_error']}"
        for s in startups
        if "vllm_error" in s
    ]
    built = {s["page_kib"] for s in startups if "vllm_error" not in s}
    missing = sorted({r["page_kib"] for r in rows if "vllm_gbps" not in r} & built)
    problems += [f"rows at {page} KiB lack vLLM's figures" for page in missing]
    for v in judged:
        if v["passed"] is None:
            problems.append(f"{v['page_kib']} KiB, {v['target']}: not computed, {v['reason']}")
    if check.cuda:
        # vLLM's worker on pageable memory (cudaHostRegister unavailable or refused) runs
        # every copy at pageable speed: beating it would prove nothing.
        problems += [
            f"vLLM's host region is not pinned at {s['page_kib']} KiB: its figures are not "
            "vLLM's as deployed"
            for s in startups
            if "vllm_error" not in s and not s.get("vllm_pinned", False)
        ]
    if check.cuda and check.skipped:
        problems.append(
            f"time budget reached: {check.skipped} row(s) skipped, so the verdicts do not "
            "cover the whole grid (raise --budget-s)"
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_worker_check")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--budget-s", type=float, default=250.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--without-vllm",
        action="store_true",
        help="run kvcache's side alone, through the engine, as on a machine without vLLM",
    )
    args = parser.parse_args(argv)
    import torch

    import kvcache

    if args.device == "cuda" and not torch.cuda.is_available():
        out("CUDA is not available (use --device cpu for the dry run)")
        return 2
    check = Check(args)
    if check.vllm is not None and not args.without_vllm:
        out(
            f"the A/B against vLLM's worker cannot run: {check.vllm}. Fix that, or pass "
            "--without-vllm to check kvcache's worker alone."
        )
        return 3
    name = torch.cuda.get_device_name(check.device) if check.cuda else "cpu"
    out(f"kvcache {kvcache.__version__} worker check on {name}; torch {torch.__version__}")
    if check.vllm is not None:
        out(f"A/B against vLLM skipped: {check.vllm}; byte checks use torch indexing")
    path = args.json
    if path is None:
        out_dir = os.environ.get("OUT")
        path = Path(out_dir) / "gpu_worker_check.json" if out_dir else Path("gpu_worker_check.json")
    rows: list[dict[str, Any]] = []
    startups: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "schema": 2,
        "device": name,
        "torch": torch.__version__,
        "kvcache": kvcache.__version__,
        "kvcache_path": str(Path(kvcache.__file__).resolve().parent),
        "vllm": check.vllm or installed_vllm(),
        "ab": check.vllm is None,
        "complete": False,
        "startup": startups,
        "rows": rows,
    }

    def saved() -> None:
        report["skipped"] = check.skipped
        report["elapsed_s"] = check.elapsed()
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str))
        tmp.replace(path)

    check.saved = saved  # type: ignore[method-assign]
    baseline = check.baseline()
    report["baseline"] = baseline
    saved()
    out(
        f"large single copy: store {baseline['store_gbps']:.1f} GB/s, "
        f"load {baseline['load_gbps']:.1f} GB/s"
    )
    out(
        f"{'page':>6} {'descr':>7} {'ids':<7} {'dir':<5} {'method':<6} {'GB/s':>7} "
        f"{'submit us':>9} {'vLLM':>7} {'submit us':>9} {'ratio':>5} {'%large':>7}  bytes"
    )
    check.grid(baseline, rows, startups)
    for s in startups:
        out(
            f"start-up at {s['page_kib']} KiB: worker returned in {s['returned_s']:.2f} s, pool "
            f"{s['pool_gib']:.1f} GiB {s['pin_state']} after {s['pinned_s']:.2f} s; load cut-off "
            f"{(s.get('kernel_max_run_bytes') or 0) // KiB} KiB"
            + (
                f"; vLLM's worker returned in {s['vllm_returned_s']:.2f} s, its host region "
                + ("pinned" if s["vllm_pinned"] else "pageable")
                if "vllm_returned_s" in s
                else ""
            )
        )
    for line in submit_summary(rows):
        out(line)
    judged = verdicts(rows, check.pages, cuda=check.cuda, ab=report["ab"])
    report["verdicts"] = judged
    if not check.cuda:
        out("CPU dry run: bandwidth targets apply to a GPU and are not judged")
    for v in judged:
        verdict = {True: "met", False: "MISSED", None: "NOT COMPUTED"}[v["passed"]]
        out(f"{v['page_kib']} KiB, {v['target']}: {verdict}; {v.get('text') or v['reason']}")
    if check.skipped:
        out(f"time budget reached: {check.skipped} row(s) skipped")
    problems = ab_problems(check, rows, startups, judged) if report["ab"] else []
    report["ab_problems"] = problems
    failed = [r for r in rows if r["check"] != "ok" or any(k.endswith("_error") for k in r)]
    status = 1 if failed else EXIT_AB_INCOMPLETE if problems else 0
    for problem in problems:
        out(f"A/B INCOMPLETE: {problem}")
    report["exit_status"] = status
    report["complete"] = True
    saved()
    out(f"wrote {path} ({check.elapsed():.0f} s)")
    return status


def submit_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Median submit CPU per job, per page size and worker: the calling thread's, and the
    whole process's over the submit call."""
    lines = []
    for page in sorted({r["page_kib"] for r in rows}):
        mine = [r for r in rows if r["page_kib"] == page]
        parts = []
        for who, label in (("ours", "kvcache"), ("vllm", "vLLM")):
            if f"{who}_submit_us" not in mine[0]:
                continue
            thread = statistics.median(r[f"{who}_submit_us"] for r in mine)
            process = statistics.median(r[f"{who}_submit_process_us"] for r in mine)
            parts.append(f"{label} {thread:.0f} us (process {process:.0f} us)")
        lines.append(f"{page} KiB submit CPU per job, median over rows: " + ", ".join(parts))
    return lines


if __name__ == "__main__":
    sys.exit(main())
