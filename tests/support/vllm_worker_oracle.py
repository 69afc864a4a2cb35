"""vLLM's own CPU offloading worker (0.33.0 or 0.34.0, whichever is installed), run on CPU
tensors as the oracle.

vLLM's worker needs CUDA only at its edges. Inside :func:`vllm_on_cpu` (a context manager):

- ``current_platform`` (in vLLM's spec and worker modules) claims to be CUDA, with streams that
  do nothing and a ``stream()`` context that does nothing;
- ``torch.Event`` (as vLLM's worker module sees torch) is an event that is always complete;
- ``PIN_MEMORY`` is off (no ``cudaHostRegister``, no pinned descriptor buffers);
- the batch copy ``ops.swap_blocks_batch`` is a byte copy of every descriptor, or a no-op
  when timing submission only (``copy=False``), or a function the caller gives (to fail it);
- 0.33.0: the one ``assert gpu_tensor.is_cuda or gpu_tensor.is_xpu`` of its handler is removed
  from the handler's ``__init__`` (the source is recompiled without that statement); 0.34.0's
  handler holds no device tensors and has no such assertion (checked);
- 0.34.0: clearing the CUDA error a failed copy left pending is a no-op that counts its calls
  (there is no CUDA runtime to clear it in);
- the cross-rank barrier of its shared region is a no-op (one process plays every rank).

Everything else is vLLM's code as installed: the spec's chunk sizing, the shared /dev/shm
region and its per-rank slot views, descriptor building (``compute_sub_block_ptrs``, partial
chunks, groups), job ordering and result accounting. So the descriptors vLLM's worker would hand
to the GPU are exactly the ones copied here.

A job's device side is the installed release's: :func:`device_side` turns the one
``GPULoadStoreSpec`` a test draws into what that release's connector passes (0.34.0: vLLM's
``resolve_device_pointers`` over the worker's own canonical caches, as the connector does), so
both workers of a pair are driven through the same vLLM code.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import dataclasses
import functools
import inspect
import textwrap
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from tests.support import vllm_configs


class _FakeStream:
    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: object) -> float:
        return 0.0


class _FakePlatform:
    device_name = "cuda"
    device_type = "cuda"

    def is_cuda_alike(self) -> bool:
        return True

    def is_cuda(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def Stream(self) -> _FakeStream:
        return _FakeStream()

    def current_stream(self) -> _FakeStream:
        return _FakeStream()

    def stream(self, stream: object) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


class _TorchWithFakeEvent:
    """``torch`` as vLLM's worker module sees it: everything real except ``Event``."""

    Event = _FakeEvent

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def byte_copy(
    src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, is_src_access_order_any: bool = False
) -> None:
    """The batch copy as a plain memmove of each descriptor (addresses are host memory)."""
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)


def no_copy(
    src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, is_src_access_order_any: bool = False
) -> None:
    """The batch copy stubbed out (submission cost only)."""


def _handler_init_without_device_assert(handler_cls: type) -> Any:
    """``handler_cls.__init__`` recompiled without its ``is_cuda or is_xpu`` assertion."""
    source = textwrap.dedent(inspect.getsource(handler_cls.__init__))
    tree = ast.parse(source)
    removed = 0

    class Drop(ast.NodeTransformer):
        def visit_Assert(self, node: ast.Assert) -> ast.AST | None:
            nonlocal removed
            text = ast.unparse(node.test)
            if "is_cuda" in text and "is_xpu" in text:
                removed += 1
                return None
            return node

    tree = Drop().visit(tree)
    ast.fix_missing_locations(tree)
    if removed != 1:
        raise RuntimeError(
            f"expected one device assertion in {handler_cls.__name__}.__init__, found {removed}: "
            "vLLM's worker changed; update tests/support/vllm_worker_oracle.py"
        )
    module = inspect.getmodule(handler_cls)
    namespace: dict[str, Any] = {}
    code = compile(tree, inspect.getsourcefile(handler_cls) or "<vllm>", "exec")
    exec(code, vars(module), namespace)
    return namespace["__init__"]


@functools.cache
def pointers_release() -> bool:
    """Whether the installed vLLM hands its worker device pointers (0.34.0) rather than a
    ``GPULoadStoreSpec`` (0.33.0)."""
    from kvcache.vllm._version import VLLM_SEMANTICS

    return VLLM_SEMANTICS != "0.33"


def device_side(gpu: Any, kv_caches: Any) -> Any:
    """What the installed release's connector passes a worker for the device side of a job
    over ``gpu`` (a ``GPULoadStoreSpec``), on the worker's ``kv_caches``."""
    if not pointers_release():
        return gpu
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    return resolve_device_pointers(gpu, kv_caches)


#: Calls of vLLM 0.34.0's ``_clear_pending_device_error`` under :func:`vllm_on_cpu`.
CLEARED_DEVICE_ERRORS: list[None] = []


