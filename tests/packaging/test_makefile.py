"""``make help`` lists every target a contributor can name: each phony target's rule line
carries the ``## what it does`` comment the help target prints."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def phony_targets(makefile: str) -> set[str]:
    """The names in the ``.PHONY`` list (continued lines included)."""
    match = re.search(r"^\.PHONY:((?:[^\n]*\\\n)*[^\n]*)", makefile, re.M)
    assert match, "no .PHONY line"
    return set(match.group(1).replace("\\\n", " ").split())


def documented_targets(makefile: str) -> set[str]:
    """Targets whose rule line ends in ``## ...``, as the help target reads them."""
    return set(re.findall(r"^([a-z][a-z-]*):[^\n]*## ", makefile, re.M))


def test_the_checks_see_an_undocumented_target() -> None:
    makefile = ".PHONY: a b \\\n        c\na: ## does a\nb: a\nc: ## does c\n"
    assert phony_targets(makefile) == {"a", "b", "c"}
    assert documented_targets(makefile) == {"a", "c"}


def test_every_phony_target_is_documented() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    phony = phony_targets(makefile)
    assert len(phony) > 10
    assert phony - documented_targets(makefile) == set()


def test_make_help_prints_every_target() -> None:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    done = subprocess.run(
        ["make", "-s", "--no-print-directory", "help"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    assert listed == phony_targets((ROOT / "Makefile").read_text(encoding="utf-8"))
