"""Specs and job sides for kvcache's vLLM worker on the plain two-tensor geometry, as the worker
tests build them (vLLM's CPU fakes come from ``vllm_worker_oracle``)."""

from __future__ import annotations

from typing import Any

from tests.support.vllm_worker_oracle import Geometry, device_side, offloading_config

PLAIN = Geometry(((256, 256), (256, 256)), (((0, 256), (1, 256)),), 64, 2)


def spec_for(geometry: Geometry, **extra: Any) -> Any:
    import kvcache.vllm

    config = offloading_config(geometry, rank=0, cpu_bytes_to_use=1 << 20, engine_id="t", **extra)
    return kvcache.vllm.CPUOffloadingSpec(config)


def default_spec_for(geometry: Geometry) -> Any:
    """A spec whose configuration does not name a worker (the default applies)."""
    import dataclasses

    import kvcache.vllm

    config = offloading_config(geometry, rank=0, cpu_bytes_to_use=1 << 20, engine_id="t")
    extra = {k: v for k, v in config.extra_config.items() if k != "kvcache_worker"}
    return kvcache.vllm.CPUOffloadingSpec(dataclasses.replace(config, extra_config=extra))


def gpu_spec(block_ids: list[int], sizes: list[int], starts: list[int]) -> Any:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return GPULoadStoreSpec(block_ids, sizes, starts)


def dev(caches: Any, block_ids: list[int], sizes: list[int], starts: list[int]) -> Any:
    """The device side of a job over these blocks as the installed release's connector passes
    it to a worker built on ``caches`` (0.34.0: device pointers, 0.33.0: the spec)."""
    return device_side(gpu_spec(block_ids, sizes, starts), caches)


def cpu_spec(chunk_ids: list[int]) -> Any:
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    return CPULoadStoreSpec(chunk_ids)
