"""pytest plugin: vLLM 0.34.0's own KV-offloading tests over kvcache's manager.

Loaded by ``tests/vllm/test_vllm_upstream.py`` into a child pytest that runs the tests of vLLM's
source release (``-p upstream_swap_plugin``, with this directory on ``PYTHONPATH`` after
vLLM's test tree). Before any test module is imported it rebinds ``CPUOffloadingManager`` and
``CPUPrimaryTierOffloadingManager`` where vLLM's tests and vLLM's specs look them up, so every
test that builds a CPU manager or a primary tier, directly or through a spec, builds kvcache's.

``KVCACHE_UPSTREAM`` picks the side:

- ``vllm``: vLLM's own classes (the baseline: which tests pass on vLLM itself);
- ``kvcache``: kvcache's, with read-only stand-ins for the private attributes vLLM's tests
  read (``_policy.get(key)``, LRU's ``_ranks``, ARC's ``t1``/``t2``/``b1``/``b2``/
  ``target_t1_size``, the free list, the allocation and evictable counts,
  ``store_threshold``'s ``counts`` and skipped stores), computed from the Rust manager's state,
  so those tests check kvcache's behaviour rather than fail on a name; a test that writes
  vLLM's internals (or patches its private methods) fails on the read-only stand-in, and
  ``tests/vllm/test_vllm_upstream.py`` lists which and why;
- ``broken``: kvcache's with deliberate defects (a failed promotion's chunks are freed at
  once instead of being held until the tier lets go of them; a chunk still being written
  looks up as a hit): the negative control, which vLLM's tests must catch.

``KVCACHE_UPSTREAM_REPORT`` names a file that receives one JSON line as each test starts
(outcome ``hung``) and one as it ends: its outcome, how many of the swapped classes it built,
and the failure's text; the last line of a test is its record. A test that runs past
``HANG_S`` ends the child, its record left at ``hung``. Worker processes a failed test left
behind are ended once every record is written.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
from collections import OrderedDict
from typing import Any

import pytest

MODES = ("vllm", "kvcache", "broken")


def _inspectable(base: type) -> type:
    import numpy as np
    from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

    class _Chunk:
        """A chunk's status, read from the manager's chunk table on every access, as vLLM's
        ``ChunkStatus`` object is the chunk's live record."""

        def __init__(self, owner: Any, chunk_id: int) -> None:
            self._owner = owner
            self.chunk_id = chunk_id

        @property
        def ref_cnt(self) -> int:
            table = np.asarray(self._owner.chunk_table())
            return int(table["ref_cnt"][self.chunk_id])

        @property
        def is_ready(self) -> bool:
            return self.ref_cnt >= 0

    class _PolicyView:
        """The policy attributes vLLM's tests read, read from the manager at every access (a
        test may keep ``manager._policy`` across operations, as vLLM's object is live)."""

        def __init__(self, owner: Any) -> None:
            self._owner = owner
            self.cache_capacity = int(owner.num_chunks)

        @property
        def _state(self) -> dict[str, Any]:
            return self._owner._debug_state()

        def _chunks(self, name: str) -> OrderedDict[bytes, _Chunk]:
            state = self._state
            chunks = state["chunks"]
            return OrderedDict((k, _Chunk(self._owner, chunks[k][0])) for k in state[name])

        def get(self, key: bytes) -> _Chunk | None:
            entry = self._state["chunks"].get(bytes(key))
            return None if entry is None else _Chunk(self._owner, entry[0])

    class _LruView(_PolicyView):
        @property
        def _ranks(self) -> dict[bytes, Any]:
            # Comparable recency ranks (higher is more recent), as vLLM's LRU orders them.
            return dict(self._state["ranks"])

    class _ArcView(_PolicyView):
        @property
        def t1(self) -> OrderedDict[bytes, _Chunk]:
            return self._chunks("t1")

        @property
        def t2(self) -> OrderedDict[bytes, _Chunk]:
            return self._chunks("t2")

        @property
        def b1(self) -> OrderedDict[bytes, None]:
            return OrderedDict.fromkeys(self._state["b1"])

        @property
        def b2(self) -> OrderedDict[bytes, None]:
            return OrderedDict.fromkeys(self._state["b2"])

        @property
        def target_t1_size(self) -> float:
            return float(self._state["target_t1_size"])

    # vLLM's tests check the policy's class before reading it.
    LRUCachePolicy.register(_LruView)
    ARCCachePolicy.register(_ArcView)
    views = {"lru": _LruView, "arc": _ArcView}

    class Inspectable(base):  # type: ignore[misc, valid-type]
        __doc__ = base.__doc__

        @property
        def _policy(self) -> _PolicyView:
            return views.get(self.cache_policy, _PolicyView)(self)

        @property
        def _num_allocated_chunks(self) -> int:
            return int(self._debug_state()["num_allocated"])

        @property
        def _free_list(self) -> list[int]:
            return list(self._debug_state()["free_list"])

        @property
        def _num_write_pending_chunks(self) -> int:
            return int(self.num_write_pending)

        @property
        def _num_evictable_cache_chunks(self) -> int:
            return int(self.num_evictable)

        @property
        def counts(self) -> OrderedDict[bytes, int] | None:
            tracked = self._debug_state().get("tracked_offers")
            return None if tracked is None else OrderedDict(tracked)

        @property
        def stores_skipped_in_current_batch(self) -> int:
            return int(self._debug_state()["stores_skipped"])

        def _get_num_free_chunks(self) -> int:
            state = self._debug_state()
            return len(state["free_list"]) + int(self.num_chunks) - int(state["num_allocated"])

    Inspectable.__name__ = Inspectable.__qualname__ = base.__name__
    return Inspectable


