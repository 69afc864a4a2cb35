"""kvcache's spec as vLLM's factory builds it from an ``OffloadingConfig`` (the adapter tests'
configuration: one group, 4 KiB blocks, a 64-block host pool, ``extra`` on top)."""

from __future__ import annotations

from typing import Any

from tests.support import vllm_configs


def offloading_config(**extra: Any) -> Any:
    """One group of one 4096-byte layer, 64 chunks of one block, events on."""
    return vllm_configs.offloading_config(
        {"cpu_bytes_to_use": 64 * 4096, **extra},
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=True,
        max_model_len=1024,
    )


def our_spec(**extra: Any) -> Any:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    return OffloadingSpecFactory.create_spec(
        offloading_config(
            spec_name="KvCacheOffloadingSpec", spec_module_path="kvcache.vllm", **extra
        )
    )
