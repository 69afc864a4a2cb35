"""What a GPU check path reports, and how it fails or says it cannot run."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any


def out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Skip(Exception):
    """A path that cannot run on this device (the message says why)."""


@dataclass
class Row:
    name: str
    status: str = "passed"
    why: str = ""
    methods: dict[str, int] = field(default_factory=dict)
    checked_bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "why": self.why,
            "methods": self.methods,
            "checked_bytes": self.checked_bytes,
            "seconds": round(self.seconds, 3),
        }


class Failed(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Failed(what)
