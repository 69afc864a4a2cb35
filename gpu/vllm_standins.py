"""Stand-ins for the few vLLM types kvcache's worker uses, for machines without vLLM.

A GPU machine that has torch and Triton but not vLLM (vLLM's compiled ops are built for
another torch) can still run kvcache's worker under either release's contract:
:func:`install` puts a minimal ``vllm`` package into ``sys.modules`` with the version asked
for and the types ``kvcache.vllm._worker`` imports, with vLLM's field names and meanings
(``vllm/v1/kv_offload/base.py`` and ``cpu/common.py`` of 0.33.0 and 0.34.0):

- ``CanonicalKVCacheTensor(tensor, page_size_bytes)``, ``CanonicalKVCacheRef(tensor_idx,
  page_size_bytes)``, ``CanonicalKVCaches(tensors, group_data_refs)``;
- ``GPULoadStoreSpec(block_ids, group_sizes, block_indices)`` (0.33's device side),
  ``DevicePointers(ptrs, sizes, group_block_counts, group_data_ref_counts, block_indices)``
  (0.34's) and :func:`resolve_device_pointers`, which makes the latter from the former as
  vLLM's connector does;
- ``CPULoadStoreSpec(block_ids)``, ``TransferResult``, ``LoadStoreSpec``,
  ``OffloadingWorker``.

Only for a process that has not imported vLLM: when a real vLLM is importable, use it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from abc import ABC
from dataclasses import dataclass
from typing import Any

import numpy as np


class LoadStoreSpec:
    """Where a job's blocks are, on one side."""


class CPULoadStoreSpec(LoadStoreSpec):
    def __init__(self, block_ids: Any) -> None:
        self.block_ids = np.asarray(block_ids, dtype=np.int64)


class GPULoadStoreSpec(LoadStoreSpec):
    def __init__(self, block_ids: Any, group_sizes: Any, block_indices: Any) -> None:
        self.block_ids = np.asarray(block_ids, dtype=np.int64)
        self.group_sizes = tuple(int(n) for n in group_sizes)
        self.block_indices = tuple(int(i) for i in block_indices)


@dataclass
class CanonicalKVCacheTensor:
    tensor: Any
    page_size_bytes: int


@dataclass
class CanonicalKVCacheRef:
    tensor_idx: int
    page_size_bytes: int
    mapping: Any = None


@dataclass
class CanonicalKVCaches:
    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]]


@dataclass
class DevicePointers:
    ptrs: np.ndarray
    sizes: np.ndarray
    group_block_counts: tuple[int, ...]
    group_data_ref_counts: tuple[int, ...]
    block_indices: tuple[int, ...]


@dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None


class OffloadingWorker(ABC):  # noqa: B024 (vLLM's abstract methods are the contract's)
    """Runs a transfer job's copies (vLLM's worker interface)."""


def resolve_device_pointers(spec: GPULoadStoreSpec, caches: CanonicalKVCaches) -> DevicePointers:
    """What vLLM 0.34's connector hands its worker for ``spec``: per group, per data
    reference, per block, ``tensor.data_ptr() + block * tensor.stride(0)`` and the reference's
    bytes."""
    ptrs: list[int] = []
    sizes: list[int] = []
    at = 0
    for n, refs in zip(spec.group_sizes, caches.group_data_refs, strict=True):
        blocks = [int(b) for b in spec.block_ids[at : at + n]]
        at += n
        for ref in refs:
            t = caches.tensors[ref.tensor_idx].tensor
            stride = t.stride(0) * t.element_size()
            ptrs += [t.data_ptr() + b * stride for b in blocks]
            sizes += [ref.page_size_bytes] * n
    return DevicePointers(
        ptrs=np.asarray(ptrs, dtype=np.uint64),
        sizes=np.asarray(sizes, dtype=np.uint64),
        group_block_counts=spec.group_sizes,
        group_data_ref_counts=tuple(len(refs) for refs in caches.group_data_refs),
        block_indices=spec.block_indices,
    )


def install(version: str) -> None:
    """Makes ``import vllm`` (and the modules kvcache's worker imports) give these stand-ins,
    as vLLM ``version`` ("0.33.0" or "0.34.0")."""
    if "vllm" in sys.modules:
        raise RuntimeError("vLLM is already imported: the stand-ins are for machines without it")

    def module(name: str, **attrs: Any) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        mod.__path__ = []  # a package, so that submodules resolve
        sys.modules[name] = mod
        return mod

    base = {
        "LoadStoreSpec": LoadStoreSpec,
        "GPULoadStoreSpec": GPULoadStoreSpec,
        "CanonicalKVCacheTensor": CanonicalKVCacheTensor,
        "CanonicalKVCacheRef": CanonicalKVCacheRef,
        "CanonicalKVCaches": CanonicalKVCaches,
        "TransferResult": TransferResult,
        "OffloadingWorker": OffloadingWorker,
    }
    if version.startswith("0.34"):
        base["DevicePointers"] = DevicePointers
    module("vllm", __version__=version)
    module("vllm.v1")
    module("vllm.v1.kv_offload")
    module("vllm.v1.kv_offload.base", **base)
    module("vllm.v1.kv_offload.cpu")
    module("vllm.v1.kv_offload.cpu.common", CPULoadStoreSpec=CPULoadStoreSpec)
    if version.startswith("0.34"):
        module("vllm.v1.kv_offload.pointer_utils", resolve_device_pointers=resolve_device_pointers)


def import_worker() -> types.ModuleType:
    """kvcache's worker module, ``kvcache.vllm._worker``, under the stand-ins (call
    :func:`install` first). The package ``kvcache.vllm`` is registered without running its
    ``__init__``, which imports vLLM's spec, manager and tiering modules (the adapter's other
    half, not stood in here); the worker and the modules it imports (fronts, version, logging)
    import only the types above."""
    spec = importlib.util.find_spec("kvcache.vllm")
    assert spec is not None
    sys.modules["kvcache.vllm"] = importlib.util.module_from_spec(spec)
    return importlib.import_module("kvcache.vllm._worker")
