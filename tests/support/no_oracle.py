"""Running the suite without the vLLM oracle: which test modules cannot even be imported.

On a machine without vLLM (and its torch), `KVCACHE_ALLOW_NO_ORACLE=1` lets the oracle tests
skip instead of fail (tests/conftest.py). A module that imports vLLM, torch or Triton at its top
level cannot be collected there at all; with that variable set, such a module is left out when
the package it names is not installed, and the run's summary lists what was left out and why.
Without the variable nothing is left out, so CI (which has every package) collects everything,
and a missing package there is a collection error, not a silent gap.

Only top-level `import` / `from ... import` statements count, the module's own and those of the
tests' helper modules it imports (followed through); an import inside a function, a `try`, or a
script kept in a string is the test's own business.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from pathlib import Path

#: The packages that come only with the oracle install (requirements/oracle.txt, vllm.txt).
ORACLE_PACKAGES = ("vllm", "torch", "triton")

#: kvcache's own modules that import one of them when imported (the vLLM adapter).
NEEDS_ORACLE = {"kvcache.vllm": "vllm"}


def _oracle_package(name: str) -> str | None:
    """The oracle package importing module `name` needs, or None."""
    top = name.split(".")[0]
    if top in ORACLE_PACKAGES:
        return top
    for prefix, package in NEEDS_ORACLE.items():
        if name == prefix or name.startswith((f"{prefix}.", f"{prefix}_")):
            return package
    return None


def allowed() -> bool:
    """Whether this run may go without the oracle (KVCACHE_ALLOW_NO_ORACLE=1)."""
    return os.environ.get("KVCACHE_ALLOW_NO_ORACLE") == "1"


def _top_level_imports(source: str) -> set[str]:
    """The modules a module's own top-level import statements name (`from a import b`: a, a.b)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _package_root(path: Path) -> Path:
    """The directory that holds the outermost package `path` belongs to (the tests' root)."""
    root = path.parent
    while (root / "__init__.py").exists():
        root = root.parent
    return root


def _local_module(root: Path, name: str) -> Path | None:
    """The file of a module of the tests' own packages (`tests.x`), or None."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def oracle_imports(path: Path) -> set[str]:
    """The oracle packages a test module needs at import time, through the tests' own helpers."""
    root = _package_root(path)
    needed: set[str] = set()
    seen: set[Path] = set()
    pending = [path]
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        try:
            names = _top_level_imports(module.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue  # pytest reports such a module as it would anyway
        for name in names:
            package = _oracle_package(name)
            if package is not None:
                needed.add(package)
            else:
                local = _local_module(root, name)
                if local is not None:
                    pending.append(local)
                    # importing a.b.c runs a/__init__.py and a/b/__init__.py first
                    for parent in local.parents:
                        init = parent / "__init__.py"
                        if parent == root or not init.is_file():
                            break
                        pending.append(init)
    return needed


def missing_oracle_packages(path: Path) -> list[str]:
    """The oracle packages a test module needs at import time that are not installed."""
    return sorted(name for name in oracle_imports(path) if importlib.util.find_spec(name) is None)


def missing_oracle_package(exc: BaseException | None) -> str | None:
    """The oracle package whose absence raised `exc` (or an exception it came from), or None.

    Only a package that is really not installed counts: a ModuleNotFoundError for an installed
    one is a bug to report, not a test to skip.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            package = _oracle_package(exc.name)
            if package is not None and importlib.util.find_spec(package) is None:
                return package
        exc = exc.__cause__ or exc.__context__
    return None


def needs(*packages: str) -> None:
    """Skip the calling test when the oracle may be missing (`allowed()`) and one of `packages` is.

    Otherwise nothing: with the oracle required, the test runs and fails where it is missing.
    For tests that reach the oracle in a child process, where no exception comes back. It raises
    the ModuleNotFoundError the test would have met, which the suite's report hook turns into a
    skip at the test's own location (tests/conftest.py).
    """
    if not allowed():
        return
    for package in packages:
        if importlib.util.find_spec(package) is None:
            raise ModuleNotFoundError(f"No module named {package!r}", name=package)


_CHILD_MISSING = re.compile(r"^ModuleNotFoundError: No module named '([\w.]+)'", re.MULTILINE)


def skip_if_child_missed_oracle(stderr: str) -> None:
    """Skip when a child process died for want of a missing oracle package (`allowed()` only)."""
    found = _CHILD_MISSING.findall(stderr)
    if found and allowed():
        package = _oracle_package(found[-1])
        if package is not None:
            needs(package)
