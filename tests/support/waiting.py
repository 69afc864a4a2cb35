"""Waiting for a state another thread reaches, on a machine as busy as it may be.

A test that hands work to a thread (a fake CUDA stream, a DMA queue, a pinning thread, a lookup
thread) waits for the state it then asserts, never for a span of time it hopes is enough:
``wait_until(lambda: fake().gate_reached(gate), "the stream at its gate")``. The deadline only
turns a hang into a failure; it is generous because a loaded machine (``make stress`` runs the
suite pinned to one core beside CPU burners) may take far longer than an idle one, and no test
asserts how fast anything is.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# Bound on any wait for something that must happen: only a bug takes this long.
HANG_S = 120.0
_POLL_S = 0.002


def wait_until(predicate: Callable[[], object], what: str, timeout: float = HANG_S) -> None:
    """Returns once ``predicate()`` is true; fails naming ``what`` if it stays false for
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {timeout:.0f} s: {what}")
        time.sleep(_POLL_S)
