"""Packaging facts that must stay in step across files (no build needed)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import kvcache

ROOT = Path(__file__).resolve().parents[2]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r.strip(), maxsplit=1)[0].lower() for r in requirements}


def _requirement_lines(path: Path) -> list[str]:
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line]


def test_the_replay_only_install_has_every_runtime_dependency() -> None:
    """`make replay` installs requirements/base.txt and runs from the source tree: it must hold
    everything the wheel depends on."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _names(_requirement_lines(ROOT / "requirements" / "base.txt"))
    assert _names(project["dependencies"]) <= base
    assert not base & {"torch", "vllm"}


def test_every_install_layer_is_pinned() -> None:
    constraints = _names(_requirement_lines(ROOT / "requirements" / "constraints.txt"))
    for layer in ("base", "wheel", "dev", "oracle"):
        names = _names(_requirement_lines(ROOT / "requirements" / f"{layer}.txt"))
        assert names <= constraints, f"{layer}.txt: not pinned: {names - constraints}"


def test_license_and_version_agree_with_the_crates() -> None:
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == cargo["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert kvcache.__version__ == cargo["version"]


def test_the_changelog_names_the_current_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[?{re.escape(kvcache.__version__)}\]?", changelog, re.MULTILINE)


def test_no_placeholder_project_urls() -> None:
    """A URL in the metadata must lead somewhere: no reserved placeholder domains."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for name, url in project.get("urls", {}).items():
        host = re.sub(r"^[a-z]+://", "", url).split("/", 1)[0]
        assert not host.endswith((".invalid", ".example", ".test")), f"{name}: {url}"
        assert host not in ("example.com", "example.org", "example.net"), f"{name}: {url}"
