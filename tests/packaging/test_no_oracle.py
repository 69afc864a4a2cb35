"""tests/support/no_oracle.py: what a run without the vLLM oracle leaves out, and what it skips."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.support import no_oracle


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    """A tests package with helpers, some of which import oracle packages at their top level."""
    _write(
        tmp_path,
        {
            "suite/__init__.py": "",
            "suite/helper_torch.py": "import numpy\nimport torch.nn\n",
            "suite/helper_plain.py": "import json\n",
            "suite/deep/__init__.py": "from vllm.v1 import kv_offload\n",
            "suite/deep/leaf.py": "X = 1\n",
            "suite/test_top.py": "import torch\n",
            "suite/test_via_helper.py": "from suite.helper_torch import thing\n",
            "suite/test_via_package_init.py": "from suite.deep.leaf import X\n",
            "suite/test_adapter.py": "from kvcache.vllm import CPUOffloadingSpec\n",
            "suite/test_plain.py": (
                "import json\nfrom suite import helper_plain\n\n"
                "def test_x():\n    import torch\n\n"
                "SCRIPT = 'import vllm'\n"
                "try:\n    import triton\nexcept ImportError:\n    triton = None\n"
            ),
        },
    )
    return tmp_path / "suite"


@pytest.mark.parametrize(
    ("module", "needed"),
    [
        ("test_top.py", {"torch"}),
        ("test_via_helper.py", {"torch"}),
        ("test_via_package_init.py", {"vllm"}),
        ("test_adapter.py", {"vllm"}),
        ("test_plain.py", set()),
    ],
)
def test_only_top_level_imports_count_followed_through_helpers(
    suite: Path, module: str, needed: set[str]
) -> None:
    assert no_oracle.oracle_imports(suite / module) == needed


def test_an_installed_package_is_not_missing(suite: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert no_oracle.missing_oracle_packages(suite / "test_top.py") == []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert no_oracle.missing_oracle_packages(suite / "test_top.py") == ["torch"]


def _raised_under(inner: BaseException) -> AssertionError:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise AssertionError("expected exactly InvalidTypeError") from exc
    except AssertionError as outer:
        return outer


def test_a_missing_oracle_package_is_found_through_the_exception_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    missing = ModuleNotFoundError("No module named 'vllm.v1'", name="vllm.v1")
    assert no_oracle.missing_oracle_package(missing) == "vllm"
    assert no_oracle.missing_oracle_package(_raised_under(missing)) == "vllm"
    adapter = ModuleNotFoundError("x", name="kvcache.vllm._worker")
    assert no_oracle.missing_oracle_package(adapter) == "vllm"
    # Not an oracle package, or not a missing module at all: a failure to report.
    other = ModuleNotFoundError("No module named 'numpy'", name="numpy")
    assert no_oracle.missing_oracle_package(_raised_under(other)) is None
    assert no_oracle.missing_oracle_package(ValueError("vllm")) is None


def test_a_module_not_found_for_an_installed_package_is_not_excused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    missing = ModuleNotFoundError("No module named 'vllm.v1.gone'", name="vllm.v1.gone")
    assert no_oracle.missing_oracle_package(missing) is None


def test_needs_raises_only_when_the_oracle_may_be_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("KVCACHE_ALLOW_NO_ORACLE", raising=False)
    no_oracle.needs("torch")  # required: the test goes on, and fails where torch is missing
    no_oracle.skip_if_child_missed_oracle("ModuleNotFoundError: No module named 'torch'\n")
    monkeypatch.setenv("KVCACHE_ALLOW_NO_ORACLE", "1")
    with pytest.raises(ModuleNotFoundError) as raised:
        no_oracle.needs("torch")
    assert raised.value.name == "torch"
    with pytest.raises(ModuleNotFoundError) as raised:
        no_oracle.skip_if_child_missed_oracle(
            "Traceback (most recent call last):\n  ...\n"
            "ModuleNotFoundError: No module named 'vllm.v1'\n"
        )
    assert raised.value.name == "vllm"
    no_oracle.skip_if_child_missed_oracle("ModuleNotFoundError: No module named 'numpy'\n")
