"""Helpers of the hostile-input suites (``test_hostile_*.py``).

- Snapshots of everything a policy or manager exposes, to assert that an error changed nothing.
- The error classes a case expects, looked up by name and checked to sit in the hierarchy the
  issue asks for (a ``KvCacheError`` that is also the builtin); a case whose class is missing or
  misplaced fails.
- A subprocess runner with a memory watchdog, for inputs that used to abort the interpreter:
  a regression then fails one test instead of killing the test run, and a runaway allocation
  is stopped before it hurts the machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

import kvcache
from tests.support import no_oracle

ROOT = Path(__file__).resolve().parents[2]

# --- error classes ----------------------------------------------------------------------------


def kv_error(name: str) -> type[BaseException] | None:
    """``kvcache.<name>`` if it is an exception class, else None."""
    cls = getattr(kvcache, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else None


def require_error(name: str, builtin: type[BaseException]) -> type[BaseException]:
    """``kvcache.<name>``, checked to be a ``KvCacheError`` and a ``builtin``; fails the test
    when kvcache has no such class."""
    cls = kv_error(name)
    if cls is None:
        pytest.fail(f"kvcache has no {name} (a KvCacheError that is also a {builtin.__name__})")
    assert issubclass(cls, kvcache.KvCacheError), f"{name} must derive from KvCacheError"
    assert issubclass(cls, builtin), f"{name} must derive from {builtin.__name__}"
    return cls


# --- state snapshots --------------------------------------------------------------------------


def policy_state(policy: kvcache.BaseCachePolicy) -> dict[str, Any]:
    """Everything a policy exposes about its state (and its invariants hold)."""
    policy.validate()
    return {"debug": policy._debug_state(), "len": len(policy)}


def manager_state(manager: Any) -> dict[str, Any]:
    """Everything a manager exposes about its state (and its invariants hold)."""
    manager.validate()
    return {
        "debug": manager._debug_state(),
        "len": len(manager),
        "num_evictable": manager.num_evictable,
        "num_write_pending": manager.num_write_pending,
        "num_requests": manager.num_requests,
        # memoryview, not numpy.asarray: numpy turns a failed export into an object scalar.
        "table": memoryview(manager.chunk_table()).tobytes(),
    }


def state_of(obj: Any) -> Any:
    """The observable state of any object a hostile case runs against."""
    if isinstance(obj, kvcache.BaseCachePolicy):
        return policy_state(obj)
    if isinstance(obj, kvcache.ChunkStatus):
        return (obj.ref_cnt, obj.chunk_id, bytes(memoryview(obj)))
    if isinstance(obj, kvcache.EvictedKeys):
        return list(obj)
    if hasattr(obj, "chunk_table"):
        return manager_state(obj)
    raise TypeError(f"no snapshot for {type(obj).__name__}")


def raises_exactly(call: Callable[[], object], expected: type[BaseException]) -> BaseException:
    """Runs ``call``, which must raise exactly ``expected`` (not a subclass, not a base)."""
    try:
        result = call()
    except BaseException as exc:
        if type(exc) is not expected:
            raise AssertionError(
                f"expected exactly {expected.__module__}.{expected.__qualname__}, got "
                f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
            ) from exc
        return exc
    raise AssertionError(f"expected {expected.__qualname__}, returned {result!r}")


def raises_unchanged(
    obj: Any, call: Callable[[], object], expected: type[BaseException]
) -> BaseException:
    """Runs ``call``, which must raise exactly ``expected`` and leave ``obj`` unchanged."""
    before = state_of(obj)
    error = raises_exactly(call, expected)
    assert state_of(obj) == before, "a failed call changed the state"
    return error


# --- chunks -----------------------------------------------------------------------------------


def ready(chunk_id: int) -> kvcache.ChunkStatus:
    """An idle stored chunk (``ref_cnt == 0``)."""
    chunk = kvcache.ChunkStatus(chunk_id)
    chunk.ref_cnt = 0
    return chunk


# --- isolated runs ----------------------------------------------------------------------------

# Imported by every isolated script: memory figures of the child itself.
_PRELUDE = """
import json, sys

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)

