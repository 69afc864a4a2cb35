"""The suite's hooks and fixtures: the `oracle` fixture, and what a run without the vLLM oracle
(KVCACHE_ALLOW_NO_ORACLE=1) leaves out or skips. Helpers live in tests/support."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import no_oracle
from tests.support.oracle import require_oracle

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
