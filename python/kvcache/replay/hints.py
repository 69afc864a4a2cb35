"""Retention hints for a replay: read from the trace, or synthesised from the workload's future.

A request *continues* when a later request names its second-to-last key: keys are chained
block hashes, so that request repeats this one's prompt up to there (the next turn of a
conversation repeats the earlier prompt; its last, partial block differs in traces that hash
it). A one-key request continues when a later request names its key. Any other request
*ends*. Synthetic hints are for research: they show what hints are worth, and how much wrong
ones cost, on traffic where no application said anything. ``future`` gives every request the
true answer, ``future:R`` flips each answer with probability ``R`` (``future:1`` inverts them
all), and ``random`` gives each request a fair coin. The draws depend on the mode and the seed
only (``--seed``), never on the run's policy or capacity.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from kvcache.replay.errors import ConfigError
from kvcache.replay.workload import Workload

__all__ = ["HINT_MODES", "HintMode", "apply_hints", "future_hints", "parse_hint_mode"]

#: What ``--hints`` accepts (``future:R`` takes an error rate ``R`` from 0 to 1).
HINT_MODES = ("trace", "off", "future", "future:R", "random")

_FLIP = {"continues": "ends", "ends": "continues"}


@dataclass(frozen=True, slots=True)
class HintMode:
    """A parsed ``--hints`` value: where the hints come from and, for ``future``, the share of
    them that is wrong."""

    kind: Literal["trace", "off", "future", "random"]
    error_rate: float = 0.0

    @property
    def draws(self) -> bool:
        """Whether the hints are drawn at random (so the seed matters)."""
        return self.kind == "random" or (self.kind == "future" and 0.0 < self.error_rate < 1.0)

    @property
    def label(self) -> str | None:
        """How reports name synthetic hints (None: not synthetic)."""
        if self.kind == "random":
            return "synthetic: random"
        if self.kind != "future":
            return None
        if self.error_rate == 0.0:
            return "synthetic: exact"
        return f"synthetic: {self.error_rate * 100:g}% wrong"


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not 0.0 <= rate <= 1.0:  # NaN fails too
        raise ConfigError(f"--hints future:R takes an error rate R from 0 to 1, got {text!r}")
    return rate


def parse_hint_mode(text: str) -> HintMode:
    """Parse a ``--hints`` value (see :data:`HINT_MODES`); anything else is a ConfigError."""
    if text in ("trace", "off", "future", "random"):
        return HintMode(text)  # type: ignore[arg-type]
    head, colon, rate = text.partition(":")
    if head == "future" and colon:
        return HintMode("future", _rate(rate))
    raise ConfigError(f"--hints must be one of {', '.join(HINT_MODES)}, got {text!r}")


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


def apply_hints(workload: Workload, mode: str | HintMode, *, seed: int = 0) -> Workload:
    """``workload`` with the hints ``mode`` asks for (see the module's docstring); ``seed``
    sets the draws of ``future:R`` and ``random``. A synthetic mode's label names the seed
    when the hints were drawn."""
    if isinstance(mode, str):
        mode = parse_hint_mode(mode)
    if mode.kind == "trace":
        return workload
    if mode.kind == "off":
        return workload.with_hints(None, None)
    label = mode.label
    if mode.draws:
        label = f"{label}, seed {seed}"
    if mode.kind == "random":
        rng = random.Random(f"kvcache-hints:random:{seed}")
        coin = [rng.choice(("continues", "ends")) for _ in workload.requests]
        return workload.with_hints(coin, label)
    truth = future_hints(workload)
    rate = mode.error_rate
    if rate == 1.0:
        truth = [_FLIP[h] for h in truth]
    elif rate:
        rng = random.Random(f"kvcache-hints:future:{rate!r}:{seed}")
        truth = [_FLIP[h] if rng.random() < rate else h for h in truth]
    return workload.with_hints(truth, label)
