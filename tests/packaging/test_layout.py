"""The tests' and benchmarks' layout rules: a test module imports what it shares from
tests/support, never from another test module; a bench script imports the support package as
``python -m bench.NAME`` from the repository root makes it importable, never by editing
``sys.path``."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement of ``path`` names, at any depth (``from a import b``:
    a and a.b; a relative import counts by the names it brings in)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}".lstrip(".") for alias in node.names)
    return names


AREAS = {
    "policy", "manager", "vllm", "worker", "transfer", "tiering", "replay", "hostile", "cli",
    "packaging",
}  # fmt: skip


def test_every_test_module_sits_in_an_area_folder() -> None:
    """tests/<area>/test_*.py only: a test module dropped at the top, or into the support
    package, or into a folder nobody listed, is found here."""
    modules = sorted((ROOT / "tests").rglob("test_*.py"))
    misplaced = [
        str(p.relative_to(ROOT))
        for p in modules
        if p.parent.parent != ROOT / "tests" or p.parent.name not in AREAS
    ]
    assert modules
    assert misplaced == []


def test_imports_of_test_modules_are_found(tmp_path: Path) -> None:
    """The check below can fail: it sees a test module however it is imported."""
    source = (
        "import tests.cli.test_cli\nfrom tests.replay import test_replay_driver\n"
        "def f():\n    from .test_x import y\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(source, encoding="utf-8")
    found = {n for n in imported_modules(path) if n.rsplit(".", 1)[-1].startswith("test_")}
    assert found == {"tests.cli.test_cli", "tests.replay.test_replay_driver", "test_x"}


def test_no_test_module_imports_another() -> None:
    modules = sorted((ROOT / "tests").rglob("*.py"))
    assert len(modules) > 50
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            name
            for name in imported_modules(path)
            if any(part.startswith("test_") for part in name.split("."))
        )
        for path in modules
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def sys_path_edits(path: Path) -> list[int]:
    """The lines of ``path`` that change ``sys.path`` (a call on it or an assignment to it)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t for t in targets if ast.unparse(t).startswith("sys.path")), None)
        if target is not None and ast.unparse(target).startswith("sys.path"):
            lines.append(node.lineno)
    return sorted(lines)


def test_sys_path_edits_are_found(tmp_path: Path) -> None:
    """The check below can fail: it sees an insert, an append and an assignment."""
    path = tmp_path / "probe.py"
    path.write_text(
        "import sys\nsys.path.insert(0, 'x')\nsys.path.append('y')\nsys.path[:0] = ['z']\n"
        "sys.path += ['w']\nprint(sys.path)\n",
        encoding="utf-8",
    )
    assert sys_path_edits(path) == [2, 3, 4, 5]


def test_bench_scripts_do_not_edit_sys_path() -> None:
    scripts = sorted((ROOT / "bench").glob("*.py"))
    assert scripts
    edits = {str(p.relative_to(ROOT)): sys_path_edits(p) for p in scripts}
    assert {path: lines for path, lines in edits.items() if lines} == {}


def _file_lengths_check() -> ModuleType:
    """scripts/check_file_lengths.py, loaded by path (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "check_file_lengths", ROOT / "scripts" / "check_file_lengths.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_length_check_finds_a_long_file_of_each_language(tmp_path: Path) -> None:
    """A Python, Rust, C or header file one line over the limit is reported in every folder
    the check names (each kind in some folder); one at the limit, or a prose file, is not."""
    check = _file_lengths_check()
    limit = check.MAX_LINES
    assert set(check.SUFFIXES) == {".py", ".rs", ".c", ".h"}
    expected = []
    for i, folder in enumerate(check.FOLDERS):
        suffix = check.SUFFIXES[i % len(check.SUFFIXES)]
        (tmp_path / folder / "sub").mkdir(parents=True)
        (tmp_path / folder / "sub" / f"long{suffix}").write_text("x\n" * (limit + 1))
        (tmp_path / folder / "sub" / f"fits{suffix}").write_text("x\n" * limit)
        (tmp_path / folder / "sub" / "notes.md").write_text("x\n" * (limit + 1))
        expected.append((limit + 1, Path(folder, "sub", f"long{suffix}")))
    assert sorted(check.too_long(tmp_path)) == sorted(expected)