def _check_no_device_assert(handler_cls: type) -> None:
    """vLLM 0.34.0's handler takes no device tensors, so it has nothing to assert about them;
    if one comes back, the oracle must learn to remove it again."""
    params = inspect.signature(handler_cls.__init__).parameters
    source = inspect.getsource(handler_cls.__init__)
    if "gpu_tensors" in params or "is_cuda" in source:
        raise RuntimeError(
            f"{handler_cls.__name__}.__init__ takes device tensors again: vLLM's worker "
            "changed; update tests/support/vllm_worker_oracle.py"
        )


@contextlib.contextmanager
def vllm_on_cpu(*, copy: bool | Callable[..., None] = True) -> Iterator[None]:
    """Patches vLLM's worker-side modules so that its CPU offloading worker runs on CPU
    tensors (see the module docs); undone on exit. ``copy``: True for the byte copy, False
    for none, or the batch copy to use."""
    from vllm.v1.kv_offload.cpu import gpu_worker, spec

    handler = gpu_worker.SingleDirectionOffloadingHandler
    batch = copy if callable(copy) else byte_copy if copy else no_copy
    patches: list[tuple[Any, str, Any]] = [
        (spec, "current_platform", _FakePlatform()),
        (spec, "_all_workers_barrier", lambda: None),
        (gpu_worker, "current_platform", _FakePlatform()),
        (gpu_worker, "torch", _TorchWithFakeEvent()),
        (gpu_worker, "PIN_MEMORY", False),
        (gpu_worker, "ops", SimpleNamespace(swap_blocks_batch=batch)),
    ]
    if pointers_release():
        _check_no_device_assert(handler)
        patches.append(
            (gpu_worker, "_clear_pending_device_error", lambda: CLEARED_DEVICE_ERRORS.append(None))
        )
    else:
        patches.append((handler, "__init__", _handler_init_without_device_assert(handler)))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


# --- KV geometry --------------------------------------------------------------------------


Tensors = tuple[tuple[int, int], ...]
Groups = tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True)
class Geometry:
    """The ranks' KV caches as vLLM's connector canonicalises them: ``world_size`` ranks,
    ``pp_size`` pipeline stages of ``world_size // pp_size`` tensor-parallel ranks each. The
    first stage's ranks hold ``tensors``/``groups``; a later stage's ranks hold their own
    layers (``later_stages``), with the same KV groups and block count."""

    #: Per tensor: (padded page bytes, block stride bytes).
    tensors: Tensors
    #: Per group: (tensor index, unpadded page bytes) references.
    groups: Groups
    num_blocks: int
    blocks_per_chunk: int
    world_size: int = 1
    #: Extra bytes per block in vLLM's per-worker accounting (row slack).
    slack: int = 0
    pp_size: int = 1
    #: Stages 1.. of the pipeline: (tensors, groups) each.
    later_stages: tuple[tuple[Tensors, Groups], ...] = ()

    def __post_init__(self) -> None:
        assert self.world_size % self.pp_size == 0
        assert len(self.later_stages) == self.pp_size - 1
        assert all(len(groups) == len(self.groups) for _, groups in self.later_stages)

    @property
    def worker_kv_bytes_per_block(self) -> int:
        """The scheduler's figure, one for every rank: the largest stage's bytes per block
        (a smaller stage fills only part of its slot)."""
        stages = [self.tensors, *(tensors for tensors, _ in self.later_stages)]
        return max(sum(page for page, _ in tensors) for tensors in stages) + self.slack

    def of_rank(self, rank: int) -> Geometry:
        """The tensors and groups ``rank`` holds (its stage's)."""
        stage = rank // (self.world_size // self.pp_size)
        if stage == 0:
            return self
        tensors, groups = self.later_stages[stage - 1]
        return dataclasses.replace(self, tensors=tensors, groups=groups, later_stages=(), pp_size=1)


def make_tensors(geometry: Geometry, seed: int) -> list[torch.Tensor]:
    """One int8 ``(num_blocks, page)`` tensor per entry, rows ``stride`` bytes apart, filled
    with random bytes (the padding between pages too)."""
    rng = np.random.default_rng(seed)
    out = []
    for page, stride in geometry.tensors:
        raw = rng.integers(-128, 128, size=geometry.num_blocks * stride, dtype=np.int8)
        base = torch.from_numpy(raw)
        out.append(base.as_strided((geometry.num_blocks, page), (stride, 1)))
    return out


