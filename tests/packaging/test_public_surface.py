"""Every import path and configuration string users write keeps working, whatever the modules
behind them: the public names of ``kvcache``, ``kvcache.vllm``, ``kvcache.transfer`` and
``kvcache.replay``, and the names vLLM's factories look up by configuration
(``"spec_module_path"``, ``"cache_policy_module_path"``: ``"kvcache.vllm"`` or ``"kvcache"``).

The lists are written out, not read from the package: a name dropped from the package fails
here instead of leaving the list with it."""

from __future__ import annotations

import importlib

import pytest

from tests.support.oracle import require_oracle

KVCACHE_ALL = (
    "VLLM_SEMANTICS", "ARCCachePolicy", "BaseCachePolicy", "ChunkStatus", "DuplicateKeyError",
    "EvictedKeys", "InvalidArgumentError", "InvalidChunkError", "InvalidKeyError",
    "InvalidStateError", "InvalidTypeError", "KeyNotFoundError", "KvCacheError",
    "LRUCachePolicy", "LoadStoreSpec", "LookupResult", "ManagerStats", "NotEvictableError",
    "OffloadingEvent", "OffloadingManager", "OutOfMemoryError", "OutOfRangeError",
    "PoolClosedError", "PrepareStoreOutput", "ReentrantCallError", "ReqContext", "TransferError",
    "TurnCachePolicy", "UnsupportedOperationError", "__version__", "order_request_keys",
)  # fmt: skip
VLLM_ALL = (
    "ALLOW_UNTESTED_ENV", "RUNNING_VLLM_SEMANTICS", "TESTED_VLLM_VERSIONS", "VLLM_SEMANTICS",
    "ARCCachePolicy",
    "CPUOffloadingManager", "CPUOffloadingSpec", "CPUOffloadingWorker", "KvCacheOffloadingSpec",
    "KvCacheTieringOffloadingSpec", "LRUCachePolicy", "TurnCachePolicy",
    "UnsupportedVersionError", "rust_policy",
)  # fmt: skip
#: Defined by ``kvcache.vllm`` and named by the docs or used by kvcache itself, outside
#: ``__all__``.
VLLM_MORE = (
    "CPUPrimaryTierOffloadingManager", "OUR_MODULES", "RUST_POLICIES", "WORKER_DEFAULT_REASON",
    "WORKER_GPU_EVIDENCE", "build_manager", "policy_for_vllm_factory",
)  # fmt: skip
TRANSFER_ALL = ("HostChunkPool", "JobResult", "TransferEngine")
REPLAY_ALL = (
    "BACKENDS", "DEFAULT_TRACE_BLOCK_TOKENS", "POLICIES", "POLICY_CLASSES", "REFERENCE_VLLM",
    "Backend", "BackendUnavailable", "BlockSize", "Capacity", "CapacitySpec", "Comparison",
    "ConfigError", "Decision", "HintMode", "NullManager", "ReplayError", "ReplayOptions",
    "ReplayRun", "Row", "SyntheticChat", "Timing", "TraceError", "Workload", "apply_hints",
    "compare_backends", "compare_decisions", "future_hints", "get_backend", "grid_runs",
    "kv_bytes_per_block", "kvcache_backend", "load_mooncake_trace", "make_key", "null_backend",
    "parse_capacities", "parse_hint_mode", "parse_policies", "parse_size", "replay",
    "resolve_capacities", "run_grid", "rust_policies_backend", "synthetic_chat", "time_backend",
    "time_backends", "vllm_backend",
)  # fmt: skip
#: Modules users import or run (``python -m``, the ``kvcache`` command's ``kvcache.cli:main``).
PUBLIC_MODULES = (
    "kvcache", "kvcache.cli", "kvcache.manager", "kvcache.replay", "kvcache.replay.backends",
    "kvcache.replay.baseline", "kvcache.replay.capacity", "kvcache.replay.compare",
    "kvcache.replay.driver", "kvcache.replay.errors", "kvcache.replay.hints",
    "kvcache.replay.meta", "kvcache.replay.progress", "kvcache.replay.report",
    "kvcache.replay.runner", "kvcache.replay.trace", "kvcache.replay.workload",
    "kvcache.transfer",
)  # fmt: skip
#: The spec names a configuration gives with ``"spec_module_path"``.
SPECS = ("KvCacheOffloadingSpec", "KvCacheTieringOffloadingSpec")
#: The policy class names a configuration gives with ``"cache_policy_module_path"``.
POLICIES = ("LRUCachePolicy", "ARCCachePolicy", "TurnCachePolicy")
OUR_MODULES = ("kvcache.vllm", "kvcache")


def _check_names(module: str, all_names: tuple[str, ...], more: tuple[str, ...] = ()) -> None:
    mod = importlib.import_module(module)
    missing = sorted(set(all_names) - set(mod.__all__))
    assert not missing, f"{module}.__all__ lost {missing}"
    for name in (*all_names, *more):
        namespace: dict[str, object] = {}
        exec(f"from {module} import {name}", namespace)
        assert namespace[name] is getattr(mod, name)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_module_imports(module: str) -> None:
    importlib.import_module(module)


@pytest.mark.parametrize(
    ("module", "names"),
    [("kvcache", KVCACHE_ALL), ("kvcache.transfer", TRANSFER_ALL), ("kvcache.replay", REPLAY_ALL)],
)
def test_public_names_without_vllm(module: str, names: tuple[str, ...]) -> None:
    _check_names(module, names)


def test_kvcache_vllm_names() -> None:
    require_oracle()
    _check_names("kvcache.vllm", VLLM_ALL, VLLM_MORE)
    import kvcache.vllm

    assert kvcache.vllm.KvCacheOffloadingSpec is kvcache.vllm.CPUOffloadingSpec
    # VLLM_SEMANTICS names the running release here (a string), the supported ones in kvcache.
    assert kvcache.vllm.VLLM_SEMANTICS is kvcache.vllm.RUNNING_VLLM_SEMANTICS
    assert kvcache.vllm.RUNNING_VLLM_SEMANTICS in kvcache.VLLM_SEMANTICS
    assert issubclass(
        kvcache.vllm.CPUPrimaryTierOffloadingManager, kvcache.vllm.CPUOffloadingManager
    )


@pytest.mark.parametrize("module", OUR_MODULES)
@pytest.mark.parametrize("name", SPECS)
def test_spec_module_path(module: str, name: str) -> None:
    require_oracle()
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    import kvcache.vllm

    extra = {"spec_name": name, "spec_module_path": module}
    assert OffloadingSpecFactory.get_spec_cls(extra) is getattr(kvcache.vllm, name)


@pytest.mark.parametrize("module", OUR_MODULES)
@pytest.mark.parametrize("name", POLICIES)
def test_cache_policy_module_path(module: str, name: str) -> None:
    require_oracle()
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    import kvcache

    assert CachePolicyFactory.get_cache_policy_cls(name, module) is getattr(kvcache, name)


@pytest.mark.parametrize("name", ["ReplayError", "TraceError", "ConfigError", "BackendUnavailable"])
def test_replay_errors_are_kvcache_errors(name: str) -> None:
    import kvcache
    import kvcache.replay

    cls = getattr(kvcache.replay, name)
    assert issubclass(cls, kvcache.replay.ReplayError)
    assert issubclass(cls, kvcache.KvCacheError)
    # Caught as before by ``except Exception``, and by ``except KvCacheError`` with the rest.
    with pytest.raises(kvcache.KvCacheError, match="one line"):
        raise cls("one line")
