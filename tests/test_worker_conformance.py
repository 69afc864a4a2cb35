"""kvcache's vLLM worker against the installed vLLM's own worker (0.33.0 or 0.34.0), on
identical CPU tensors.

vLLM's ``CPUOffloadingWorker`` runs as built by its ``CPUOffloadingSpec.get_worker`` (shared
/dev/shm region, per-rank slots, its descriptor logic), with only its CUDA edges faked and its
batch copy replaced by a byte copy (see ``tests/vllm_worker_oracle.py``). Ours runs through
``kvcache.vllm.CPUOffloadingSpec.get_worker`` on the same tensors (the Rust CPU copier). Each
job's device side is what that release's connector passes: the ``GPULoadStoreSpec`` under
0.33.0, under 0.34.0 the ``DevicePointers`` vLLM's ``resolve_device_pointers`` makes of it for
each worker's own tensors.

Random geometries (1-3 KV groups sharing tensors, padded pages, strided blocks, any of 1-16
blocks per chunk, 1-4 ranks, tensor and pipeline parallel: each stage's ranks hold their own
tensors) and random job sequences (partial first and last chunks, stores
that skip leading null blocks, stores reading the null block in place of some of their blocks
(vLLM 0.34.0's placeholders), loads naming a block twice, several jobs in flight, expedited
loads, then batches with stores and loads in flight together); after every batch with a store,
every host byte of each rank's slot is identical, after every batch with a load every device
byte, and every job's result (success, transfer_size) is the same. The same sequences also run
through our CUDA backend's DMA path (Rust queues, events, batched or per-run copies) over the
fake CUDA runtime of tests/fakecuda (streams that run later, enforced events), and (fewer of
them, see tests/test_worker_kernel_conformance.py) through its Triton copy kernel under
Triton's interpreter. Not covered here: real streams, DMA and the kernel on a GPU
(gpu/worker_check.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import require_oracle
from tests.vllm_worker_oracle import (
    Geometry,
    Groups,
    RankPair,
    Tensors,
    build_pairs,
    device_bytes,
    vllm_on_cpu,
)
from tests.vllm_worker_oracle import submit as submit_job

pytestmark = pytest.mark.oracle


@dataclass(frozen=True)
class Job:
    store: bool
    block_ids: list[int]
    group_sizes: list[int]
    block_indices: list[int]
    chunk_ids: list[int]
    expedited: bool = False


def random_job(
    rng: np.random.Generator,
    geometry: Geometry,
    *,
    store: bool,
    blocks: list[int],
    chunks: list[int],
) -> Job | None:
    """One job using (and consuming) ids from ``blocks`` and ``chunks``: per group a random
    block count and logical start (its remainder modulo blocks_per_chunk is the skip)."""
    bpc = geometry.blocks_per_chunk
    sizes, starts, gpu, cpu = [], [], [], []
    for _ in geometry.groups:
        n = int(rng.integers(0, 2 * bpc + 3))
        start = int(rng.integers(0, 4 * bpc))
        need = 0 if n == 0 else -(-(start % bpc + n) // bpc)
        if n > len(blocks) or need > len(chunks):
            n, need = 0, 0
        sizes.append(n)
        starts.append(start if n else int(rng.integers(0, 4)))
        gpu += [blocks.pop() for _ in range(n)]
        cpu += [chunks.pop() for _ in range(need)]
    if not gpu:
        return None
    if store and rng.integers(0, 3) == 0:
        # Null blocks inside the job's chunks: vLLM 0.34.0's scheduler keeps them in a store
        # as placeholders (copied, so later blocks keep their slots); block 0 is the null
        # block and is never drawn otherwise.
        for p in rng.choice(len(gpu), int(rng.integers(1, len(gpu) + 1)), replace=False):
            gpu[int(p)] = 0
    if not store and len(gpu) > 1 and rng.integers(0, 3) == 0:
        # A destination named twice (vLLM's scheduler repeats the null block in a Mamba
        # group's gaps): vLLM's worker writes it twice, the later occurrence last.
        p = int(rng.integers(1, len(gpu)))
        gpu[p] = gpu[int(rng.integers(0, p))]
    return Job(
        store, gpu, sizes, starts, cpu, expedited=not store and bool(rng.integers(0, 3) == 0)
    )


def submit(pair: RankPair, job_id: int, job: Job) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    for worker, caches in pair.workers():
        # Fresh spec objects for each worker, as the connector would pass them (under 0.34.0
        # resolved to device pointers on that worker's own caches).
        gpu = GPULoadStoreSpec(job.block_ids, job.group_sizes, job.block_indices)
        cpu = CPULoadStoreSpec(job.chunk_ids)
        assert submit_job(
            worker, caches, job_id, store=job.store, gpu=gpu, cpu=cpu, expedited=job.expedited
        )


def finish(pairs: list[RankPair], job_ids: list[int]) -> None:
    """Waits for the jobs on both sides and checks that both report the same results."""
    for pair in pairs:
        for worker in (pair.vllm_worker, pair.our_worker):
            worker.wait({*job_ids, -12345})  # an id it does not own is ignored
        theirs = {r.job_id: (r.success, r.transfer_size) for r in pair.vllm_worker.get_finished()}
        ours = {r.job_id: (r.success, r.transfer_size) for r in pair.our_worker.get_finished()}
        assert set(theirs) == set(job_ids)
        assert ours == theirs
        assert all(ok for ok, _ in ours.values())
        assert pair.our_worker.get_finished() == []


def through_fake_cuda(pair: RankPair, batched: bool) -> None:
    """Routes our worker's jobs through the CUDA backend (its DMA queues, streams, events and
    batched or per-run copies, all in Rust) over the fake CUDA runtime of ``tests/fakecuda``:
    streams run later on threads of their own, events are enforced, and the copies are real
    memmoves of the CPU tensors (declared device memory), so every byte lands where a GPU copy
    would put it. The caller resets the fake once per sequence."""
    from tests.fakecuda.shim import engine_on_fake

    engine = pair.our_worker.engine
    on_fake = engine_on_fake(
        engine._layers,
        engine.pool,
        batch=batched,
        blocks_per_chunk=engine.blocks_per_chunk,
        groups=engine._group_refs,
        offsets=engine._offsets,
    )
    engine._backend.close()
    engine._backend, on_fake._backend = on_fake._backend, engine._backend
    on_fake._closed = True  # its backend (the CPU one just closed) is the engine's old one


def draw_batch(
    rng: np.random.Generator, geometry: Geometry, num_chunks: int, kinds: list[bool], next_id: int
) -> list[tuple[int, Job]]:
    """Jobs to have in flight together (``kinds``: store or not, per job). They never share a
    destination, nor does a load read a chunk a store writes or write a block a store reads:
    ids are drawn without replacement across the whole batch."""
    blocks = [int(b) for b in rng.permutation(np.arange(1, geometry.num_blocks))]
    chunks = [int(c) for c in rng.permutation(num_chunks)]
    batch = []
    for store in kinds:
        job = random_job(rng, geometry, store=store, blocks=blocks, chunks=chunks)
        if job is not None:
            batch.append((next_id + len(batch), job))
    return batch


def run_sequence(
    geometry: Geometry,
    seed: int,
    rounds: int = 3,
    *,
    backend: str | Callable[[RankPair], None] = "cpu",
) -> int:
    """Store/load rounds through every rank, then rounds with stores and loads in flight
    together; returns the number of jobs checked per rank. ``backend``: "cpu" (the Rust CPU
    copier), "fake-cuda" (see :func:`through_fake_cuda`), or a function that gives one rank's
    engine another backend."""
    rng = np.random.default_rng(seed)
    cpu_bytes = (
        24
        * -(
            -geometry.world_size
            * geometry.worker_kv_bytes_per_block
            * geometry.blocks_per_chunk
            // 4096
        )
        * 4096
    )
    with vllm_on_cpu():
        pairs = build_pairs(geometry, cpu_bytes_to_use=cpu_bytes, seed=seed)
        try:
            num_chunks = pairs[0].vllm_spec.num_chunks
            assert num_chunks == pairs[0].our_spec.num_chunks == 24
            if backend == "fake-cuda":
                from tests.fakecuda.shim import fake

                fake().reset(1)
            for pair in pairs:
                if callable(backend):
                    backend(pair)
                elif backend == "fake-cuda":
                    through_fake_cuda(pair, batched=bool(seed % 2))
            next_id = 0
            plan: list[list[bool]] = []
            for _ in range(rounds):
                for store in (True, False):
                    plan.append([store] * int(rng.integers(1, 4)))
            for _ in range(2):  # mixed: stores and loads in flight together
                plan.append([bool(rng.integers(0, 2)) for _ in range(int(rng.integers(2, 5)))])
            for kinds in plan:
                batch = draw_batch(rng, geometry, num_chunks, kinds, next_id)
                next_id += len(batch)
                for pair in pairs:
                    for job_id, job in batch:
                        submit(pair, job_id, job)
                finish(pairs, [job_id for job_id, _ in batch])
                for pair in pairs:
                    if any(job.store for _, job in batch):
                        assert pair.our_host().numpy().tobytes() == (
                            pair.vllm_host_slot().contiguous().numpy().tobytes()
                        )
                    if not all(job.store for _, job in batch):
                        assert device_bytes(pair.our_tensors) == device_bytes(pair.vllm_tensors)
            if backend == "fake-cuda":
                # The driver call the run claims to have used is the one that ran.
                methods = [p.our_worker.engine.jobs_by_method for p in pairs]
                ran = {k for m in methods for k, n in m.items() if n}
                assert ran <= ({"dma-batched"} if seed % 2 else {"dma-per-run"}), methods
                assert (fake().count("batch_ok") > 0) == (bool(seed % 2) and bool(ran))
            return next_id
        finally:
            for pair in pairs:
                pair.shutdown()


def _draw_stage(draw: st.DrawFn, num_groups: int) -> tuple[Tensors, Groups]:
    """One pipeline stage's tensors (padded pages, strided blocks) and its groups' references
    to them (shared tensors, unpadded payloads)."""
    num_tensors = draw(st.integers(1, 5))
    tensors = []
    for _ in range(num_tensors):
        page = 8 * draw(st.integers(1, 48))
        stride = page + 8 * draw(st.sampled_from([0, 0, 1, 5]))  # strided (packed) blocks
        tensors.append((page, stride))
    groups = []
    for _ in range(num_groups):
        chosen = draw(st.lists(st.integers(0, num_tensors - 1), min_size=1, max_size=4))
        refs = []
        for t in chosen:
            page = tensors[t][0]
            payload = draw(
                st.sampled_from([page, page, max(1, page - 8 * draw(st.integers(0, 3)))])
            )
            refs.append((t, max(1, payload)))
        groups.append(tuple(refs))
    return tuple(tensors), tuple(groups)


@st.composite
def geometries(draw: st.DrawFn) -> Geometry:
    num_groups = draw(st.integers(1, 3))
    tensors, groups = _draw_stage(draw, num_groups)
    world_size = draw(st.integers(1, 4))
    # Pipeline parallelism: each stage's ranks hold their own layers, so their own tensors.
    pp_size = draw(st.sampled_from([p for p in (1, 1, 2, 4) if world_size % p == 0]))
    return Geometry(
        tensors=tensors,
        groups=groups,
        num_blocks=96,
        blocks_per_chunk=draw(st.integers(1, 16)),
        world_size=world_size,
        slack=draw(st.sampled_from([0, 0, 64])),
        pp_size=pp_size,
        later_stages=tuple(_draw_stage(draw, num_groups) for _ in range(pp_size - 1)),
    )


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(geometry=geometries(), seed=st.integers(0, 2**31 - 1))
def test_random_jobs_match_vllms_worker_byte_for_byte(geometry: Geometry, seed: int) -> None:
    require_oracle()
    run_sequence(geometry, seed)


# Hand-picked corners, always run: one rank of a plain model, 16 blocks per chunk with shared
# tensors across three groups, four ranks, padded pages with strided blocks.
CORNERS = [
    Geometry(((256, 256),) * 4, (((0, 256), (1, 256), (2, 256), (3, 256)),), 96, 1),
    Geometry(
        ((128, 128), (64, 64), (32, 48)),
        (((0, 128), (1, 64)), ((0, 128), (2, 24)), ((2, 32), (2, 16))),
        96,
        16,
    ),
    Geometry(((64, 64), (64, 64)), (((0, 64),), ((1, 64),)), 96, 4, world_size=4),
    Geometry(((96, 160),), (((0, 80), (0, 88)),), 96, 3, world_size=2, slack=64),
    # Two tensor-parallel ranks per stage, two stages; the second stage's ranks hold fewer
    # bytes per block than their slot (one tensor shared by both groups).
    Geometry(
        ((64, 64), (64, 64)),
        (((0, 64),), ((1, 64),)),
        96,
        5,
        world_size=4,
        pp_size=2,
        later_stages=((((96, 104),), (((0, 96),), ((0, 48),))),),
    ),
]


@pytest.mark.parametrize("backend", ["cpu", "fake-cuda"])
@pytest.mark.parametrize(
    "geometry", CORNERS, ids=["plain", "groups-bpc16", "tp4", "padded", "tp2-pp2"]
)
def test_corner_geometries_match_vllms_worker(geometry: Geometry, backend: str) -> None:
    require_oracle()
    assert run_sequence(geometry, seed=7 + (backend == "fake-cuda"), rounds=4, backend=backend) > 0


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(geometry=geometries(), seed=st.integers(0, 2**31 - 1))
def test_random_jobs_through_the_cuda_backend_match_vllms_worker(
    geometry: Geometry, seed: int
) -> None:
    """The same random sequences through our CUDA backend's DMA path (over the fake runtime:
    batched copies for odd seeds, one copy per run for even ones)."""
    require_oracle()
    run_sequence(geometry, seed, backend="fake-cuda")


def test_our_spec_builds_our_worker_and_vllm_spec_builds_vllms() -> None:
    require_oracle()
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker as VllmWorker

    import kvcache.vllm

    with vllm_on_cpu():
        (pair,) = build_pairs(CORNERS[0], cpu_bytes_to_use=1 << 20, seed=1)
    try:
        assert isinstance(pair.our_worker, kvcache.vllm.CPUOffloadingWorker)
        assert isinstance(pair.vllm_worker, VllmWorker)
        assert pair.our_spec.get_worker(None) is pair.our_worker  # built once
        # Same chunk count, and never more host memory than vLLM's slot for this rank.
        assert pair.our_worker.pool.num_chunks == pair.vllm_spec.num_chunks
        assert pair.our_worker.chunk_bytes <= pair.vllm_spec.cpu_page_size_per_worker
    finally:
        pair.shutdown()
