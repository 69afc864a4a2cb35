"""kvcache's spec as vLLM's factory builds it from an ``OffloadingConfig`` (the adapter tests'
configuration: one group, 4 KiB blocks, a 64-block host pool, ``extra`` on top)."""

from __future__ import annotations

from typing import Any


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


def our_spec(**extra: Any) -> Any:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    return OffloadingSpecFactory.create_spec(
        offloading_config(
            spec_name="KvCacheOffloadingSpec", spec_module_path="kvcache.vllm", **extra
        )
    )
