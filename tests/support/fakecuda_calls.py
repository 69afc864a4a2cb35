"""Buffers and blocking calls for the fake CUDA runtime's own tests: pinned, device and pageable
arrays, a call run on a thread of its own (``Call``) and waits for what the fake reports."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from tests.support.fakecuda import (
    HOST_REGISTER_MAPPED,
    SUCCESS,
    FakeCuda,
)
from tests.support.waiting import HANG_S, wait_until


def addr(a: np.ndarray) -> int:
    return a.ctypes.data


def filled(n: int, value: int) -> np.ndarray:
    return np.full(n, value, dtype=np.uint8)


def pinned(cuda: FakeCuda, n: int, value: int, flags: int = HOST_REGISTER_MAPPED) -> np.ndarray:
    a = filled(n, value)
    assert cuda.host_register(addr(a), a.nbytes, flags) == SUCCESS
    return a


def device(cuda: FakeCuda, n: int, value: int, dev: int = 0) -> np.ndarray:
    a = filled(n, value)
    cuda.add_device_memory(dev, addr(a), a.nbytes)
    return a


class Call:
    """Runs a (blocking) call on a thread of its own; ``result`` once it has returned.

    A test first waits for the fake to report the call blocked (``waiting()``, ``holding()``,
    ``registers_waiting()``), then checks :meth:`blocked`: no guess at how long the thread
    takes to get there."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        self.result = fn()

    def blocked(self) -> bool:
        """Still inside the call."""
        return self.thread.is_alive()

    def finish(self) -> Any:
        self.thread.join(HANG_S)
        assert not self.thread.is_alive(), "the call did not return"
        return self.result


def waiting(cuda: FakeCuda, n: int = 1) -> None:
    """Until ``n`` callers are blocked in synchronising calls."""
    wait_until(lambda: cuda.waiting() == n, f"{n} caller(s) blocked in a synchronising call")


def at_gate(cuda: FakeCuda, gate: int) -> None:
    """Until the stream sits at ``gate``: what it holds back has not run, and will not."""
    wait_until(lambda: cuda.gate_reached(gate), "the stream at its gate")


def on_thread(fn: Callable[[], Any]) -> Any:
    return Call(fn).finish()
