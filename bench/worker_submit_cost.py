"""Submit-side CPU time per transfer job: the installed vLLM's worker (0.33.0 or 0.34.0) vs
kvcache's, same jobs, one process.

What is timed: the model runner thread's CPU time (``time.thread_time_ns``) inside
``submit_store``/``submit_load`` of each worker, for the same job specs on the same KV layout
(one tensor per layer, one group, 16 blocks per chunk), each job's device side in the
installed release's form: under 0.34.0 the ``DevicePointers`` vLLM's connector resolves from
the job's block ids (``resolve_device_pointers``) before it calls either worker, which is not
in the ``submit`` figures; its CPU per job is the ``resolve`` column (next to nothing under
0.33.0, where the spec is passed as is). vLLM's worker runs as its spec builds it, on CPU
tensors with its CUDA edges faked and its batch copy stubbed out
(``tests/support/vllm_worker_oracle.py``): what remains is its Python/numpy descriptor building and
job bookkeeping. Ours runs as ``kvcache.vllm.CPUOffloadingSpec.get_worker`` builds it, with the
copy stubbed the same way (its queue threads build every job's runs and copy nothing): on the
submitting thread remain spec decoding, validation of every id (O(blocks)) and the hand-off
(under 0.34.0 also the check of every device pointer against the KV tensors, which turns them
back into block ids: Rust, O(pointers)); the runs are built on the queue's thread, as on a
GPU, where that thread also makes the driver calls. Neither worker touches KV or host memory,
so tensors and pools are never made resident (the 80-layer, 64 KiB points address 10 GiB of
"GPU" memory).

Two figures per job: ``submit`` is the calling thread's CPU time inside submit_store/submit_load
(what the model runner's step pays: the target is vLLM/ours >= 10); ``total`` is the whole
process's CPU time for submit + wait + get_finished, every thread included (the work moved to
the queue thread is counted there).

The hand-off, measured in the same rounds: after one more vLLM job, the calling thread's CPU
to queue one already-planned job on an idle ``CpuCopier`` of its own, i.e. to wake a parked
thread. Every store of ours pays it (its queue's thread has been idle since the last round),
so ``vLLM store / hand-off`` is the most that any submission through a queue thread can reach
at that point. On a virtual machine it depends on the host: waking a halted vCPU traps to the
hypervisor.

Ids: ``fresh`` = consecutive blocks and chunks (a new request on an empty block pool: ours
coalesces each layer's pages of a chunk into one run); ``churned`` = random distinct ids (a
steady-state block pool: nothing coalesces, one run per page on both sides).

Run from the repository root: ``python -m bench.worker_submit_cost [--quick] [--json PATH]``
(about 30 s). Prints a table (median microseconds of CPU per job, both directions, vLLM/ours, the
hand-off and vLLM's store over it), the smallest ratios and where, the timer floor, and the
descriptor floor: the CPU to write one (src, dst, size) triple per page with numpy, about the least
any DMA worker spends per job when nothing coalesces.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.vllm_worker_oracle import (
    Geometry,
    canonical,
    device_side,
    offloading_config,
    pointers_release,
    vllm_on_cpu,
)

KiB = 1024
BPC = 16
NUM_BLOCKS = 2048
LAYERS = (32, 80)
PAGES = (8 * KiB, 16 * KiB, 64 * KiB)
JOB_BLOCKS = (16, 1024)
PATTERNS = ("fresh", "churned")


@contextlib.contextmanager
def no_prefault() -> Iterator[None]:
    """vLLM's shared region prefaults its slot (it would make 5 GiB resident): skipped."""
    from vllm.v1.kv_offload.cpu import shared_offload_region as region

    saved = region._get_populate_write_fn
    region._get_populate_write_fn = lambda mmap_obj: lambda *args: None
    try:
        yield
    finally:
        region._get_populate_write_fn = saved


def build(layers: int, page: int, num_chunks: int) -> tuple[Any, Any, list[Any], Any]:
    """vLLM's worker and ours over the same (never touched) tensors, and their canonical
    caches."""
    import torch
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as VllmSpec

    import kvcache.vllm
    from kvcache.transfer._cpu_backend import CpuBackend

    geometry = Geometry(
        tensors=((page, page),) * layers,
        groups=(tuple((layer, page) for layer in range(layers)),),
        num_blocks=NUM_BLOCKS,
        blocks_per_chunk=BPC,
    )
    tensors = [torch.empty((NUM_BLOCKS, page), dtype=torch.int8) for _ in range(layers)]
    chunk = layers * page * BPC
    config = offloading_config(
        geometry,
        rank=0,
        cpu_bytes_to_use=num_chunks * chunk,
        engine_id=f"bench-{layers}-{page}",
        kvcache_pin="off",
    )
    caches = canonical(geometry, tensors)
    vllm_worker = VllmSpec(config).get_worker(caches)
    ours = kvcache.vllm.CPUOffloadingSpec(config).get_worker(caches)
    ours.engine._backend.close()
    ours.engine._backend = CpuBackend(execute=False)
    return vllm_worker, ours, tensors, caches


