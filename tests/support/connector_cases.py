"""The KV cache configurations vLLM's connector is driven over in the connector tests (full
attention, sliding window, Mamba, kernel-block splitting, tensor parallelism: ``CASES``), and
the real ``VllmConfig`` and ``KVCacheConfig`` vLLM builds for each (``vllm_config``,
``kv_cache_config``). The worker and scheduler tests share them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

TOKENS_PER_BLOCK = 16
NUM_BLOCKS = 128
# kvcache's worker is opt-in until a GPU run has passed (vLLM's own worker is the default).
OURS = {
    "spec_name": "KvCacheOffloadingSpec",
    "spec_module_path": "kvcache.vllm",
    "kvcache_worker": True,
}


# --- configurations -----------------------------------------------------------------------


def full_attention(head_size: int = 8, **kw: Any) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=TOKENS_PER_BLOCK, num_kv_heads=2, head_size=head_size, dtype=torch.float16, **kw
    )


def _mamba() -> Any:
    """A Mamba layer caching a state per block (``"all"``): 608 bytes of conv and SSM
    state, padded by vLLM to the attention page."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=TOKENS_PER_BLOCK,
        shapes=((3, 16), (2, 8, 16)),
        dtypes=(torch.float16, torch.float16),
        mamba_cache_mode="all",
    )


def _sliding(head_size: int = 8) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=TOKENS_PER_BLOCK,
        num_kv_heads=2,
        head_size=head_size,
        dtype=torch.float16,
        sliding_window=2 * TOKENS_PER_BLOCK,
    )


@dataclass(frozen=True)
class Case:
    """A model's per-layer KV specs and how vLLM lays them out, with the canonical caches
    vLLM's connector must derive from them: per tensor its (padded) page bytes, per group
    its (tensor index, unpadded page bytes) references."""

    specs: Callable[[], dict[str, Any]]
    layout: str
    blocks_per_chunk: int
    tensor_pages: tuple[int, ...]
    group_refs: tuple[tuple[tuple[int, int], ...], ...]
    kernel_block_size: int | None = None
    #: Per group: whether its block tables start with null blocks (a sliding window).
    null_prefix: tuple[bool, ...] = (False,)
    #: Per group: the tokens per block vLLM settled on.
    block_sizes: tuple[int, ...] = (TOKENS_PER_BLOCK,)
    #: Tensor-parallel ranks (each holds two KV heads of ``2 * tp``).
    tp: int = 1


