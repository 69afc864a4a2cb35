"""The decision comparison on hand-made logs: every field it claims to compare can fail it."""

from __future__ import annotations

import dataclasses

import pytest

from kvcache.replay import Decision, compare_decisions, make_key
from kvcache.replay.compare import format_key


def key(i: int) -> bytes:
    return make_key(i.to_bytes(32, "big"))


def log() -> list[Decision]:
    stored = (("stored", (key(1), key(2)), "CPU"),)
    return [
        Decision(0, 0, "MISS", "ok", (key(1), key(2)), (0, 1), (), ()),
        Decision(1, 2, None, "none", (), (), (), stored),
        Decision(2, 1, "HIT_PENDING", "ok", (key(3),), (1,), (key(2),), ()),
        Decision(3, 0, "MISS", "failed", (), (), (), ()),
        Decision(4, 0, None, "drain", (), (), (), (("removed", (key(2),), "CPU"),)),
    ]


def test_identical_logs_match() -> None:
    result = compare_decisions(log(), log())
    assert result.matched
    assert result.steps == 5
    assert result.divergence is None


@pytest.mark.parametrize(
    ("step", "change", "field"),
    [
        (2, {"hits": 0}, "hits"),
        (0, {"stop": "HIT_PENDING"}, "stop"),
        (3, {"store": "ok"}, "store"),
        (0, {"keys_to_store": (key(2), key(1))}, "keys_to_store"),  # order matters
        (2, {"block_ids": (7,)}, "block_ids"),
        (2, {"evicted_keys": (key(9),)}, "evicted_keys"),
        (1, {"events": ()}, "events"),
        (4, {"events": (("removed-metadata", (key(2),), "CPU"),)}, "events"),
    ],
)
def test_each_field_difference_is_found(step: int, change: dict[str, object], field: str) -> None:
    actual = log()
    actual[step] = dataclasses.replace(actual[step], **change)
    result = compare_decisions(log(), actual, expected_name="vllm", actual_name="ours")
    assert not result.matched
    assert result.steps == step
    assert result.divergence is not None
    assert f"{field} differ" in result.divergence
    assert ("final drain" if step == 4 else f"request {step}:") in result.divergence
    assert "vllm" in result.divergence
    assert "ours" in result.divergence
    assert "\n" not in result.divergence


def test_length_difference_is_found() -> None:
    result = compare_decisions(log(), log()[:-1])
    assert not result.matched
    assert "length" in (result.divergence or "")


def test_divergence_points_at_the_first_differing_element() -> None:
    actual = log()
    actual[0] = dataclasses.replace(actual[0], block_ids=(0, 5))
    result = compare_decisions(log(), actual)
    assert "first at index 1: 1 vs 5" in (result.divergence or "")


def test_format_key_shows_the_tail_and_group() -> None:
    assert format_key(make_key((0x1234).to_bytes(32, "big"), 3)) == "..000000001234/g3"
