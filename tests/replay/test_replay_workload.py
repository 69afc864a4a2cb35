"""The synthetic chat generator and the Mooncake trace loader (no vLLM needed)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from kvcache.replay.errors import TraceError
from kvcache.replay.trace import load_mooncake_trace
from kvcache.replay.workload import SyntheticChat, Workload, make_key, synthetic_chat

SMALL = SyntheticChat(requests=300, seed=7, active_conversations=20)


def test_synthetic_is_deterministic() -> None:
    a = synthetic_chat(SMALL)
    b = synthetic_chat(SMALL)
    assert a == b
    assert a.requests == b.requests


def test_synthetic_seed_changes_the_workload() -> None:
    a = synthetic_chat(SMALL)
    b = synthetic_chat(SyntheticChat(requests=300, seed=8, active_conversations=20))
    assert a.requests != b.requests


def test_synthetic_keys_look_like_vllm_offload_keys() -> None:
    wl = synthetic_chat(SMALL)
    assert len(wl.requests) == 300
    for keys in wl.requests:
        assert len(set(keys)) == len(keys), "a request never repeats a block"
        for key in keys:
            assert isinstance(key, bytes)
            assert len(key) == 36
            assert key[-4:] == b"\0\0\0\0"  # group 0


def test_synthetic_counts_are_consistent() -> None:
    wl = synthetic_chat(SMALL)
    assert wl.key_visits == sum(len(keys) for keys in wl.requests)
    assert wl.unique_blocks == len({k for keys in wl.requests for k in keys})
    assert wl.max_request_keys == max(len(keys) for keys in wl.requests)
    assert wl.block_tokens == SMALL.block_tokens


def test_synthetic_has_shared_prefixes_and_growing_conversations() -> None:
    wl = synthetic_chat(SMALL)
    # System prompts are shared: the most common first block starts many requests.
    first_blocks = Counter(keys[0] for keys in wl.requests if keys)
    assert first_blocks.most_common(1)[0][1] > len(wl.requests) // 10
    # Multi-turn: many requests extend an earlier request's whole block list.
    seen_prefixes = set()
    extending = 0
    for keys in wl.requests:
        if any(keys[:n] in seen_prefixes for n in range(len(keys) - 1, 0, -1)):
            extending += 1
        seen_prefixes.add(keys)
    assert extending > len(wl.requests) // 2
    # Equal keys are interned: one object per block.
    objects = {id(k) for keys in wl.requests for k in keys}
    assert len(objects) == wl.unique_blocks


@pytest.mark.parametrize("field", ["requests", "block_tokens", "active_conversations"])
def test_synthetic_rejects_non_positive_sizes(field: str) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        synthetic_chat(SyntheticChat(**{field: 0}))


def _write_trace(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _record(hash_ids: list[int], ts: int = 0) -> dict[str, object]:
    return {
        "timestamp": ts,
        "input_length": 512 * len(hash_ids),
        "output_length": 10,
        "hash_ids": hash_ids,
    }


def test_trace_keys_are_big_endian_ids_in_group_0(tmp_path: Path) -> None:
    path = _write_trace(tmp_path / "t.jsonl", [_record([0, 1, 2]), _record([0, 1, 7], 5)])
    wl = load_mooncake_trace(path)
    assert isinstance(wl, Workload)
    assert wl.block_tokens == 512
    assert wl.requests[0] == tuple(make_key(i.to_bytes(32, "big")) for i in (0, 1, 2))
    assert wl.requests[1][2] == (7).to_bytes(32, "big") + b"\0\0\0\0"
    assert wl.requests[0][0] is wl.requests[1][0]  # interned
    assert (wl.unique_blocks, wl.key_visits) == (4, 6)


def test_trace_options(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps(_record([1, 2]))
        + "\n\n"
        + json.dumps(_record([3]))
        + "\n"
        + json.dumps(_record([4]))
        + "\n",
        encoding="utf-8",
    )
    assert len(load_mooncake_trace(path).requests) == 3  # the blank line is skipped
    wl = load_mooncake_trace(path, block_tokens=64, max_requests=2)
    assert wl.block_tokens == 64
    assert len(wl.requests) == 2


def test_trace_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load_mooncake_trace(tmp_path / "absent.jsonl")


def test_trace_directory(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="directory"):
        load_mooncake_trace(tmp_path)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 3}', "missing 'hash_ids'"),
        ('{"hash_ids": 5}', "must be a list"),
        ('{"hash_ids": [1, "x"]}', "not a non-negative integer"),
        ('{"hash_ids": [1, -2]}', "not a non-negative integer"),
        ('{"hash_ids": [1, true]}', "not a non-negative integer"),
        ('{"hash_ids": [1, 2, 1]}', "repeats an id"),
        ('{"hash_ids": [1], "input_length": "long"}', "'input_length' must be"),
    ],
)
def test_trace_malformed_line_is_named(tmp_path: Path, bad_line: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    good = json.dumps(_record([1, 2]))
    path.write_text(f"{good}\n{good}\n{bad_line}\n{good}\n", encoding="utf-8")
    with pytest.raises(TraceError, match=message) as info:
        load_mooncake_trace(path)
    assert f"{path}:3:" in str(info.value)
    assert "\n" not in str(info.value)


def test_trace_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n", encoding="utf-8")
    with pytest.raises(TraceError, match="no requests"):
        load_mooncake_trace(path)
