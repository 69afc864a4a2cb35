"""Retention hints for a replay: read from the trace, or synthesised from the workload's future.

A request *continues* when a later request holds all of its keys but the last (the next turn
of a conversation repeats the earlier prompt; its last, partial block differs in traces that
hash it), and a one-key request continues when a later request starts with its key. Synthetic
hints are for research: they show what hints are worth, and how much wrong ones cost, on
traffic where no application said anything. ``future`` gives every request the true answer,
``future:R`` flips each answer with probability ``R`` (``future:1`` inverts them all), and
``random`` gives each request a fair coin. The draws depend on the mode and the seed only.
"""

from __future__ import annotations

import random

from kvcache.replay.errors import ConfigError
from kvcache.replay.workload import Workload

__all__ = ["HINT_MODES", "apply_hints", "future_hints"]

#: What ``--hints`` accepts (``future:R`` takes an error rate ``R`` from 0 to 1).
HINT_MODES = ("trace", "off", "future", "future:R", "random")


def future_hints(workload: Workload) -> list[str]:
    """Each request's true hint, read from the requests after it (one backward pass)."""
    later: set[bytes] = set()
    hints: list[str] = [""] * len(workload.requests)
    for i in range(len(workload.requests) - 1, -1, -1):
        keys = workload.requests[i]
        probe = keys[-2] if len(keys) >= 2 else (keys[0] if keys else None)
        hints[i] = "continues" if probe is not None and probe in later else "ends"
        later.update(keys)
    return hints


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = -1.0
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"--hints future:R takes an error rate R from 0 to 1, got {text!r}")
    return rate


def apply_hints(workload: Workload, mode: str, *, seed: int = 0) -> Workload:
    """``workload`` with the hints ``mode`` asks for (see the module's docstring)."""
    if mode == "trace":
        return workload
    if mode == "off":
        return workload.with_hints(None, None)
    if mode == "random":
        rng = random.Random(f"kvcache-hints:random:{seed}")
        coin = [rng.choice(("continues", "ends")) for _ in workload.requests]
        return workload.with_hints(coin, "synthetic: random")
    if mode == "future" or mode.startswith("future:"):
        rate = _rate(mode.partition(":")[2]) if ":" in mode else 0.0
        truth = future_hints(workload)
        if rate:
            rng = random.Random(f"kvcache-hints:future:{rate!r}:{seed}")
            flip = {"continues": "ends", "ends": "continues"}
            truth = [flip[h] if rng.random() < rate else h for h in truth]
        label = "synthetic: exact" if not rate else f"synthetic: {rate:.0%} wrong"
        return workload.with_hints(truth, label)
    raise ConfigError(f"--hints must be one of {', '.join(HINT_MODES)}, got {mode!r}")
