"""Threads: every call on one policy or manager is serialised from entry to exit, including the
Python callbacks it runs; a thread that finds the object busy waits, never fails; the result
is some serial order of the calls (the order the harness recorded).

The harness is ``tests/threads_driver.py`` (its docs explain how the order is recorded). Each
run happens in a fresh interpreter, so a deadlock or a crash fails one test instead of the
whole session. The harness first proves itself on an object serialised by a Python lock.
"""

from __future__ import annotations

import threading

import pytest

from tests.hostile import run_isolated

TARGETS = ["policy-lru", "policy-arc", "manager-lru", "manager-arc"]


def threaded(target: str, *, serialise: bool = False, seed: int = 0) -> dict:
    script = f"""
    from tests.threads_driver import main
    report(**main({target!r}, {seed}, serialise={serialise}))
    """
    return run_isolated(script, timeout=300).check()


def assert_serial(report: dict) -> None:
    assert report["num_errors"] == 0, report["errors"]
    assert report["validate"] == "ok"
    assert report["unlogged"] == 0
    assert report["result_mismatches"] == [], "a call's result differs from the serial replay"
    assert report["state_matches"], "the final state differs from the serial replay"
    # The run did exercise the busy path: calls arrived while another was inside.
    assert report["contended"] > 50


@pytest.mark.parametrize("target", TARGETS)
def test_the_harness_accepts_an_object_serialised_by_a_python_lock(target: str) -> None:
    assert_serial(threaded(target, serialise=True))


@pytest.mark.parametrize("target", TARGETS)
def test_eight_threads_of_mixed_calls_equal_a_serial_replay(target: str) -> None:
    assert_serial(threaded(target))


# --- vLLM's lock contract ---------------------------------------------------------------------


def test_the_vllm_manager_lock_is_a_real_lock() -> None:
    from kvcache.vllm import CPUOffloadingManager

    manager = CPUOffloadingManager(num_chunks=4)
    lock = manager.lock
    assert manager.lock is lock, "one lock per manager"
    with lock:
        got = []
        other = threading.Thread(target=lambda: got.append(lock.acquire(timeout=0.05)))
        other.start()
        other.join()
        assert got == [False], "another thread entered while the lock was held"
    assert lock.acquire(timeout=1)
    lock.release()
    with manager.lock:  # vLLM's callers hold it around every call
        manager.lookup(b"k" * 36, None)
