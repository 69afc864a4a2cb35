"""The wheel route, as a new user takes it: a clean venv, ``pip install`` the wheel, ``kvcache``.

No vLLM and no torch in that venv: the replay must work there, and the commands that need them
must say so in one line. The wheel is the one ``make wheel`` built (``KVCACHE_WHEEL``, which
``make test`` sets); without it, this module builds one with maturin first (slow: a release build).
"""

from __future__ import annotations

import email.parser
import io
import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvcache

# A release build and a clean venv that pip installs into: not for the quick edit loop.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _sh(
    *argv: str | Path, env: dict[str, str], cwd: Path, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        check=False,
        timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _clean_env(bin_dir: Path | None = None) -> dict[str, str]:
    """The environment without any trace of the development venv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")
    }
    dev_bin = str(Path(sys.prefix) / "bin")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != dev_bin]
    if bin_dir is not None:
        path.insert(0, str(bin_dir))
    env["PATH"] = os.pathsep.join(path)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("KVCACHE_WHEEL")
    if given:
        paths = given.split()
        assert len(paths) == 1, f"KVCACHE_WHEEL names {len(paths)} wheels: {given!r}"
        path = Path(paths[0])
        assert path.is_file(), f"KVCACHE_WHEEL={given!r} is not a file"
        return path
    out = tmp_path_factory.mktemp("dist")
    maturin = Path(sys.prefix) / "bin" / "maturin"
    _sh(maturin, "build", "--release", "--strip", "-q", "-o", out, env=dict(os.environ), cwd=ROOT)
    [path] = out.glob("*.whl")
    return path


@pytest.fixture(scope="module")
def clean_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv made from the base interpreter, with only the wheel (and its dependencies)."""
    root = tmp_path_factory.mktemp("wheel-venv")
    venv.EnvBuilder(with_pip=True, clear=True).create(root / "venv")
    bin_dir = root / "venv" / "bin"
    _sh(bin_dir / "python", "-m", "pip", "install", "-q", wheel, env=_clean_env(bin_dir), cwd=root)
    yield bin_dir
    shutil.rmtree(root, ignore_errors=True)  # ~100 MB (numpy): not kept with pytest's temp dirs


