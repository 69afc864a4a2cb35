"""vLLM's ``OffloadingConfig``, the object its connector hands an offloading spec, built the one
way the tests and benchmarks build it (the fields vLLM 0.33.0 and 0.34.0 both take).

Imports vLLM only when called, and nothing of pytest: ``bench/`` scripts import it on machines
that have vLLM and no test tools.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def offloading_config(
    extra_config: Mapping[str, Any],
    *,
    worker_kv_bytes_per_block: int,
    group_layers: Sequence[str] = ("l0",),
    blocks_per_chunk: int = 1,
    enable_kv_cache_events: bool = False,
    engine_id: str = "test",
    dtype: str = "float16",
    max_model_len: int = 4096,
    rank: int = 0,
    world_size: int = 1,
    pp_size: int = 1,
    is_parallelism_agnostic: bool = True,
) -> Any:
    """An ``OffloadingConfig`` with ``extra_config`` (``kv_connector_extra_config``): one KV
    group per name in ``group_layers`` (group ``g`` holds layer ``group_layers[g]``, 16 tokens a
    block and a hash), ``world_size`` ranks in ``pp_size`` pipeline stages of tensor-parallel
    ranks, this one ``rank``; no context or data parallelism."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=(layer,), group_id=g)
            for g, layer in enumerate(group_layers)
        ),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=enable_kv_cache_events,
        extra_config=dict(extra_config),
        engine_id=engine_id,
        model=OffloadingModelConfig(name="m", dtype=dtype, max_model_len=max_model_len),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size // pp_size,
            pp_size=pp_size,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=is_parallelism_agnostic,
        ),
    )
