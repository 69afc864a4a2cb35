"""No module of ``python/kvcache`` imports, directly or through others, a module that imports it.

The graph is read statically (``ast``) from every ``python/kvcache/**/*.py``, so it holds
without vLLM, torch or CUDA installed. Every ``import``/``from ... import`` counts wherever it
is written, module level or inside a function: a function-level import only postpones the
cycle to the first call, which is where the partially initialised module bites. Not counted:

- imports under ``if TYPE_CHECKING:``, which never run (they are for the type checker, and a
  type-only reference back is how two modules name each other's types without a cycle);
- imports of a module's enclosing packages (``kvcache.vllm._worker`` runs ``kvcache/__init__``
  and ``kvcache/vllm/__init__`` first): every submodule would otherwise "import" its package,
  which imports it. A submodule that reads a name from its package's ``__init__``
  (``from kvcache.vllm import X``) does count;
- ``importlib.import_module("...")`` with a string: not an import statement (the replay loads
  the adapter that way, on purpose, only when asked to).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PYTHON = Path(__file__).resolve().parents[2] / "python"

Graph = dict[str, set[str]]


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, except under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the `else:` branch does run
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, package: str) -> Graph:
    """``{module: modules of package it imports}`` for every ``.py`` under ``root/package``."""
    files = {_module_name(root, p): p for p in sorted((root / package).rglob("*.py"))}
    # A compiled module (kvcache._core) is known by its stub: a leaf here, as its imports of
    # Python modules are calls made at run time, not import statements.
    compiled = {_module_name(root, p) for p in (root / package).rglob("*.pyi")} - set(files)
    graph: Graph = {name: set() for name in [*files, *sorted(compiled)]}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    # The package a relative import starts from: the module's own when it is
                    # an __init__, else its parent; one package up per extra dot.
                    anchor = name.split(".")
                    drop = node.level - 1 if is_package else node.level
                    if drop >= len(anchor):
                        raise ValueError(f"{path}: relative import beyond the top level")
                    anchor = anchor[: len(anchor) - drop]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    # `from pkg import sub` imports the submodule; any other name is read
                    # from `pkg` itself.
                    targets.append(sub if sub in graph else base)
            for target in targets:
                # `import a.b.c` (or `a.b.c` not a file: a name in a.b) depends on the deepest
                # module of the package that the dotted name reaches.
                while target and target not in graph:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None when it has none."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        pending = [iter(sorted(graph[start]))]
        while pending:
            nxt = next(pending[-1], None)
            if nxt is None:
                pending.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
            elif nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                pending.append(iter(sorted(graph[nxt])))
    return None


def test_kvcache_has_no_import_cycle() -> None:
    graph = import_graph(PYTHON, "kvcache")
    # The walk saw the package as it is: its subpackages and the edges that split them.
    assert {"kvcache", "kvcache.vllm", "kvcache.vllm._spec", "kvcache.replay"} <= set(graph)
    assert "kvcache.vllm._manager" in graph["kvcache.vllm._tiering"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


# A package whose only cycle goes through a function-level relative import two levels up.
CYCLIC = {
    "pkg/__init__.py": "",
    "pkg/a.py": "from pkg.sub import b\n",
    "pkg/sub/__init__.py": "",
    "pkg/sub/b.py": "import os\n\n\ndef late():\n    from ..a import name\n    return name\n",
}


def test_the_checker_finds_a_cycle(tmp_path: Path) -> None:
    _write(tmp_path, CYCLIC)
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": set(), "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]


@pytest.mark.parametrize(
    ("b_text", "cycle"),
    [
        # What breaks the cycle: a type-only import, and a name the package's __init__ holds.
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import name\n", None),
        ("from .. import name\n", None),
        # What does not: an import in the else branch of TYPE_CHECKING, `import a.b` by its
        # full name, a relative import from an __init__ that names the submodule.
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    pass\nelse:\n"
            "    import pkg.a\n",
            ["pkg.a", "pkg.sub.b", "pkg.a"],
        ),
        ("def f():\n    import pkg.a.name\n", ["pkg.a", "pkg.sub.b", "pkg.a"]),
    ],
)
def test_what_counts_as_an_import(tmp_path: Path, b_text: str, cycle: list[str] | None) -> None:
    _write(tmp_path, {**CYCLIC, "pkg/sub/b.py": b_text})
    assert find_cycle(import_graph(tmp_path, "pkg")) == cycle


def test_an_init_importing_its_submodule_that_reads_it_is_a_cycle(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .impl import thing\nVALUE = 1\n",
            "pkg/impl.py": "def thing():\n    from . import VALUE\n    return VALUE\n",
        },
    )
    assert find_cycle(import_graph(tmp_path, "pkg")) == ["pkg", "pkg.impl", "pkg"]


def test_a_compiled_module_is_a_leaf_known_by_its_stub(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import thing\n",
            "pkg/a.py": "from pkg._ext import Native\nthing = Native\n",
            "pkg/_ext.pyi": "class Native: ...\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg._ext"}, "pkg._ext": set()}
    assert find_cycle(graph) is None