def canonical(geometry: Geometry, tensors: list[torch.Tensor]) -> Any:
    """vLLM's ``CanonicalKVCaches`` over ``tensors``."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    return CanonicalKVCaches(
        tensors=[
            CanonicalKVCacheTensor(tensor=t, page_size_bytes=page)
            for t, (page, _) in zip(tensors, geometry.tensors, strict=True)
        ],
        group_data_refs=[
            [CanonicalKVCacheRef(tensor_idx=t, page_size_bytes=n) for t, n in refs]
            for refs in geometry.groups
        ],
    )


def offloading_config(
    geometry: Geometry, *, rank: int, cpu_bytes_to_use: int, engine_id: str, **extra: Any
) -> Any:
    return vllm_configs.offloading_config(
        # kvcache's worker is opt-in (vLLM's is the default until a GPU run has passed); vLLM's
        # own spec ignores the key.
        {"cpu_bytes_to_use": cpu_bytes_to_use, "kvcache_worker": True, **extra},
        worker_kv_bytes_per_block=geometry.worker_kv_bytes_per_block,
        group_layers=[f"g{g}" for g in range(len(geometry.groups))],
        blocks_per_chunk=geometry.blocks_per_chunk,
        engine_id=engine_id,
        rank=rank,
        world_size=geometry.world_size,
        pp_size=geometry.pp_size,
        is_parallelism_agnostic=False,
    )


@dataclass
class RankPair:
    """One rank's two workers over identical tensors: vLLM's (the oracle) and ours."""

    rank: int
    vllm_tensors: list[torch.Tensor]
    our_tensors: list[torch.Tensor]
    vllm_spec: Any
    our_spec: Any
    vllm_worker: Any
    our_worker: Any
    #: The canonical caches each worker was built on (device pointers resolve against them).
    vllm_caches: Any = None
    our_caches: Any = None

    def workers(self) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
        """(worker, its canonical caches): vLLM's, then ours."""
        return (self.vllm_worker, self.vllm_caches), (self.our_worker, self.our_caches)

    def vllm_host_slot(self) -> torch.Tensor:
        """This rank's bytes of vLLM's shared region, as ``(num_chunks, bytes used)``."""
        region = self.vllm_worker._mmap_region
        rows = region.base_tensor.view(region.num_chunks, region._row_stride)
        start = self.rank * region.cpu_page_size
        used = self.our_worker.chunk_bytes
        return rows[:, start : start + used]

    def our_host(self) -> torch.Tensor:
        return self.our_worker.pool.tensor().view(torch.int8)

    def shutdown(self) -> None:
        self.vllm_worker.shutdown()
        self.our_worker.shutdown()


def build_pairs(
    geometry: Geometry, *, cpu_bytes_to_use: int, seed: int, **extra: Any
) -> list[RankPair]:
    """Every rank of ``geometry``: vLLM's spec and worker (under :func:`vllm_on_cpu`, which
    the caller holds) and kvcache's, each through its spec's ``get_worker``."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as VllmSpec

    import kvcache.vllm

    engine_id = f"kvcache-test-{uuid.uuid4().hex}"
    pairs = []
    for rank in range(geometry.world_size):
        config = offloading_config(
            geometry, rank=rank, cpu_bytes_to_use=cpu_bytes_to_use, engine_id=engine_id, **extra
        )
        local = geometry.of_rank(rank)
        base = make_tensors(local, seed * 100 + rank)
        vllm_tensors = _fresh_copies(base)
        our_tensors = _fresh_copies(base)
        vllm_spec = VllmSpec(config)
        our_spec = kvcache.vllm.CPUOffloadingSpec(config)
        vllm_caches = canonical(local, vllm_tensors)
        our_caches = canonical(local, our_tensors)
        pairs.append(
            RankPair(
                rank=rank,
                vllm_tensors=vllm_tensors,
                our_tensors=our_tensors,
                vllm_spec=vllm_spec,
                our_spec=our_spec,
                vllm_worker=vllm_spec.get_worker(vllm_caches),
                our_worker=our_spec.get_worker(our_caches),
                vllm_caches=vllm_caches,
                our_caches=our_caches,
            )
        )
    return pairs


def _fresh_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies with the same strides over storages of their own (padding bytes included)."""
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        flat = torch.empty(0, dtype=torch.int8).set_(storage).clone()
        out.append(flat.as_strided(t.shape, t.stride(), t.storage_offset()))
    return out


def device_bytes(tensors: list[torch.Tensor]) -> list[bytes]:
    """Every byte of every tensor's storage (pages and the padding between them)."""
    return [bytes(t.untyped_storage()) for t in tensors]


def submit(
    worker: Any,
    kv_caches: Any,
    job_id: int,
    *,
    store: bool,
    gpu: Any,
    cpu: Any,
    expedited: bool = False,
) -> bool:
    """Submits one job to ``worker`` as the installed release's connector does: the device
    side from ``gpu`` (a ``GPULoadStoreSpec``) through :func:`device_side` on the worker's
    ``kv_caches``, the host side ``cpu``."""
    device = device_side(gpu, kv_caches)
    if store:
        return bool(worker.submit_store(job_id, device, cpu))
    return bool(worker.submit_load(job_id, cpu, device, expedited=expedited))
