"""Fail when a source file is too long to read in one sitting: every Python, Rust and C file
(*.py, *.rs, *.c, *.h) under python/, crates/, tests/, bench/, gpu/, fuzz/ and scripts/ must be
at most MAX_LINES lines (split a longer one by concern). Lists every file over the limit,
longest first, and exits 1; `make lint` runs it.

Usage: python scripts/check_file_lengths.py [ROOT]   (default: the repository root)
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_LINES = 900
FOLDERS = ("python", "crates", "tests", "bench", "gpu", "fuzz", "scripts")
SUFFIXES = (".py", ".rs", ".c", ".h")
#: Build outputs and caches, never source.
SKIPPED = {"target", ".venv", "__pycache__", ".pytest_cache", ".hypothesis"}


def too_long(root: Path) -> list[tuple[int, Path]]:
    """(line count, path relative to ``root``) of every source file over MAX_LINES."""
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            rel = path.relative_to(root)
            if path.suffix not in SUFFIXES or SKIPPED & set(rel.parts) or not path.is_file():
                continue
            with path.open("rb") as f:
                lines = sum(1 for _ in f)
            if lines > MAX_LINES:
                found.append((lines, rel))
    return sorted(found, key=lambda item: (-item[0], str(item[1])))


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    found = too_long(root)
    for lines, rel in found:
        print(f"{rel}: {lines} lines (at most {MAX_LINES}: split it by concern)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
