"""vLLM 0.34.0's own KV-offloading tests, from its source release on PyPI.

The wheel the suite tests against ships no tests; the source release of the same version does.
``tests_root()`` downloads it once (pinned by SHA-256), keeps only ``tests/v1/kv_offload/``
(and the two package markers above it) under ``.cache/`` in the repository, and returns the
directory to run pytest in. ``KVCACHE_VLLM_SDIST`` names a local copy of the tarball instead
(offline machines). ``run()`` runs a selection of those tests in a child pytest with
``upstream_swap_plugin`` choosing whose manager and primary tier they build, and returns one
record per test.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "0.34.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/92/21/"
    "6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/vllm-0.34.0.tar.gz"
)
SDIST_SHA256 = "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / f"vllm-{VERSION}-tests"
KEEP = ("tests/__init__.py", "tests/v1/__init__.py", "tests/v1/kv_offload/")
TIERING = "tests/v1/kv_offload/tiering"


def tests_root() -> Path:
    """The directory holding vLLM's ``tests/`` package, fetched on first use."""
    done = CACHE / ".complete"
    if done.exists():
        return CACHE
    with tempfile.TemporaryDirectory() as scratch:
        tarball = Path(os.environ.get("KVCACHE_VLLM_SDIST") or Path(scratch) / "vllm.tar.gz")
        if "KVCACHE_VLLM_SDIST" not in os.environ:
            with (
                urllib.request.urlopen(SDIST_URL, timeout=120) as response,
                tarball.open("wb") as out,
            ):
                shutil.copyfileobj(response, out)
        digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise RuntimeError(f"{tarball}: SHA-256 {digest}, expected {SDIST_SHA256}")
        staging = Path(scratch) / "tree"
        prefix = f"vllm-{VERSION}/"
        with tarfile.open(tarball) as archive:
            members = [
                m
                for m in archive.getmembers()
                if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(KEEP)
            ]
            archive.extractall(staging, members=members, filter="data")
        shutil.rmtree(CACHE, ignore_errors=True)
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(staging / prefix, CACHE)
    done.touch()
    return CACHE


def run(root: Path, mode: str, selection: list[str], report: Path) -> dict[str, dict]:
    """Runs ``selection`` (paths or node ids under ``root``) on the side ``mode`` (see
    ``upstream_swap_plugin``); returns ``{node id: {"outcome", "built", "longrepr"}}``.

    The child uses none of this project's pytest settings (``-c`` names an empty file: vLLM's
    tests are not written for warnings as errors)."""
    ini = report.with_suffix(".ini")
    report.unlink(missing_ok=True)
    ini.write_text("[pytest]\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPO / "tests")])
    env["KVCACHE_UPSTREAM"] = mode
    env["KVCACHE_UPSTREAM_REPORT"] = str(report)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-c",
            str(ini),
            "--rootdir",
            str(root),
            "-p",
            "no:cacheprovider",
            "-p",
            "upstream_swap_plugin",
            *selection,
        ],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=900,
        check=False,
    )
    if not report.exists():
        raise RuntimeError(f"vLLM's tests wrote no report under mode {mode!r}")
    records: dict[str, dict] = {}
    for line in report.read_text().splitlines():
        record = json.loads(line)
        records[record["node"]] = record
    return records
