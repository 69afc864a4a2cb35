"""The replay package's modules import each other without cycles (type-checking imports too)."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import kvcache.replay

PACKAGE = Path(kvcache.replay.__file__).parent


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("kvcache.replay."):
                found.add(name.split(".")[2])
    return found


def test_no_import_cycles() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    graph = {m: _imports(PACKAGE / f"{m}.py") & modules for m in modules}
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle: {exc.args[1]}") from None
    assert set(order) == modules
    # The driver knows backends only as a type; a backend never needs the driver.
    assert "driver" not in graph["backends"]
