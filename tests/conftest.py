"""Shared fixtures: the vLLM oracle (0.33.0 or 0.34.0, whichever is installed) and key helpers."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

import pytest

from tests import no_oracle

ORACLE_VERSIONS = ("0.33.0", "0.34.0")


def load_oracle() -> ModuleType | None:
    """vLLM's kv_offload package, or None when vLLM is not installed."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError:
        return None
    if getattr(vllm, "__version__", None) not in ORACLE_VERSIONS:
        pytest.fail(
            f"the oracle must be vLLM {' or '.join(ORACLE_VERSIONS)}, found {vllm.__version__}"
        )
    return importlib.import_module("vllm.v1.kv_offload")


def require_oracle() -> None:
    """Oracle tests fail (not skip) without vLLM: CI must run them.

    Set KVCACHE_ALLOW_NO_ORACLE=1 to skip them on a machine without vLLM.
    """
    if load_oracle() is None:
        if os.environ.get("KVCACHE_ALLOW_NO_ORACLE") == "1":
            pytest.skip("vLLM is not installed (KVCACHE_ALLOW_NO_ORACLE=1)")
        pytest.fail("vLLM is not installed: run `make install` (or `make test`)")


def oracle_semantics() -> str:
    """The installed oracle's semantics name: ``"0.33"`` or ``"0.34"``."""
    import vllm

    return ".".join(vllm.__version__.split(".")[:2])


_LEFT_OUT = pytest.StashKey[dict[str, list[str]]]()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Without the oracle (KVCACHE_ALLOW_NO_ORACLE=1), leave out modules it cannot import."""
    if not (no_oracle.allowed() and collection_path.suffix == ".py"):
        return None
    if not collection_path.name.startswith("test_"):
        return None
    missing = no_oracle.missing_oracle_packages(collection_path)
    if not missing:
        return None
    config.stash.setdefault(_LEFT_OUT, {})[str(collection_path)] = missing
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """Without the oracle (KVCACHE_ALLOW_NO_ORACLE=1), a test that needs it skips."""
    report = yield
    if report.failed and no_oracle.allowed() and call.excinfo is not None:
        package = no_oracle.missing_oracle_package(call.excinfo.value)
        if package is not None:
            report.outcome = "skipped"
            report.longrepr = (
                str(item.path),
                item.location[1] or 0,
                f"Skipped: needs {package}, not installed (KVCACHE_ALLOW_NO_ORACLE=1)",
            )
    return report


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    left_out = config.stash.get(_LEFT_OUT, {})
    if left_out:
        terminalreporter.section("left out: no vLLM oracle (KVCACHE_ALLOW_NO_ORACLE=1)")
        for path, missing in sorted(left_out.items()):
            rel = os.path.relpath(path, config.rootpath)
            terminalreporter.line(f"{rel}: needs {', '.join(missing)} to import, not installed")


@pytest.fixture
def oracle() -> None:
    require_oracle()


def make_key(block: int, group: int = 0) -> bytes:
    """A vLLM OffloadKey: a 32-byte block hash and a 4-byte big-endian group index."""
    return block.to_bytes(32, "big") + group.to_bytes(4, "big")