def _kvcache(bin_dir: Path, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _sh(bin_dir / "kvcache", *argv, env=_clean_env(bin_dir), cwd=bin_dir.parent, check=check)


def test_wheel_metadata(wheel: Path) -> None:
    name, version, python, abi, platform_tag = wheel.name.removesuffix(".whl").split("-")
    assert (name, version, python, abi) == ("kvcache_offload", kvcache.__version__, "cp311", "abi3")
    if os.environ.get("KVCACHE_WHEEL"):  # built by `make wheel`
        assert platform_tag == "manylinux_2_28_x86_64"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = f"kvcache_offload-{version}.dist-info"
        meta = email.parser.Parser().parsestr(zf.read(f"{dist_info}/METADATA").decode())
        so = zf.read("kvcache/_core.abi3.so")
    assert f"{dist_info}/licenses/LICENSE" in names
    assert {"kvcache/py.typed", "kvcache/_core.pyi", "kvcache/cli.py"} <= set(names)
    assert meta["Name"] == "kvcache-offload"
    assert meta["License-Expression"] == "Apache-2.0"
    requires = meta.get_all("Requires-Dist") or []
    assert any(r.startswith("numpy") for r in requires)
    assert any(r.startswith("tqdm") for r in requires)
    assert any(r.startswith("vllm==0.34.0") and "extra == 'vllm'" in r for r in requires)
    assert any(r.startswith("torch") and "extra == 'transfer'" in r for r in requires)
    assert not any("extra" not in r and r.startswith(("vllm", "torch")) for r in requires)
    assert set(meta.get_all("Provides-Extra") or []) >= {"plot", "vllm", "transfer"}
    classifiers = meta.get_all("Classifier") or []
    for expected in ("3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {expected}" in classifiers
    assert "Typing :: Typed" in classifiers
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert not any(".invalid" in url for url in meta.get_all("Project-URL") or [])
    # Stripped: no static symbol table in the extension.
    assert so[:4] == b"\x7fELF"
    elftools = pytest.importorskip("elftools.elf.elffile")
    assert elftools.ELFFile(io.BytesIO(so)).get_section_by_name(".symtab") is None


def test_clean_venv_has_neither_vllm_nor_torch(clean_venv: Path) -> None:
    code = (
        "import importlib.util, sys, kvcache, kvcache.cli, kvcache.replay; "
        "found = [m for m in ('vllm', 'torch') if importlib.util.find_spec(m)]; "
        "sys.exit(f'found {found}' if found else 0)"
    )
    _sh(clean_venv / "python", "-c", code, env=_clean_env(clean_venv), cwd=clean_venv.parent)


def test_version(clean_venv: Path) -> None:
    assert _kvcache(clean_venv, "--version").stdout == f"kvcache {kvcache.__version__}\n"


def test_stubs_describe_the_wheel(clean_venv: Path) -> None:
    """The wheel's own ``_core.pyi`` against the wheel's own extension (a release build: no
    test-only methods), by stubtest from the development venv importing only the clean venv's
    kvcache. ``make lint`` checks the same stubs against the test build."""
    [site] = (clean_venv.parent / "lib").glob("python3*/site-packages")
    env = _clean_env()
    env["PYTHONPATH"] = str(site)
    proc = _sh(
        sys.executable,
        "-c",
        "import kvcache._core as c, sys; print(c.__file__); "
        "sys.exit(hasattr(c.BaseCachePolicy, 'validate'))",
        env=env,
        cwd=clean_venv.parent,
    )
    assert proc.stdout.strip().startswith(str(site))
    # The allowlist less the test build's `validate` entries: the stubs must not declare them.
    allowlist = clean_venv.parent / "stubtest-allowlist-wheel.txt"
    lines = (ROOT / "python" / "stubtest-allowlist.txt").read_text().splitlines()
    allowlist.write_text("\n".join(x for x in lines if not x.endswith(".validate")) + "\n")
    proc = _sh(
        sys.executable,
        "-m",
        "mypy.stubtest",
        "kvcache._core",
        "--allowlist",
        allowlist,
        env=env,
        cwd=clean_venv.parent,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_replay_json_from_the_wheel(clean_venv: Path) -> None:
    proc = _kvcache(clean_venv, "replay", "--requests", "200", "--json")
    document = json.loads(proc.stdout)
    meta, rows = document["meta"], document["rows"]
    assert meta["kvcache"] == kvcache.__version__
    assert meta["vllm"] is None
    assert meta["workload"]["requests"] == 200
    assert [(r["policy"], r["capacity_spec"]) for r in rows] == [
        (policy, capacity)
        for policy in ("lru", "arc", "turn")
        for capacity in ("10%", "25%", "50%", "100%")
    ]
    for row in rows:
        assert row["backend"] == "kvcache"
        assert row["hits"] + row["misses"] == row["lookups"] == meta["workload"]["key_visits"]
        assert 0 < row["hit_ratio"] < 1
    # More capacity never hits less, on this workload, for any policy.
    for policy in ("lru", "arc", "turn"):
        ratios = [r["hit_ratio"] for r in rows if r["policy"] == policy]
        assert ratios == sorted(ratios)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (
            ["replay", "--requests", "5", "--backend", "vllm-rust-policies"],
            "needs vLLM 0.33.0 or 0.34.0",
        ),
        (["replay", "--requests", "5", "--compare-vllm"], "needs vLLM 0.33.0 or 0.34.0"),
        (["transfer", "bench", "--device", "cpu"], "needs torch"),
    ],
)
def test_missing_dependency_is_one_line(clean_venv: Path, argv: list[str], fragment: str) -> None:
    proc = _kvcache(clean_venv, *argv, check=False)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert fragment in proc.stderr