def make_jobs(
    rng: np.random.Generator, pattern: str, blocks: int, num_chunks: int, count: int
) -> list[tuple[list[int], list[int]]]:
    chunks = blocks // BPC
    jobs = []
    for _ in range(count):
        if pattern == "fresh":
            b0 = int(rng.integers(0, NUM_BLOCKS - blocks + 1))
            c0 = int(rng.integers(0, num_chunks - chunks + 1))
            jobs.append((list(range(b0, b0 + blocks)), list(range(c0, c0 + chunks))))
        else:
            jobs.append(
                (
                    rng.choice(NUM_BLOCKS, blocks, replace=False).tolist(),
                    rng.choice(num_chunks, chunks, replace=False).tolist(),
                )
            )
    return jobs


def time_point(
    vllm_worker: Any, ours: Any, spare: Any, caches: Any, jobs: list[Any], warmup: int
) -> dict[str, float]:
    """Median CPU microseconds per job, per worker and direction: ``submit`` on the calling
    thread alone, and ``total`` for submit + completion + get_finished over every thread of the
    process (ours builds the runs on its queue's thread). Jobs alternate between the workers so
    both see the same conditions.

    ``handoff``: in the same rounds, after one more (untimed) vLLM job, the calling thread's CPU
    to hand one planned job to ``spare``, an idle ``CpuCopier`` of its own: waking a parked
    thread, the part of our submit that no code of ours can remove (see ``main``).

    ``resolve``: the calling thread's CPU to make the job's device side from its spec (0.34.0:
    vLLM's ``resolve_device_pointers``, which its connector runs before either worker)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    samples: dict[str, list[float]] = {
        f"{w}_{d}_{m}": []
        for w in ("vllm", "ours")
        for d in ("store", "load")
        for m in ("submit", "total")
    }
    samples["handoff"] = []
    samples["resolve"] = []
    job_id = 0
    for i, (blocks, chunks) in enumerate(jobs):
        for name, worker in (("vllm", vllm_worker), ("ours", ours)):
            for direction in ("store", "load"):
                spec = GPULoadStoreSpec(blocks, [len(blocks)], [0])
                cpu = CPULoadStoreSpec(chunks)
                t0 = time.thread_time_ns()
                gpu = device_side(spec, caches)
                resolve = time.thread_time_ns() - t0
                job_id += 1
                p0 = time.process_time_ns()
                t0 = time.thread_time_ns()
                if direction == "store":
                    worker.submit_store(job_id, gpu, cpu)
                else:
                    worker.submit_load(job_id, cpu, gpu)
                submit = time.thread_time_ns() - t0
                worker.wait({job_id})
                results = worker.get_finished()
                total = time.process_time_ns() - p0
                assert [r.job_id for r in results] == [job_id]
                assert results[0].success
                if i >= warmup:
                    samples[f"{name}_{direction}_submit"].append(submit / 1e3)
                    samples[f"{name}_{direction}_total"].append(total / 1e3)
                    samples["resolve"].append(resolve / 1e3)
        plan = ours.engine.plan(store=True, gpu_block_ids=blocks[:BPC], chunk_ids=chunks[:1])
        job_id += 1
        gpu = device_side(GPULoadStoreSpec(blocks, [len(blocks)], [0]), caches)
        vllm_worker.submit_store(job_id, gpu, CPULoadStoreSpec(chunks))
        vllm_worker.wait({job_id})
        vllm_worker.get_finished()
        t0 = time.thread_time_ns()
        spare.submit(job_id, plan)
        handoff = time.thread_time_ns() - t0
        spare.wait([job_id])
        spare.poll()
        del plan
        if i >= warmup:
            samples["handoff"].append(handoff / 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def timer_floor() -> float:
    """CPU microseconds the timing itself reads for an empty body (median)."""
    reads = []
    for _ in range(2000):
        t0 = time.thread_time_ns()
        reads.append(time.thread_time_ns() - t0)
    return statistics.median(reads) / 1e3


def descriptor_floor(num_pages: int, page: int) -> float:
    """CPU microseconds (median) to write one ``(src, dst, size)`` int64 triple per page from
    shuffled page ids with vectorised numpy: about the least any DMA worker does per job when
    nothing coalesces, since the batched copy API takes these arrays. Compare it with the
    ``total`` figures of the churned rows."""
    ids = np.random.default_rng(0).permutation(num_pages).astype(np.int64)
    src, dst, size = (np.empty(num_pages, np.int64) for _ in range(3))
    reads = []
    for _ in range(50):
        t0 = time.thread_time_ns()
        np.multiply(ids, page, out=src)
        src += 1 << 40
        np.multiply(ids, page, out=dst)
        dst += 1 << 41
        size.fill(page)
        reads.append(time.thread_time_ns() - t0)
    return statistics.median(reads) / 1e3


def where(row: dict[str, Any]) -> str:
    return f"{row['layers']} layers, {row['page_kib']} KiB, {row['blocks']} blocks, {row['ids']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer jobs (a smoke run)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    import vllm

    from kvcache._core import CpuCopier

    rng = np.random.default_rng(2024)
    rows = []
    form = "DevicePointers" if pointers_release() else "GPULoadStoreSpec"
    print(f"vLLM {vllm.__version__}: the device side of a job is a {form}")
    print(
        f"{'layers':>6} {'page':>6} {'blocks':>6} {'ids':<8} | submit, us CPU/job: "
        f"{'vLLM st':>8} {'ours':>6} {'x':>6} {'vLLM ld':>8} {'ours':>6} {'x':>6} | "
        f"{'hand-off':>8} {'st x max':>8} | total, us CPU/job: vLLM st/ours, vLLM ld/ours | "
        f"{'resolve':>7}"
    )
    with vllm_on_cpu(copy=False), no_prefault():
        for layers in LAYERS:
            for page in PAGES:
                num_chunks = 2 * max(JOB_BLOCKS) // BPC
                vllm_worker, ours, tensors, caches = build(layers, page, num_chunks)
                spare = CpuCopier(execute=False)
                for blocks in JOB_BLOCKS:
                    for pattern in PATTERNS:
                        count = (60 if blocks > 16 else 400) // (4 if args.quick else 1)
                        warmup = max(2, count // 10)
                        jobs = make_jobs(rng, pattern, blocks, num_chunks, count)
                        t = time_point(vllm_worker, ours, spare, caches, jobs, warmup)
                        row = {
                            "layers": layers,
                            "page_kib": page // KiB,
                            "blocks": blocks,
                            "ids": pattern,
                            **{f"{k}_us": v for k, v in t.items()},
                            "ratio_store": t["vllm_store_submit"] / t["ours_store_submit"],
                            "ratio_load": t["vllm_load_submit"] / t["ours_load_submit"],
                            "ceiling_store": t["vllm_store_submit"] / t["handoff"],
                        }
                        rows.append(row)
                        print(
                            f"{layers:>6} {page // KiB:>4}Ki {blocks:>6} {pattern:<8} |"
                            f"{'':>20}{t['vllm_store_submit']:>8.1f} "
                            f"{t['ours_store_submit']:>6.1f} "
                            f"{row['ratio_store']:>5.1f}x {t['vllm_load_submit']:>8.1f} "
                            f"{t['ours_load_submit']:>6.1f} {row['ratio_load']:>5.1f}x | "
                            f"{t['handoff']:>8.1f} {row['ceiling_store']:>7.1f}x | "
                            f"{t['vllm_store_total']:>7.0f}/{t['ours_store_total']:<6.0f} "
                            f"{t['vllm_load_total']:>7.0f}/{t['ours_load_total']:<6.0f} | "
                            f"{t['resolve']:>7.1f}",
                            flush=True,
                        )
                vllm_worker.shutdown()
                ours.shutdown()
                spare.shutdown()
                del vllm_worker, ours, tensors, spare, caches
                gc.collect()
    floor = timer_floor()
    worst = min(rows, key=lambda r: min(r["ratio_store"], r["ratio_load"]))
    ceiling = min(rows, key=lambda r: r["ceiling_store"])
    print(f"timer floor (empty body): {floor:.2f} us")
    print(
        f"smallest vLLM/ours ratio: {min(worst['ratio_store'], worst['ratio_load']):.1f}x "
        f"({where(worst)}); target >= 10x"
    )
    print(
        f"smallest vLLM store / hand-off alone: {ceiling['ceiling_store']:.1f}x "
        f"({where(ceiling)}): the most a store submitted through a queue thread can reach here"
    )
    descriptors = {
        f"{layers}x{blocks}": descriptor_floor(layers * blocks, PAGES[0])
        for layers in LAYERS
        for blocks in JOB_BLOCKS
    }
    print(
        "descriptor floor (numpy writes of one src/dst/size triple per page, layers x blocks): "
        + ", ".join(f"{k}: {v:.1f} us" for k, v in descriptors.items())
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "vllm": vllm.__version__,
                    "rows": rows,
                    "timer_floor_us": floor,
                    "descriptor_floor_us": descriptors,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
