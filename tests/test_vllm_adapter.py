"""kvcache.vllm as vLLM 0.33.0 loads it: policies through CachePolicyFactory, the spec through
OffloadingSpecFactory, and the manager as an instance of vLLM's OffloadingManager."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import make_key, require_oracle

pytestmark = pytest.mark.oracle


def offloading_config(**extra: Any) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": 64 * 4096, **extra},
        engine_id="test",
        model=OffloadingModelConfig(name="m", dtype="float16", max_model_len=1024),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


@pytest.mark.parametrize(("name", "kind"), [("LRUCachePolicy", "lru"), ("ARCCachePolicy", "arc")])
def test_cache_policy_factory_loads_our_policies(name: str, kind: str) -> None:
    require_oracle()
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    import kvcache

    cls = CachePolicyFactory.get_cache_policy_cls(name, "kvcache.vllm")
    assert cls is getattr(kvcache, name)
    policy = cls(cache_capacity=8)
    assert policy.cache_capacity == 8


@pytest.mark.parametrize("policy", ["lru", "arc", "LRUCachePolicy", "ARCCachePolicy"])
def test_spec_factory_builds_our_manager(policy: str) -> None:
    require_oracle()
    from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, ReqContext
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    import kvcache.vllm

    extra: dict[str, Any] = {
        "spec_name": "KvCacheOffloadingSpec",
        "spec_module_path": "kvcache.vllm",
        "eviction_policy": policy,
    }
    if policy.endswith("CachePolicy"):
        extra["cache_policy_module_path"] = "kvcache.vllm"
    spec = OffloadingSpecFactory.create_spec(offloading_config(**extra))
    assert isinstance(spec, kvcache.vllm.CPUOffloadingSpec)
    manager = spec.get_manager()
    assert isinstance(manager, kvcache.vllm.CPUOffloadingManager)
    assert isinstance(manager, OffloadingManager)
    assert manager is spec.get_manager()
    assert manager.num_chunks == spec.num_chunks == 64
    assert manager.config_info() == [spec.cpu_info.as_config_info()]
    ctx = ReqContext(req_id="r")
    out = manager.prepare_store([make_key(1)], ctx)
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    assert out.store_spec.block_ids.tolist() == [0]
    assert manager.lookup(make_key(1), ctx) is LookupResult.HIT_PENDING
    with manager.lock:
        manager.on_schedule_end(None)


def test_spec_falls_back_to_vllms_manager_for_python_policies() -> None:
    require_oracle()
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec = OffloadingSpecFactory.create_spec(
        offloading_config(
            spec_name="KvCacheOffloadingSpec",
            spec_module_path="kvcache.vllm",
            eviction_policy="LRUCachePolicy",
            cache_policy_module_path="vllm.v1.kv_offload.cpu.policies.lru",
        )
    )
    manager = spec.get_manager()
    assert type(manager) is VllmManager


def test_our_spec_matches_what_vllms_spec_init_builds() -> None:
    """Specs are built without running CPULoadStoreSpec.__init__: same attributes, same array."""
    require_oracle()
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvcache.vllm import CPUOffloadingManager

    manager = CPUOffloadingManager(num_chunks=4)
    out = manager.prepare_store([make_key(1), make_key(2)], ReqContext(req_id="r"))
    reference = CPULoadStoreSpec([0, 1])
    assert vars(out.store_spec).keys() == vars(reference).keys()
    assert out.store_spec.block_ids.dtype == reference.block_ids.dtype == np.int32
    assert out.store_spec.block_ids.tolist() == reference.block_ids.tolist()
    assert out.store_spec.block_ids.flags.writeable
