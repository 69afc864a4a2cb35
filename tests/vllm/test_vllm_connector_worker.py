"""vLLM's own connector (0.33.0 or 0.34.0, whichever is installed) builds and drives
kvcache's worker, against vLLM's worker.

For each KV cache configuration, two engines' worker-role ``OffloadingConnector`` objects (one
per rank) run side by side over byte-identical CPU "GPU" caches: one engine configured for
vLLM's spec, the other with ``spec_name="KvCacheOffloadingSpec"``,
``spec_module_path="kvcache.vllm"`` in ``kv_connector_extra_config``: kvcache is selected by
configuration alone, and must build kvcache's worker (no fallback, no warning). The same
steps, in the model runner's call order (deferred stores, flushes for preemptions and
reallocated blocks, asynchronous and synchronous loads, then a shutdown with a load just
submitted), go through both, and after every step the two must agree on every byte of the
KV caches and of the host chunks, on the jobs reported complete, on the requests finished
receiving and on the transfer sizes recorded in the connector's stats; every load must have
put the stored pages into its fresh blocks. Under 0.34.0 the connector hands each worker the
device pointers it resolves from a job's ``GPULoadStoreSpec`` on that worker's canonical
caches. A second test makes every copy of both workers fail: 0.34.0's connector must record
the same failed jobs and the same failed loads (``failed_recving``) for both, and raise for a
failed synchronous load; 0.33.0's connector cannot handle a failed result and stops at it.

Real (vLLM's code as installed):

- ``VllmConfig`` with its real ``ParallelConfig``, ``CacheConfig``, ``SchedulerConfig`` and
  ``KVTransferConfig`` (device ``cpu``);
- the layers' KV cache specs (``FullAttentionSpec``, ``SlidingWindowSpec``, ``MambaSpec``),
  the KV cache groups (``get_kv_cache_groups``: hybrid grouping, page-size unification by
  block size or by padding, ``UniformTypeKVCacheSpecs``), their placement
  (``get_kv_cache_config_from_groups``: groups aliasing the same bytes, padded pages,
  block-outermost packing) and the per-layer views (``create_kv_cache_views``, kernel-block
  splitting included);
- ``OffloadingConnector.__init__`` (``build_offloading_config``, ``OffloadingSpecFactory``),
  ``OffloadingConnectorWorker`` (``register_kv_caches`` with ``derive_canonical_mappings``,
  ``handle_preemptions``, ``start_kv_transfers``, ``prepare_store_kv``, ``get_finished``,
  ``build_connector_worker_meta``) and vLLM's metadata classes;
- both specs and both workers (vLLM's under the CPU fakes of
  ``tests/support/vllm_worker_oracle.py``: fake streams/events/platform, its batch copy as a
  byte copy).

Faked or replaced:

- ``model_config``: a namespace with what the connector path reads (``model``, ``dtype``,
  ``max_model_len``, ``use_mla``, ``get_total_num_kv_heads()``); a real ``ModelConfig`` needs
  a model's Hugging Face config;
- set on the real configs after construction: ``cache_config.kv_cache_layout`` (the engine
  core resolves it), ``cache_config.num_gpu_blocks_override`` (no memory profiling) and
  ``scheduler_config.disable_hybrid_kv_cache_manager=False`` (``VllmConfig`` turns the hybrid
  manager off on a platform without one; the connector supports it);
- ``allocate_kv_cache`` of ``vllm.v1.worker.utils`` (that module does not import without
  ``einops``): :func:`allocate` repeats its loop (one zeroed backing buffer, vLLM's
  ``create_kv_cache_views`` for every ``KVCacheTensor``);
- the scheduler: the jobs are built as the installed release's
  ``OffloadingConnectorScheduler`` builds them (``GPULoadStoreSpec`` per group, first block
  index as the offset, ``CPULoadStoreSpec`` chunk ids in group order; a store skips leading
  null blocks under 0.33.0 and starts at their chunk under 0.34.0, which keeps the null blocks
  inside a chunk as placeholders), over block tables and chunk ids drawn here;
- the forward pass: the test waits (``OffloadingWorker.wait``) for the jobs the connector
  does not wait for itself (the deferred stores it just submitted, asynchronous loads)
  before ``get_finished``, so every step reports deterministically.

Tensor parallelism runs every rank's connector in this one process (vLLM's cross-rank
barrier is a no-op under the fakes). Not built here: Mamba "align" mode (whose loads can name
the null block twice: see tests/worker/test_worker_conformance.py), MLA/replicated layouts,
pipeline/context parallelism, HiSparse, canonical-layout offloading (vLLM's CPU spec does
not use it), head-outer layouts (``LHBNC``, ROCm only: vLLM's connector then offloads a
head slice per block, for both workers alike).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from tests.support.connector_cases import (
    CASES,
    NUM_BLOCKS,
    OURS,
    TOKENS_PER_BLOCK,
    Case,
    kv_cache_config,
    vllm_config,
)
from tests.support.oracle import require_oracle
from tests.support.vllm_worker_oracle import pointers_release, vllm_on_cpu

pytestmark = pytest.mark.oracle


def allocate(kcc: Any, layout: str, kernel_block_size: int | None) -> dict[str, Any]:
    """vLLM's ``allocate_kv_cache`` on CPU: one zeroed backing buffer, vLLM's per-layer
    views of every ``KVCacheTensor``."""
    import torch
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    (size,) = {t.size for t in kcc.kv_cache_tensors}
    buf = torch.zeros(size, dtype=torch.int8)
    caches = {}
    for tensor in kcc.kv_cache_tensors:
        group = next(g for g in kcc.kv_cache_groups if tensor.layers[0] in g.layer_names)
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[tensor.layers[0]]
        views = create_kv_cache_views(
            buf,
            spec,
            kcc.num_blocks,
            KVCacheLayout[layout],
            tensor,
            kernel_block_size=kernel_block_size,
        )
        caches.update(zip(tensor.layers, views, strict=True))
    return caches


def layer_pages(kcc: Any) -> dict[str, tuple[int, int, int]]:
    """Per layer: (byte offset of block 0, block stride, unpadded page bytes), from the
    ``KVCacheTensor`` placement contract (``offset + l * layer_stride + b * block_stride``)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    specs = {}
    for group in kcc.kv_cache_groups:
        for name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            specs[name] = spec
    out = {}
    for tensor in kcc.kv_cache_tensors:
        for i, name in enumerate(tensor.layers):
            start = tensor.offset + i * tensor.layer_stride
            out[name] = (start, tensor.block_stride, specs[name].real_page_size_bytes)
    return out