# The resident size when `reset_peak()` last ran, if it ran: `report` then says how far the
# peak rose above it, so that a bound on what a call allocates does not also count what the
# imports cost.
_rss_at_reset = None

def reset_peak():
    global _rss_at_reset
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    _rss_at_reset = status("VmRSS")

def report(**values):
    values["vm_peak"] = status("VmPeak")
    values["rss_peak"] = status("VmHWM")
    if _rss_at_reset is not None:
        values["peak_growth"] = values["rss_peak"] - _rss_at_reset
    print("RESULT " + json.dumps(values), flush=True)

# Runs `run()` with the address space limited to `headroom` bytes above its size now. Large
# blocks are always mapped and unmapped (glibc's M_MMAP_THRESHOLD, fixed), so that memory
# freed by an earlier call does not sit in the heap, unseen by the limit.
def limited(headroom, run):
    import ctypes, resource
    ctypes.CDLL(None).mallopt(-3, 128 << 10)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + headroom, hard))
    try:
        return run()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

# The whole process under an address space of `limit` bytes (`ulimit -v`), as the hostile
# rounds run each case: an allocation beyond it fails rather than succeeding on a large host.
def limit_address_space(limit):
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
"""


@dataclass
class Isolated:
    """How an isolated script ended."""

    returncode: int
    stdout: str
    stderr: str
    killed_for_memory: bool
    timed_out: bool

    @property
    def result(self) -> dict[str, Any]:
        """The dict the script passed to ``report(...)``; fails when it never reported."""
        for line in reversed(self.stdout.splitlines()):
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        raise AssertionError(f"the script did not report:\n{self.describe()}")

    def describe(self) -> str:
        how = (
            "killed by the memory watchdog"
            if self.killed_for_memory
            else "timed out"
            if self.timed_out
            else f"exit status {self.returncode}"
            + (f" ({signal.Signals(-self.returncode).name})" if self.returncode < 0 else "")
        )
        return f"{how}\n--- stdout\n{self.stdout[-2000:]}\n--- stderr\n{self.stderr[-3000:]}"

    def check(self) -> dict[str, Any]:
        """The script's report, after asserting it exited cleanly."""
        assert not self.killed_for_memory, self.describe()
        if self.returncode != 0:
            no_oracle.skip_if_child_missed_oracle(self.stderr)
        assert self.returncode == 0, self.describe()
        return self.result


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_isolated(
    script: str,
    *,
    max_rss: int = 2 << 30,
    timeout: float = 300,
    stdout: int | IO[Any] = subprocess.PIPE,
    env: dict[str, str] | None = None,
) -> Isolated:
    """Runs ``script`` in a fresh interpreter (repository root as cwd, ``report(...)``,
    ``limited(...)`` and ``limit_address_space(...)`` available) and stops it when its
    resident memory exceeds ``max_rss`` (by default 2 GiB: a runaway allocation is stopped long
    before it hurts the machine, while a child that imports torch, which alone is 0.5-0.7 GiB
    resident depending on the build, is not; a test that bounds what a call allocates passes
    its own limit or asserts ``peak_growth``). ``stdout``: where its output goes (a pipe read back
    by default; a closed pipe or ``/dev/full`` for output that fails); ``env``: variables set
    on top of this process's."""
    code = _PRELUDE + textwrap.dedent(script)
    # The caller's PYTHONPATH stays after the root: it may name the vLLM oracle under test.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, PYTHONFAULTHANDLER="1", **(env or {}))
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed = timed_out = False
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if _rss(proc.pid) > max_rss:
            killed = True
            proc.kill()
            break
        if time.monotonic() > deadline:
            timed_out = True
            proc.kill()
            break
        time.sleep(0.01)
    out, err = proc.communicate()
    return Isolated(proc.returncode, out or "", err, killed, timed_out)
