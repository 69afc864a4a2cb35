"""Decide whether two managers made the same decisions on the same replay.

Each side is a decision log recorded by :func:`kvcache.replay.driver.replay` with
``record=True``. Steps are compared in order, field by field -- the lookup outcome (hits and the
first non-hit result), whether ``prepare_store`` succeeded, ``evicted_keys``, ``keys_to_store``,
the chunk ids (``store_spec.block_ids``) and the events taken after the step -- and the first
difference is reported on one line. Order matters everywhere: vLLM's scheduler hands these lists
to the workers as they are, and the order of evictions decides which chunk ids are reused next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcache.replay.driver import Decision

__all__ = ["Comparison", "compare_decisions", "format_key"]

# In causal order within a step, so the first reported difference is the cause: an eviction
# that differs also changes which chunk ids the same step hands out.
_FIELDS = (
    "hits", "stop", "store", "evicted_keys", "keys_to_store", "block_ids", "events", "reoffers",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Comparison:
    """The verdict: ``matched`` and, if not, where the logs first part ways."""

    matched: bool
    steps: int
    divergence: str | None = None


def format_key(key: bytes) -> str:
    """Short, readable form of an offload key: the hash's last 6 bytes and the group index.

    The tail rather than the head, because trace keys are small ids padded with leading zeros.
    """
    if len(key) < 5:
        return key.hex()
    return f"..{key[:-4][-6:].hex()}/g{int.from_bytes(key[-4:], 'big')}"


def _short(value: Any) -> str:
    if isinstance(value, bytes):
        return format_key(value)
    if isinstance(value, tuple):
        items = [_short(v) for v in value[:4]]
        more = f", +{len(value) - 4} more" if len(value) > 4 else ""
        return f"[{', '.join(items)}{more}]"
    return repr(value)


def _first_difference(a: Any, b: Any) -> str:
    if isinstance(a, tuple) and isinstance(b, tuple):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return f" (first at index {i}: {_short(x)} vs {_short(y)})"
        return f" (lengths {len(a)} vs {len(b)})"
    return ""


def compare_decisions(
    expected: Sequence[Decision],
    actual: Sequence[Decision],
    *,
    expected_name: str = "vllm",
    actual_name: str = "kvcache",
) -> Comparison:
    """Compare two decision logs of the same workload; report the first divergence."""
    for a, b in zip(expected, actual, strict=False):
        if a.step != b.step:
            return Comparison(False, a.step, f"step numbering differs ({a.step} vs {b.step})")
        for name in _FIELDS:
            va, vb = getattr(a, name), getattr(b, name)
            if va != vb:
                where = "final drain" if a.store == "drain" else f"request {a.step}"
                return Comparison(
                    False,
                    a.step,
                    f"{where}: {name} differ: {expected_name} {_short(va)} vs "
                    f"{actual_name} {_short(vb)}{_first_difference(va, vb)}",
                )
    if len(expected) != len(actual):
        return Comparison(
            False,
            min(len(expected), len(actual)),
            f"logs differ in length: {expected_name} {len(expected)} steps vs "
            f"{actual_name} {len(actual)}",
        )
    return Comparison(True, len(expected))