# --- one run: a connector, its caches and what it reported --------------------------------


class LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def kvcache_log() -> Iterator[LogRecords]:
    """Every record of the ``kvcache`` loggers, wherever vLLM routes them."""
    logger = logging.getLogger("kvcache")
    handler = LogRecords()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@dataclass(eq=False)
class Run:
    connector: Any
    kcc: Any
    caches: dict[str, Any]
    canonical: Any = None
    steps: list[dict[str, Any]] = field(default_factory=list)

    @property
    def buffer(self) -> Any:
        import torch

        first = next(iter(self.caches.values()))
        return torch.empty(0, dtype=torch.int8).set_(first.untyped_storage())

    @property
    def worker(self) -> Any:
        return self.connector.connector_worker.worker


def build_run(case: Case, extra: dict[str, Any], seed: int, rank: int, engine_id: str) -> Run:
    """Rank ``rank``'s worker-role connector over freshly allocated caches filled with
    random bytes (the padding too) drawn from ``seed`` and the rank, its KV caches
    registered."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    config = vllm_config(case, extra, rank, engine_id)
    kcc = kv_cache_config(config, case)
    caches = allocate(kcc, case.layout, case.kernel_block_size)
    connector = OffloadingConnector(config, KVConnectorRole.WORKER, kcc)
    run = Run(connector, kcc, caches)
    rng = np.random.default_rng([seed, rank])
    run.buffer.copy_(torch.from_numpy(rng.integers(-128, 128, run.buffer.numel(), np.int8)))
    worker = connector.connector_worker
    init_worker = worker._init_worker

    def capture(kv_caches: Any) -> None:
        run.canonical = kv_caches
        init_worker(kv_caches)

    worker._init_worker = capture
    connector.register_kv_caches(caches)
    return run


def describe_canonical(run: Run) -> tuple[Any, ...]:
    """The canonical caches vLLM's connector derived, relative to the run's buffer: per
    tensor (byte offset, shape, strides, page bytes), per group its references."""
    base = run.buffer.data_ptr()
    tensors = tuple(
        (t.tensor.data_ptr() - base, tuple(t.tensor.shape), t.tensor.stride(), t.page_size_bytes)
        for t in run.canonical.tensors
    )
    refs = tuple(
        tuple((r.tensor_idx, r.page_size_bytes) for r in group)
        for group in run.canonical.group_data_refs
    )
    return tensors, refs


# --- the scheduler's side: block tables, chunks and metadata ------------------------------


@dataclass
class Request:
    """Per group, the block table (0: the null block) of a request's first blocks."""

    req_id: str
    tables: list[list[int]]


