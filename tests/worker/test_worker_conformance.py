"""kvcache's vLLM worker against the installed vLLM's own worker (0.33.0 or 0.34.0), on
identical CPU tensors.

vLLM's ``CPUOffloadingWorker`` runs as built by its ``CPUOffloadingSpec.get_worker`` (shared
/dev/shm region, per-rank slots, its descriptor logic), with only its CUDA edges faked and its
batch copy replaced by a byte copy (see ``tests/support/vllm_worker_oracle.py``). Ours runs through
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
fake CUDA runtime of tests/support/fakecuda (streams that run later, enforced events), and (fewer of
them, see tests/worker/test_worker_kernel_conformance.py) through its Triton copy kernel under
Triton's interpreter. Not covered here: real streams, DMA and the kernel on a GPU
(gpu/worker_check.py).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.oracle import require_oracle
from tests.support.vllm_worker_oracle import Geometry, build_pairs, vllm_on_cpu
from tests.support.worker_sequences import CORNERS, geometries, run_sequence

pytestmark = pytest.mark.oracle


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(geometry=geometries(), seed=st.integers(0, 2**31 - 1))
def test_random_jobs_match_vllms_worker_byte_for_byte(geometry: Geometry, seed: int) -> None:
    require_oracle()
    run_sequence(geometry, seed)


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