def _broken_primary(base: type) -> type:
    class CPUPrimaryTierOffloadingManager(base):  # type: ignore[misc, valid-type]
        def defer_write_release(self, keys: Any) -> list[int]:
            chunk_ids = super().defer_write_release(keys)
            # The defect: the chunks go back to the free list while the tier may still write.
            super().release_deferred_write(chunk_ids)
            return chunk_ids

        def release_deferred_write(self, chunk_ids: Any) -> None:
            list(chunk_ids)

    return CPUPrimaryTierOffloadingManager


def _broken_manager(base: type) -> type:
    class CPUOffloadingManager(base):  # type: ignore[misc, valid-type]
        def lookup(self, key: Any, req_context: Any) -> Any:
            # The defect: a chunk still being written reads as a hit.
            result = super().lookup(key, req_context)
            entry = self._debug_state()["chunks"].get(bytes(key))
            if entry is not None and entry[1] < 0:
                return type(result).HIT
            return result

    return CPUOffloadingManager


# --- the report -------------------------------------------------------------------------------

_REPORT: dict[str, dict[str, Any]] = {}
_BUILT = [0]


def _counting(base: type) -> type:
    class Counted(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _BUILT[0] += 1
            super().__init__(*args, **kwargs)

    Counted.__name__ = Counted.__qualname__ = base.__name__
    return Counted


def pytest_configure(config: Any) -> None:
    mode = os.environ.get("KVCACHE_UPSTREAM", "kvcache")
    if mode not in MODES:
        raise ValueError(f"KVCACHE_UPSTREAM must be one of {MODES}, got {mode!r}")
    config.addinivalue_line("markers", "cpu_test: vLLM's marker for tests that need no GPU")
    import vllm.v1.kv_offload.cpu.manager as cpu_manager
    import vllm.v1.kv_offload.cpu.spec as cpu_spec
    import vllm.v1.kv_offload.tiering.manager as tiering_manager
    import vllm.v1.kv_offload.tiering.spec as tiering_spec

    if mode == "vllm":
        manager = cpu_manager.CPUOffloadingManager
        primary = tiering_manager.CPUPrimaryTierOffloadingManager
    else:
        import kvcache.vllm

        manager = _inspectable(kvcache.vllm.CPUOffloadingManager)
        primary = _inspectable(kvcache.vllm.CPUPrimaryTierOffloadingManager)
        if mode == "broken":
            manager = _broken_manager(manager)
            primary = _broken_primary(primary)
    manager, primary = _counting(manager), _counting(primary)
    cpu_manager.CPUOffloadingManager = cpu_spec.CPUOffloadingManager = manager
    tiering_manager.CPUPrimaryTierOffloadingManager = primary
    tiering_spec.CPUPrimaryTierOffloadingManager = primary


def pytest_report_header(config: Any) -> str:
    return f"manager and primary tier: {os.environ.get('KVCACHE_UPSTREAM', 'kvcache')}'s"


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if os.environ.get("KVCACHE_UPSTREAM", "kvcache") == "vllm":
        return
    for item in items:
        why = NOT_APPLICABLE.get(item.nodeid)
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=why))


# Tests that cannot run on kvcache's side, each with why; the calling test names the same ones.
NOT_APPLICABLE = {
    "tests/v1/kv_offload/tiering/test_tier_poll_thread.py::test_lock_defaults_to_no_op": (
        "pins vLLM's no-op default lock and enters it twice; kvcache's manager returns a real "
        "threading.Lock, as vLLM's contract allows, so the second entry would never return"
    ),
}

# A test that runs longer than this is a hang: the child exits, and the report says which.
HANG_S = 120


def _write(record: dict[str, Any]) -> None:
    path = os.environ.get("KVCACHE_UPSTREAM_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _BUILT[0] = 0
    _REPORT[nodeid] = {"node": nodeid, "outcome": "passed", "built": 0, "longrepr": ""}
    _write({"node": nodeid, "outcome": "hung", "built": 0, "longrepr": "never finished"})
    faulthandler.dump_traceback_later(HANG_S, exit=True)


def pytest_runtest_logreport(report: Any) -> None:
    record = _REPORT[report.nodeid]
    record["built"] = _BUILT[0]
    if report.failed and record["outcome"] != "failed":
        record["outcome"] = "failed"
        record["longrepr"] = str(report.longrepr)[-4000:]
    elif report.skipped and record["outcome"] == "passed":
        record["outcome"] = "skipped"
        record["longrepr"] = str(report.longrepr)[-4000:]


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    faulthandler.cancel_dump_traceback_later()
    _write(_REPORT[nodeid])


def pytest_unconfigure(config: Any) -> None:
    # A vLLM test that fails half-way (a worker that did not report within its timeout on a
    # busy machine) can leave the processes it spawned waiting on a queue for ever; Python
    # joins them at exit, so the child would wait out the caller's whole timeout. Every
    # record is written by now: end them.
    for child in multiprocessing.active_children():
        child.kill()
        child.join(10)