def draw_request(req_id: str, case: Case, free: list[int], num_blocks: int, nulls: int) -> Request:
    """A request of ``num_blocks`` blocks per group, drawn from ``free``; a group with a null
    prefix starts with ``nulls`` null blocks."""
    tables = []
    for null_prefix in case.null_prefix:
        k = nulls if null_prefix else 0
        tables.append([0] * k + [free.pop() for _ in range(num_blocks - k)])
    return Request(req_id, tables)


def gpu_cpu_specs(
    case: Case,
    request: Request,
    starts: list[int | None],
    chunk_ids: list[dict[int, int]],
    empty_index: Callable[[list[int]], int],
    *,
    placeholders: bool = False,
) -> tuple[Any, Any]:
    """The two specs of a job over blocks ``starts[g]:`` of each group (all non-null unless
    ``placeholders``; None: none of the group, whose block index is then
    ``empty_index(table)``), as the scheduler builds them: block ids, per-group sizes and
    first block indices, and the chunk ids of the chunks those blocks fall in, group after
    group."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    bpc = case.blocks_per_chunk
    block_ids: list[int] = []
    sizes: list[int] = []
    indices: list[int] = []
    chunks: list[int] = []
    for table, start, ids in zip(request.tables, starts, chunk_ids, strict=True):
        if start is None:
            sizes.append(0)
            indices.append(empty_index(table))
            continue
        blocks = table[start:]
        assert placeholders or 0 not in blocks
        block_ids += blocks
        sizes.append(len(blocks))
        indices.append(start)
        chunks += [ids[c] for c in range(start // bpc, (len(table) - 1) // bpc + 1)]
    return GPULoadStoreSpec(block_ids, sizes, indices), CPULoadStoreSpec(chunks)


def store_job(
    case: Case, request: Request, chunk_ids: list[dict[int, int]], groups: set[int]
) -> Any:
    """The request's blocks of ``groups`` from the first non-null one on (0.33.0's scheduler
    skips the null blocks before it), or from the start of that block's chunk (0.34.0's keeps
    the null blocks inside a chunk as placeholders, so every block keeps its slot), GPU -> its
    chunks (another group's block index: 0, as the scheduler leaves it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob

    bpc = case.blocks_per_chunk
    aligned = pointers_release()
    starts: list[int | None] = []
    for g, table in enumerate(request.tables):
        first = next(i for i, b in enumerate(table) if b != 0) if g in groups else None
        starts.append(first // bpc * bpc if aligned and first is not None else first)
    src, dst = gpu_cpu_specs(
        case, request, starts, chunk_ids, lambda table: 0, placeholders=aligned
    )
    return TransferJob(req_id=request.req_id, src_spec=src, dst_spec=dst)


def load_starts(request: Request, computed: int, groups: set[int]) -> list[int | None]:
    """Per group of ``groups``: the first non-null block past ``computed`` locally computed
    ones, where the scheduler's load starts."""
    return [
        next(i for i, b in enumerate(t) if b != 0 and i >= computed) if g in groups else None
        for g, t in enumerate(request.tables)
    ]


def load_job(
    case: Case,
    request: Request,
    chunk_ids: list[dict[int, int]],
    computed: int,
    groups: set[int],
    sync: bool = False,
) -> Any:
    """Chunks -> the request's blocks of ``groups`` past ``computed`` locally computed ones,
    as the scheduler's load (another group's block index: past its last block)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob

    starts = load_starts(request, computed, groups)
    dst, src = gpu_cpu_specs(case, request, starts, chunk_ids, len)
    return TransferJob(req_id=request.req_id, src_spec=src, dst_spec=dst, sync=sync)


def metadata(
    load_jobs: dict[int, Any] | None = None,
    store_jobs: dict[int, Any] | None = None,
    jobs_to_flush: set[int] | None = None,
) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
    )

    return OffloadingConnectorMetadata(
        load_jobs=dict(load_jobs or {}),
        store_jobs=dict(store_jobs or {}),
        jobs_to_flush=set(jobs_to_flush) if jobs_to_flush is not None else set(),
    )


def step(run: Run, meta: Any, forward_waits_for: set[int]) -> None:
    """One engine step in the model runner's order. The forward pass is a wait for
    ``forward_waits_for`` (the jobs the connector itself does not wait for), so each step
    reports deterministically; a flushed store and a synchronous load must be complete
    through the connector's own waits."""
    connector = run.connector
    connector.handle_preemptions(meta)
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)
    run.worker.wait(set(forward_waits_for))
    connector.wait_for_save()
    if pointers_release():
        # 0.34.0's model runner asks for the failed loads in the same call.
        results = connector.get_transfer_results(set())
        finished_sending, finished_recving = results.finished_sending, results.finished_recving
        failed_recving = results.failed_recving
    else:
        finished_sending, finished_recving = connector.get_finished(set())
        failed_recving = set()
    worker_meta = connector.build_connector_worker_meta()
    connector.clear_connector_metadata()
    stats = worker_meta.transfer_stats if worker_meta is not None else None
    run.steps.append(
        {
            "finished_sending": set(finished_sending),
            "finished_recving": set(finished_recving),
            "failed_recving": set(failed_recving),
            # 0.34.0 only: the jobs a worker reported failed, for the scheduler.
            "failed_jobs": set(getattr(worker_meta, "failed_jobs", None) or ()),
            "completed": set(worker_meta.completed_jobs) if worker_meta is not None else set(),
            # Sorted: the two workers may report a step's stores and loads in another order.
            "store_sizes": sorted(stats.store.sizes) if stats else [],
            "load_sizes": sorted(stats.load.sizes) if stats else [],
            "store_bytes": stats.store.bytes if stats else 0,
            "load_bytes": stats.load.bytes if stats else 0,
            "times": (stats.store.time, stats.load.time) if stats else (0.0, 0.0),
        }
    )


def host_bytes(theirs: Run, ours: Run, rank: int) -> tuple[bytes, bytes]:
    """Every chunk of a rank's host memory: its slot of vLLM's shared region, our pool."""
    region = theirs.worker._mmap_region
    rows = region.base_tensor.view(region.num_chunks, region._row_stride)
    used = ours.worker.chunk_bytes
    assert used == theirs.connector.connector_worker.spec.cpu_page_size_per_worker
    start = rank * region.cpu_page_size
    return (
        rows[:, start : start + used].contiguous().numpy().tobytes(),
        ours.worker.pool.tensor().view(-1).numpy().tobytes(),
    )


@dataclass(frozen=True)
class Step:
    """One step's metadata (built afresh for each run, as each engine's scheduler would),
    what the test's forward pass waits for, and what the step must report."""

    meta: Callable[[], Any]
    forward_waits_for: set[int]
    completed: set[int]
    finished_recving: set[str]
    #: Loads this step completes: (source request, destination request, locally computed
    #: blocks, groups loaded).
    loads: tuple[tuple[str, str, int, set[int]], ...] = ()


# --- the test -----------------------------------------------------------------------------


def run_case(name: str, seed: int) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker as VllmWorker
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as VllmSpec

    import kvcache.vllm

    case = CASES[name]
    rng = np.random.default_rng([seed, 1])  # block tables and chunks
    bpc = case.blocks_per_chunk
    # Rank r of vLLM's engine, then of ours: theirs[r], ours[r]. Ranks of one engine share
    # its engine id (vLLM's ranks share one host region, each its own slot).
    theirs: list[Run] = []
    ours: list[Run] = []
    shut_down: list[Run] = []
    with vllm_on_cpu(), kvcache_log() as log:
        try:
            for runs, extra in ((theirs, {}), (ours, OURS)):
                engine_id = f"kvcache-test-{uuid.uuid4().hex}"
                for rank in range(case.tp):
                    runs.append(build_run(case, extra, seed, rank, engine_id))
            pairs = list(zip(theirs, ours, strict=True))
            init = [t.buffer.numpy().copy() for t in theirs]
            for (_, o), data in zip(pairs, init, strict=True):
                assert o.buffer.numpy().tobytes() == data.tobytes()

            # (1) Selected by configuration alone, kvcache's spec built kvcache's worker on
            # every rank: no fallback to vLLM's, no warning, and the start-up lines say so.
            for t, o in pairs:
                for run in (t, o):
                    assert type(run.connector.connector_worker) is OffloadingConnectorWorker
                assert type(t.connector.connector_worker.spec) is VllmSpec
                assert type(t.worker) is VllmWorker
                assert type(o.connector.connector_worker.spec) is kvcache.vllm.CPUOffloadingSpec
                assert type(o.worker) is kvcache.vllm.CPUOffloadingWorker
            messages = [r.getMessage() for r in log.records]
            assert not [r for r in log.records if r.levelno >= logging.WARNING], messages
            ready = [m for m in messages if "worker ready" in m]
            assert len(ready) == case.tp
            assert all("worker=kvcache (cpu)" in m for m in ready), ready

            # vLLM's connector derived the canonical caches this case is about, the same for
            # both engines and every rank (relative to the rank's buffer).
            tensors, refs = describe_canonical(theirs[0])
            for run in theirs + ours:
                assert describe_canonical(run) == (tensors, refs)
            assert tuple(page for *_, page in tensors) == case.tensor_pages
            assert refs == case.group_refs
            groups = theirs[0].kcc.kv_cache_groups
            assert tuple(g.kv_cache_spec.block_size for g in groups) == case.block_sizes
            if case.kernel_block_size is not None:
                ratio = TOKENS_PER_BLOCK // case.kernel_block_size
                assert all(v.shape[0] == ratio * NUM_BLOCKS for v in theirs[0].caches.values())
            num_chunks = ours[0].connector.connector_worker.spec.num_chunks
            for t, o in pairs:
                assert t.connector.connector_worker.spec.num_chunks == num_chunks >= 24
                assert o.connector.connector_worker.spec.num_chunks == num_chunks

            # Requests of n blocks (the last chunk partial); a sliding-window group's first
            # blocks are null, so its first stored block is not chunk-aligned when bpc > 1.
            n = 2 * bpc + 1
            nulls = bpc + 1 if bpc > 1 else 1
            free = [int(b) for b in rng.permutation(np.arange(1, NUM_BLOCKS))]
            pool = [int(c) for c in rng.permutation(num_chunks)]
            reqs = {r: draw_request(r, case, free, n, nulls) for r in ("a", "b", "c")}
            for r in ("a2", "a3", "b2", "c2", "b3"):
                reqs[r] = draw_request(r, case, free, n, nulls)
            chunks = {
                r: [{c: pool.pop() for c in range((n - 1) // bpc + 1)} for _ in case.null_prefix]
                for r in ("a", "b", "c")
            }

            every = set(range(len(case.null_prefix)))
            # Request c has nothing to offload in its other groups (where there are some).
            first = {0}

            def store(r: str, groups: set[int] = every) -> Any:
                return store_job(case, reqs[r], chunks[r], groups)

            def load(
                src: str, dst: str, computed: int, groups: set[int] = every, sync: bool = False
            ) -> Any:
                return load_job(case, reqs[dst], chunks[src], computed, groups, sync)

            plan = [
                # a's store, deferred by the connector to the next step.
                Step(lambda: metadata(store_jobs={1: store("a")}), set(), set(), set()),
                # (4) A preemption flushes it: handle_preemptions submits it and waits
                # (the test's forward pass waits for nothing here); b's store is deferred.
                Step(
                    lambda: metadata(store_jobs={2: store("b")}, jobs_to_flush={1}),
                    set(),
                    {1},
                    set(),
                ),
                # b's store starts together with two asynchronous loads of a's chunks into
                # fresh blocks, past one and two locally computed blocks.
                Step(
                    lambda: metadata(load_jobs={3: load("a", "a2", 1), 4: load("a", "a3", 2)}),
                    {2, 3, 4},
                    {2, 3, 4},
                    {"a2", "a3"},
                    loads=(("a", "a2", 1, every), ("a", "a3", 2, every)),
                ),
                # (4) A finished request's store flushed in its own step (its blocks are
                # reallocated), and a synchronous (expedited, waited) load of b's chunks:
                # both complete through the connector's own waits.
                Step(
                    lambda: metadata(
                        load_jobs={6: load("b", "b2", 0, sync=True)},
                        store_jobs={5: store("c", first)},
                        jobs_to_flush={5},
                    ),
                    set(),
                    {5, 6},
                    set(),
                    loads=(("b", "b2", 0, every),),
                ),
                Step(
                    lambda: metadata(load_jobs={7: load("c", "c2", 0, first)}),
                    {7},
                    {7},
                    {"c2"},
                    loads=(("c", "c2", 0, first),),
                ),
            ]

            places = layer_pages(theirs[0].kcc)

            def page(data: np.ndarray, layer: str, block: int) -> bytes:
                start, stride, size = places[layer]
                return data[start + block * stride :][:size].tobytes()

            restored: list[tuple[str, str, int, set[int]]] = []

            def check_restored(rank: int, data: np.ndarray) -> None:
                """Every load so far put the stored pages into its fresh blocks."""
                for src, dst, computed, loaded in restored:
                    starts = load_starts(reqs[dst], computed, loaded)
                    for g, group in enumerate(groups):
                        for i in range(n if starts[g] is None else starts[g], n):
                            for layer in group.layer_names:
                                got = page(data, layer, reqs[dst].tables[g][i])
                                want = page(init[rank], layer, reqs[src].tables[g][i])
                                assert got == want

            for s in plan:
                restored += s.loads
                for rank, (t, o) in enumerate(pairs):
                    # Every rank gets the step's metadata (the scheduler broadcasts it).
                    step(t, s.meta(), s.forward_waits_for)
                    step(o, s.meta(), s.forward_waits_for)
                    a, b = t.steps[-1], o.steps[-1]
                    # (3) The same jobs complete, the same requests finish receiving, the
                    # same transfer sizes are recorded (one per job: both report a time).
                    assert a["completed"] == b["completed"] == s.completed
                    assert a["finished_recving"] == b["finished_recving"] == s.finished_recving
                    assert a["finished_sending"] == b["finished_sending"] == set()
                    assert a["failed_recving"] == b["failed_recving"] == set()
                    assert a["failed_jobs"] == b["failed_jobs"] == set()
                    for key in ("store_sizes", "load_sizes", "store_bytes", "load_bytes"):
                        assert a[key] == b[key], key
                    assert len(a["store_sizes"]) + len(a["load_sizes"]) == len(s.completed)
                    for report in (a, b):
                        assert all(isinstance(x, float) and x >= 0.0 for x in report["times"])
                        sizes = report["store_sizes"] + report["load_sizes"]
                        assert all(size > 0 for size in sizes)
                    # (2) Every byte of the two ranks' KV caches and host chunks is the
                    # same...
                    data = o.buffer.numpy()
                    assert data.tobytes() == t.buffer.numpy().tobytes()
                    vllm_host, our_host = host_bytes(t, o, rank)
                    assert our_host == vllm_host
                    # ... and every load so far put the stored pages into its fresh blocks.
                    check_restored(rank, data)

            # Shutdown with a load just submitted and a store still deferred: the load lands
            # the same on both (vLLM's worker drains its streams, ours waits for its jobs;
            # with pages this small the load may land first anyway), the connector drops the
            # deferred store.
            restored.append(("b", "b3", 1, every))
            for rank, (t, o) in enumerate(pairs):
                for run in (t, o):
                    meta = metadata(load_jobs={8: load("b", "b3", 1)}, store_jobs={9: store("a")})
                    run.connector.handle_preemptions(meta)
                    run.connector.bind_connector_metadata(meta)
                    run.connector.start_load_kv(None)
                    run.connector.wait_for_save()
                    run.connector.clear_connector_metadata()
                    shut_down.append(run)
                    run.connector.shutdown()
                data = o.buffer.numpy()
                assert data.tobytes() == t.buffer.numpy().tobytes()
                check_restored(rank, data)
        finally:
            for run in theirs + ours:
                if run not in shut_down:
                    run.connector.shutdown()


@pytest.mark.parametrize("name", list(CASES))
def test_vllms_connector_drives_our_worker_like_its_own(name: str) -> None:
    require_oracle()
    run_case(name, seed=11 + sorted(CASES).index(name))


def test_the_registered_spec_name_selects_vllms_spec_whatever_the_module_path() -> None:
    """vLLM's factory resolves a registered ``spec_name`` before ``spec_module_path``:
    ``CPUOffloadingSpec`` with ``kvcache.vllm`` silently runs vLLM's spec, hence kvcache's
    distinct name ``KvCacheOffloadingSpec`` (used above)."""
    require_oracle()
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as VllmSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    import kvcache.vllm

    shadowed = {"spec_name": "CPUOffloadingSpec", "spec_module_path": "kvcache.vllm"}
    assert OffloadingSpecFactory.get_spec_cls(shadowed) is VllmSpec
    assert OffloadingSpecFactory.get_spec_cls(OURS) is kvcache.vllm.CPUOffloadingSpec


def failing_copy(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")


def failing(run: Run) -> None:
    """Every copy of our worker in ``run`` fails, as its copy thread would report a copy the
    device refused."""
    backend = run.worker.engine._backend
    collect = backend.collect
    backend.collect = lambda: [r._replace(success=False, error="injected") for r in collect()]


@pytest.mark.parametrize("name", ["full", "full+sliding"])
def test_failed_copies_reach_vllms_connector_as_failures(name: str) -> None:
    """Every copy of both workers fails (vLLM's batch copy raises as a CUDA error would, our
    copy thread reports failure). Under 0.34.0 vLLM's connector gets the same results from
    both: the failed store and the failed asynchronous load completed and marked failed for
    the scheduler, the load's request finished receiving and in ``failed_recving``, nothing
    recorded as moved; a failed synchronous load raises. Under 0.33.0 its connector cannot
    take a failed result: it stops at ours (and vLLM's worker raises from its submit)."""
    require_oracle()
    case = CASES[name]
    rng = np.random.default_rng([5, 1])
    bpc = case.blocks_per_chunk
    theirs: list[Run] = []
    ours: list[Run] = []
    with vllm_on_cpu(copy=failing_copy), kvcache_log():
        try:
            for runs, extra in ((theirs, {}), (ours, OURS)):
                runs.append(build_run(case, extra, 5, 0, f"kvcache-test-{uuid.uuid4().hex}"))
            failing(ours[0])
            n = 2 * bpc + 1
            free = [int(b) for b in rng.permutation(np.arange(1, NUM_BLOCKS))]
            pool = [int(c) for c in rng.permutation(24)]
            nulls = bpc + 1 if bpc > 1 else 1
            reqs = {r: draw_request(r, case, free, n, nulls) for r in ("a", "a2", "a3")}
            chunks = [{c: pool.pop() for c in range((n - 1) // bpc + 1)} for _ in case.null_prefix]
            every = set(range(len(case.null_prefix)))
            plan = [
                lambda: metadata(store_jobs={1: store_job(case, reqs["a"], chunks, every)}),
                # Submits the deferred store 1 with the asynchronous load 2.
                lambda: metadata(load_jobs={2: load_job(case, reqs["a2"], chunks, 1, every)}),
            ]
            sync = lambda: metadata(  # noqa: E731
                load_jobs={3: load_job(case, reqs["a3"], chunks, 0, every, sync=True)}
            )
            if not pointers_release():
                step(ours[0], plan[0](), set())
                with pytest.raises(AssertionError):
                    step(ours[0], plan[1](), {1, 2})
                step(theirs[0], plan[0](), set())
                with pytest.raises(RuntimeError, match="injected"):
                    step(theirs[0], plan[1](), {1, 2})
                return
            for run in (theirs[0], ours[0]):
                step(run, plan[0](), set())
                step(run, plan[1](), {1, 2})
                with pytest.raises(RuntimeError, match="sync load job 3 failed"):
                    step(run, sync(), set())
            a, b = theirs[0].steps, ours[0].steps
            assert a == b
            assert [s["completed"] for s in b] == [set(), {1, 2}]
            assert b[1]["failed_jobs"] == {1, 2}
            assert b[1]["finished_recving"] == b[1]["failed_recving"] == {"a2"}
            assert b[1]["store_sizes"] == b[1]["load_sizes"] == []
        finally:
            for run in theirs + ours:
                run.connector.shutdown()
