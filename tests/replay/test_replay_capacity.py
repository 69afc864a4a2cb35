"""Capacities: chunk counts, percentages, sizes in bytes, the block size, clamping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache.replay import (
    BlockSize,
    Capacity,
    ConfigError,
    kv_bytes_per_block,
    parse_capacities,
    parse_size,
    resolve_capacities,
)
from kvcache.replay.capacity import PAGE_BYTES, format_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64GiB", 64 << 30),
        ("64gib", 64 << 30),
        ("1.5TiB", 3 << 39),
        ("500GB", 500 * 10**9),
        ("4 KB", 4000),
        ("2MiB", 2 << 20),
        ("7B", 7),
        (".5KiB", 512),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("64G", "unit"),
        ("64", "unit"),
        ("GiB", "unit"),
        ("-1GiB", "unit"),
        ("0GiB", "at least 1 byte"),
        ("0.1B", "at least 1 byte"),
        ("2048EiB", "unit"),
        ("99999999TiB", "out of range"),
    ],
)
def test_parse_size_rejects(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_size(text)


def test_format_bytes() -> None:
    assert format_bytes(64 << 30) == "64 GiB"
    assert format_bytes(3 << 29) == "1.5 GiB"
    assert format_bytes(1000) == "1000 B"


def test_kv_bytes_per_block_is_k_and_v_for_every_layer_head_and_token() -> None:
    # Llama-3-8B-like: 32 layers, 8 KV heads of 128, bf16, 16-token blocks: 2 MiB.
    assert (
        kv_bytes_per_block(layers=32, kv_heads=8, head_size=128, dtype="bfloat16", block_tokens=16)
        == 2 << 20
    )
    assert kv_bytes_per_block(layers=1, kv_heads=1, head_size=1, dtype="fp8", block_tokens=1) == 2
    assert kv_bytes_per_block(layers=2, kv_heads=3, head_size=5, dtype="FP32", block_tokens=7) == (
        2 * 2 * 3 * 5 * 4 * 7
    )
    with pytest.raises(ConfigError, match="unknown KV dtype"):
        kv_bytes_per_block(layers=1, kv_heads=1, head_size=1, dtype="int4", block_tokens=1)
    with pytest.raises(ConfigError, match="layers"):
        kv_bytes_per_block(layers=0, kv_heads=1, head_size=1, dtype="fp8", block_tokens=1)


@given(st.integers(1, 1 << 40))
def test_chunks_are_page_aligned_like_vllm(block_bytes: int) -> None:
    block = BlockSize(bytes=block_bytes, source="t")
    assert block.chunk_bytes % PAGE_BYTES == 0
    assert block.chunk_bytes - PAGE_BYTES < block_bytes <= block.chunk_bytes


def test_sizes_resolve_the_way_vllm_sizes_its_pool() -> None:
    block = BlockSize(bytes=1000, source="t")  # one 4 KiB page per chunk
    [spec] = parse_capacities("1MiB")
    assert spec.resolve(10**9, block) == (1 << 20) // PAGE_BYTES
    with pytest.raises(ConfigError, match="--bytes-per-block"):
        spec.resolve(10**9)
    with pytest.raises(ConfigError, match="less than one chunk"):
        parse_capacities("100B")[0].resolve(10**9, block)


def test_resolve_clamps_to_the_unique_blocks() -> None:
    specs = parse_capacities("10%,999999999,100%,150%,50")
    resolved = resolve_capacities(specs, unique_blocks=200)
    assert [(c.spec, c.chunks, c.requested, c.clamped) for c in resolved] == [
        ("10%", 20, 20, False),
        ("999999999", 200, 999999999, True),
        ("100%", 200, 200, False),
        ("150%", 200, 300, True),
        ("50", 50, 50, False),
    ]
    assert all(c.bytes is None for c in resolved)
    block = BlockSize(bytes=PAGE_BYTES * 2, source="t")
    [sized] = resolve_capacities(parse_capacities("10%"), unique_blocks=200, block=block)
    assert sized.bytes == 20 * 2 * PAGE_BYTES
    # Resolved capacities pass through untouched.
    given_ = Capacity(spec="x", chunks=7, requested=7)
    assert resolve_capacities([given_], unique_blocks=3) == [given_]


def test_block_size_bounds() -> None:
    with pytest.raises(ConfigError):
        BlockSize(bytes=0, source="t")
    with pytest.raises(ConfigError):
        BlockSize(bytes=1 << 61, source="t")