CASES = {
    # One full-attention group of three layers, layer-outer; the attention backend splits
    # each 16-token block into two kernel blocks (the connector regroups them).
    "full": Case(
        lambda: {f"full.{i}": full_attention() for i in range(3)},
        "LBHNC",
        2,
        tensor_pages=(1024, 1024, 1024),
        group_refs=(((0, 1024), (1, 1024), (2, 1024)),),
        kernel_block_size=8,
    ),
    # Full attention with two head sizes: one group of UniformTypeKVCacheSpecs, pages of
    # two sizes side by side.
    "uniform-type": Case(
        lambda: {
            "full.0": full_attention(8),
            "full.1": full_attention(4),
            "full.2": full_attention(8),
            "full.3": full_attention(4),
        },
        "LBHNC",
        3,
        tensor_pages=(1024, 512, 1024, 512),
        group_refs=(((0, 1024), (1, 512), (2, 1024), (3, 512)),),
    ),
    # Hybrid: a full-attention group and a sliding-window group overlay the same bytes, so
    # each of the two tensors is referenced by both groups.
    "full+sliding": Case(
        lambda: {
            "full.0": full_attention(),
            "sw.0": _sliding(),
            "full.1": full_attention(),
            "sw.1": _sliding(),
        },
        "LBHNC",
        4,
        tensor_pages=(1024, 1024),
        group_refs=(((0, 1024), (1, 1024)), ((0, 1024), (1, 1024))),
        null_prefix=(False, True),
        block_sizes=(TOKENS_PER_BLOCK, TOKENS_PER_BLOCK),
    ),
    # The same on two tensor-parallel ranks (each holds half the KV heads): vLLM's ranks share
    # one host region, a slot each; each of ours has a pool of its own.
    "full+sliding-tp2": Case(
        lambda: {
            "full.0": full_attention(),
            "sw.0": _sliding(),
            "full.1": full_attention(),
            "sw.1": _sliding(),
        },
        "LBHNC",
        2,
        tensor_pages=(1024, 1024),
        group_refs=(((0, 1024), (1, 1024)), ((0, 1024), (1, 1024))),
        null_prefix=(False, True),
        block_sizes=(TOKENS_PER_BLOCK, TOKENS_PER_BLOCK),
        tp=2,
    ),
    # Hybrid with half-size sliding-window pages: vLLM unifies the pages by doubling that
    # group's tokens per block (the groups' blocks then cover different token spans).
    "full+sliding-larger-block": Case(
        lambda: {
            "full.0": full_attention(8),
            "sw.0": _sliding(4),
            "full.1": full_attention(8),
            "sw.1": _sliding(4),
        },
        "LBHNC",
        2,
        tensor_pages=(1024, 1024),
        group_refs=(((0, 1024), (1, 1024)), ((0, 1024), (1, 1024))),
        null_prefix=(False, True),
        block_sizes=(TOKENS_PER_BLOCK, 2 * TOKENS_PER_BLOCK),
    ),
    # Hybrid with pages vLLM cannot unify by block size (768 does not divide 1024): the
    # sliding-window layers get a padded page and alias the full-attention layers.
    "full+sliding-padded": Case(
        lambda: {
            "full.0": full_attention(8),
            "sw.0": _sliding(6),
            "full.1": full_attention(8),
            "sw.1": _sliding(6),
        },
        "LBHNC",
        2,
        tensor_pages=(1024, 1024),
        group_refs=(((0, 1024), (1, 1024)), ((0, 768), (1, 768))),
        null_prefix=(False, True),
        block_sizes=(TOKENS_PER_BLOCK, TOKENS_PER_BLOCK),
    ),
    # Hybrid attention + Mamba: the Mamba state pages are padded to the attention page and
    # alias the attention layers (the connector takes a Mamba page's block stride from its
    # spec, not from the view).
    "full+mamba": Case(
        lambda: {
            "full.0": full_attention(),
            "mamba.0": _mamba(),
            "full.1": full_attention(),
            "mamba.1": _mamba(),
        },
        "LBHNC",
        3,
        tensor_pages=(1024, 1024),
        group_refs=(((0, 1024), (1, 1024)), ((0, 608), (1, 608))),
        null_prefix=(False, False),
        block_sizes=(TOKENS_PER_BLOCK, TOKENS_PER_BLOCK),
    ),
    # A padded page (as a platform pads for alignment): 1280-byte block stride, 1024 used.
    "padded": Case(
        lambda: {f"full.{i}": full_attention(page_size_padded=1280) for i in range(2)},
        "LBHNC",
        1,
        tensor_pages=(1280, 1280),
        group_refs=(((0, 1024), (1, 1024)),),
    ),
    # Block-outermost (packed) layout: a block's pages of all layers are adjacent, so the
    # connector offloads the whole 2048-byte packed block as one region per group.
    "packed": Case(
        lambda: {
            "full.0": full_attention(),
            "sw.0": _sliding(),
            "full.1": full_attention(),
            "sw.1": _sliding(),
        },
        "BLHNC",
        3,
        tensor_pages=(2048,),
        group_refs=(((0, 2048),), ((0, 2048),)),
        null_prefix=(False, True),
        block_sizes=(TOKENS_PER_BLOCK, TOKENS_PER_BLOCK),
    ),
}


def vllm_config(case: Case, extra: dict[str, Any], rank: int, engine_id: str) -> Any:
    """Rank ``rank``'s configuration (ranks of one engine share ``engine_id``)."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ParallelConfig,
        VllmConfig,
    )

    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        engine_id=engine_id,
        kv_connector_extra_config={
            "cpu_bytes_to_use": case.tp << 21,
            "blocks_per_chunk": case.blocks_per_chunk,
            **extra,
        },
    )
    config = VllmConfig(
        # The tokens per block of the layers' specs (0.34.0's default is 64, 0.33.0's 16).
        cache_config=CacheConfig(block_size=TOKENS_PER_BLOCK),
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=case.tp, rank=rank),
        kv_transfer_config=transfer,
    )
    config.cache_config.kv_cache_layout = case.layout
    config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    config.model_config = SimpleNamespace(
        model="fake/model",
        dtype=torch.float16,
        max_model_len=4096,
        use_mla=False,
        get_total_num_kv_heads=lambda: 2 * case.tp,
    )
    return config


def kv_cache_config(config: Any, case: Case) -> Any:
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )

    groups = get_kv_cache_groups(config, case.specs())
    return get_kv_cache_config_from_groups(config, groups, available_memory=1 << 30)
