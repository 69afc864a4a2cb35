"""pytest plugin: vLLM 0.34.0's own tiering tests over kvcache's CPU primary tier.

Loaded by ``tests/test_vllm_upstream_tiering.py`` into a child pytest that runs the tests of
vLLM's source release (``-p upstream_primary_plugin``, with this directory on ``PYTHONPATH``
after vLLM's test tree). Before any test module is imported it rebinds
``CPUPrimaryTierOffloadingManager`` where vLLM's tests and vLLM's tiering spec look it up, so
every test that builds a primary tier, directly or through the spec, builds kvcache's.

``KVCACHE_UPSTREAM_PRIMARY`` picks the primary tier:

- ``vllm``: vLLM's own (the baseline: which tests pass on vLLM itself);
- ``kvcache``: kvcache's, with read-only stand-ins for the private attributes some of vLLM's
  tests read (``_policy.get(key)``, the free list and allocation count), computed from the
  Rust manager's state, so those tests check kvcache's behaviour rather than fail on a name;
- ``broken``: kvcache's with a deliberate defect (a failed promotion's chunks are freed at
  once instead of being held until the tier lets go of them): the negative control, which
  vLLM's tests must catch.
"""

from __future__ import annotations

import json
import os
from typing import Any

MODES = ("vllm", "kvcache", "broken")


def _inspectable(base: type) -> type:
    import numpy as np

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
        """``_policy.get(key)`` of vLLM's primary tier."""

        def __init__(self, owner: Any) -> None:
            self._owner = owner

        def get(self, key: bytes) -> _Chunk | None:
            entry = self._owner._debug_state()["chunks"].get(bytes(key))
            return None if entry is None else _Chunk(self._owner, entry[0])

    class CPUPrimaryTierOffloadingManager(base):  # type: ignore[misc, valid-type]
        __doc__ = base.__doc__

        @property
        def _policy(self) -> _PolicyView:
            return _PolicyView(self)

        @property
        def _num_allocated_chunks(self) -> int:
            return int(self._debug_state()["num_allocated"])

        @property
        def _free_list(self) -> list[int]:
            return list(self._debug_state()["free_list"])

        @property
        def _num_write_pending_chunks(self) -> int:
            return int(self.num_write_pending)

        def _get_num_free_chunks(self) -> int:
            state = self._debug_state()
            return len(state["free_list"]) + int(self.num_chunks) - int(state["num_allocated"])

    return CPUPrimaryTierOffloadingManager


def _broken(base: type) -> type:
    class CPUPrimaryTierOffloadingManager(base):  # type: ignore[misc, valid-type]
        def defer_write_release(self, keys: Any) -> list[int]:
            chunk_ids = super().defer_write_release(keys)
            # The defect: the chunks go back to the free list while the tier may still write.
            super().release_deferred_write(chunk_ids)
            return chunk_ids

        def release_deferred_write(self, chunk_ids: Any) -> None:
            list(chunk_ids)

    return CPUPrimaryTierOffloadingManager


def pytest_configure(config: Any) -> None:
    mode = os.environ.get("KVCACHE_UPSTREAM_PRIMARY", "kvcache")
    if mode not in MODES:
        raise ValueError(f"KVCACHE_UPSTREAM_PRIMARY must be one of {MODES}, got {mode!r}")
    config.addinivalue_line("markers", "cpu_test: vLLM's marker for tests that need no GPU")
    import vllm.v1.kv_offload.tiering.manager as manager_module
    import vllm.v1.kv_offload.tiering.spec as spec_module

    if mode == "vllm":
        primary = _counting(manager_module.CPUPrimaryTierOffloadingManager)
    else:
        from kvcache.vllm import CPUPrimaryTierOffloadingManager as Kvcache

        primary = _counting(_inspectable(Kvcache))
        if mode == "broken":
            primary = _broken(primary)
    manager_module.CPUPrimaryTierOffloadingManager = primary
    spec_module.CPUPrimaryTierOffloadingManager = primary


def pytest_report_header(config: Any) -> str:
    return f"primary tier: {os.environ.get('KVCACHE_UPSTREAM_PRIMARY', 'kvcache')}"


# --- the report: one record per test, with how many primary tiers of the mode it built -------

_REPORT: dict[str, dict[str, Any]] = {}
_BUILT = [0]


def _counting(base: type) -> type:
    class CPUPrimaryTierOffloadingManager(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _BUILT[0] += 1
            super().__init__(*args, **kwargs)

    return CPUPrimaryTierOffloadingManager


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _BUILT[0] = 0
    _REPORT[nodeid] = {"outcome": "passed", "primary_tiers": 0, "longrepr": ""}


def pytest_runtest_logreport(report: Any) -> None:
    record = _REPORT[report.nodeid]
    record["primary_tiers"] = _BUILT[0]
    if report.failed and record["outcome"] != "failed":
        record["outcome"] = "failed"
        record["longrepr"] = str(report.longrepr)[-4000:]
    elif report.skipped and record["outcome"] == "passed":
        record["outcome"] = "skipped"


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("KVCACHE_UPSTREAM_REPORT")
    if path:
        with open(path, "w") as out:
            json.dump(_REPORT, out, indent=1, sort_keys=True)
