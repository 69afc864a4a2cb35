"""The worker conformance sequences through the CUDA backend's copy kernel, on CPU.

Not collected on its own: tests/worker/test_worker_kernel_conformance.py runs this module in a child
pytest with ``TRITON_INTERPRET=1`` (Triton reads the variable when kernels are defined), where
the real Triton kernel runs on the CPU and its pointers are host addresses. Each rank's engine
gets a ``CudaBackend`` over the fake CUDA runtime of ``tests/support/fakecuda`` (its DMA on stream
threads, its events enforced), whose kernel launches run the interpreted kernel once the
kernel's stream has reached the launch (``InterpretedLauncher``); the block and tensor tables
stay in host memory. The pool is registered with the fake, so it is pinned and
device-addressable. vLLM's worker runs as in tests/worker/test_worker_conformance.py, and every host
and device byte and every job result is compared the same way.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.transfer import HostChunkPool, TransferEngine
from kvcache.transfer._cuda_backend import CudaBackend
from kvcache.transfer._jobs import CopyMode, Queue
from tests.support.fakecuda.shim import (
    InterpretedLauncher,
    TorchCuda,
    device_layers,
    dma_settled,
    fake,
    pin,
    runtime,
)
from tests.support.oracle import require_oracle
from tests.support.vllm_worker_oracle import Geometry, RankPair
from tests.support.worker_sequences import CORNERS, geometries, run_sequence

pytestmark = [
    pytest.mark.oracle,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="needs TRITON_INTERPRET=1 from the start (see test_worker_kernel_conformance.py)",
    ),
]


class CountingBackend(CudaBackend):
    """Counts the jobs each method ran, per (method, store), and checks each choice: the
    kernel only for a job it suits (``suits_kernel``), and always for such a job when no DMA
    job of its queue is in flight (so ``certain`` kernel jobs do not depend on timing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.methods: Counter[tuple[str, bool]] = Counter()
        self.suited: Counter[tuple[str, bool]] = Counter()
        self.certain = 0

    def submit(self, job_id: int, plan: Any, queue: Queue) -> None:
        suits = self.suits_kernel(plan)
        dma_idle = self._dma[queue].in_flight() == 0
        launched = len(self._kernel_jobs[queue])
        super().submit(job_id, plan, queue)
        kernel = len(self._kernel_jobs[queue]) > launched
        assert suits or not kernel, f"job {job_id} took the kernel it does not suit"
        assert kernel or not (suits and dma_idle), f"job {job_id} did not take the kernel"
        self.certain += suits and dma_idle
        self.suited["kernel" if suits else "dma", plan.store] += 1
        self.methods["kernel" if kernel else "dma", plan.store] += 1


def kernel_backend(
    engine: Any, *, copy: CopyMode, cutoff: int, min_runs: int, batched: bool
) -> CountingBackend:
    """Puts ``engine`` (over CPU tensors) on a CountingBackend over the fake, whose kernel
    runs under the interpreter, its pool registered with the fake; returns the backend."""
    pin(engine.pool)
    device_layers(engine._layers, 0)
    cuda = TorchCuda(1)
    engine._backend.close()
    engine._backend = CountingBackend(
        torch.device("cuda", 0),
        engine.pool,
        engine._layout,
        copy=copy,
        kernel_max_run_bytes=cutoff,
        kernel_min_runs=min_runs,
        kernel_programs=3,
        runtime=runtime(batch=batched),
        cuda=cuda,
        launcher=InterpretedLauncher(cuda, 0),
    )
    return engine._backend


def run_kernel_sequence(
    geometry: Geometry, seed: int, *, copy: CopyMode, cutoff: int = 0, min_runs: int = 1
) -> list[CountingBackend]:
    """One conformance sequence (two store/load rounds, then the mixed ones) with our
    worker's jobs on the kernel path; returns every rank's backend."""
    backends: list[CountingBackend] = []

    def route(pair: RankPair) -> None:
        backends.append(
            kernel_backend(
                pair.our_worker.engine,
                copy=copy,
                cutoff=cutoff,
                min_runs=min_runs,
                batched=bool(seed % 2),
            )
        )

    fake().reset(1)
    assert run_sequence(geometry, seed, rounds=2, backend=route) > 0
    methods: Counter[tuple[str, bool]] = Counter()
    for backend in backends:
        methods.update(backend.methods)
    if copy == "kernel":
        # Every group's addresses and sizes are multiples of 8: nothing may fall back to DMA.
        assert set(methods) <= {("kernel", True), ("kernel", False)}, methods
    else:
        assert methods["kernel", True] == 0, "stores use DMA under copy='auto'"
    return backends


CORNER_IDS = ["plain", "groups-bpc16", "tp4", "padded", "tp2-pp2"]
# copy='auto' per corner: (cut-off, kernel_min_runs) between the corner's loads, so that some
# take the kernel and some DMA (tp4: its one-tensor groups' random blocks rarely coalesce, so
# the loads of under 6 pages are its DMA ones).
AUTO_CUTOFFS = [(256, 8), (96, 2), (96, 6), (96, 2), (96, 2)]


@pytest.mark.parametrize("geometry", CORNERS, ids=CORNER_IDS)
def test_every_copy_through_the_kernel_matches_vllms_worker(geometry: Geometry) -> None:
    require_oracle()
    backends = run_kernel_sequence(geometry, seed=21, copy="kernel")
    assert all(b.methods["kernel", True] > 0 for b in backends)
    assert all(b.methods["kernel", False] > 0 for b in backends)


@pytest.mark.parametrize(
    ("geometry", "cutoff"), list(zip(CORNERS, AUTO_CUTOFFS, strict=True)), ids=CORNER_IDS
)
def test_small_loads_through_the_kernel_the_rest_by_dma_match_vllms_worker(
    geometry: Geometry, cutoff: tuple[int, int]
) -> None:
    """copy='auto': loads whose runs are small take the kernel, other loads and every store
    the fake DMA."""
    require_oracle()
    max_run, min_runs = cutoff
    backends = run_kernel_sequence(
        geometry, seed=22, copy="auto", cutoff=max_run, min_runs=min_runs
    )
    assert sum(b.certain for b in backends) > 0
    assert sum(b.suited["dma", False] for b in backends) > 0
    assert all(b.methods["dma", True] > 0 for b in backends)


@settings(
    max_examples=8,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    geometry=geometries(),
    seed=st.integers(0, 2**31 - 1),
    copy=st.sampled_from(["kernel", "auto"]),
    cutoff=st.sampled_from([32, 96, 192]),
    min_runs=st.integers(1, 8),
)
def test_random_jobs_through_the_kernel_match_vllms_worker(
    geometry: Geometry, seed: int, copy: CopyMode, cutoff: int, min_runs: int
) -> None:
    require_oracle()
    run_kernel_sequence(geometry, seed, copy=copy, cutoff=cutoff, min_runs=min_runs)


@pytest.mark.parametrize("order", ["held-dma-then-kernel", "dma-then-kernel", "kernel-then-dma"])
def test_a_queue_keeps_submission_order_across_methods(order: str) -> None:
    """Two loads on one queue write the same block, one too small for the kernel
    (kernel_min_runs), the other suited to it: the later one's bytes stay, as when a load
    naming a block twice is split into parts. A job suited to the kernel does not overtake a
    DMA job its queue's thread has not enqueued yet (it goes to DMA too), else its stream waits
    for the DMA stream; a DMA job after kernel jobs waits for the kernel stream."""
    fake().reset(1)
    rng = np.random.default_rng(5)
    layers = [torch.zeros(8, 64, dtype=torch.uint8)]
    with HostChunkPool(6, 64, pin=False) as pool:
        pool.tensor().copy_(torch.from_numpy(rng.integers(1, 256, (6, 64), dtype=np.uint8)))
        engine = TransferEngine(layers, pool)
        backend = kernel_backend(engine, copy="auto", cutoff=1 << 20, min_runs=2, batched=False)
        cuda = backend._cuda
        assert isinstance(cuda, TorchCuda)
        dma = backend._streams["load"].cuda_stream
        kernel = backend._kernel_streams["load"].cuda_stream
        # The load queue's thread is held inside the driver on its next copy.
        fake().hold_memcpy(dma, order == "held-dma-then-kernel")
        try:
            single = ([1], [3])  # chunk 1 -> block 3: one page, DMA
            pair = ([2, 5], [3, 4])  # chunks 2, 5 -> blocks 3, 4: two pages, the kernel if it may
            if order == "kernel-then-dma":
                engine.load(*pair)
                engine.load(*single)
                assert backend.methods == {("kernel", False): 1, ("dma", False): 1}
                assert (dma, kernel) in cuda.waits
            else:
                engine.load(*single)
                if order == "dma-then-kernel":
                    dma_settled(backend)
                engine.load(*pair)
                fake().hold_memcpy(dma, False)
                assert backend.suited == {("dma", False): 1, ("kernel", False): 1}
                if order == "dma-then-kernel":
                    assert backend.methods == backend.suited
                    assert (kernel, dma) in cuda.waits
                else:
                    assert backend.methods == {("dma", False): 2}
            engine.wait()
            assert [ok for _, ok in engine.poll()] == [True, True]
            later = 1 if order == "kernel-then-dma" else 2
            assert torch.equal(layers[0][3], pool.tensor()[later])
        finally:
            fake().hold_memcpy(dma, False)  # a failed check must not leave the thread held
            engine.close()
