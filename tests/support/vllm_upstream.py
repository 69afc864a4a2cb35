"""vLLM's own KV-offloading tests (0.33.0 and 0.34.0), from its source releases on PyPI.

The wheels the suite tests against ship no tests; the source release of the same version does.
``tests_root(release)`` downloads it once (pinned by SHA-256), keeps only
``tests/v1/kv_offload/`` (and the two package markers above it) under ``.cache/`` in the
repository, and returns the directory to run pytest in. ``KVCACHE_VLLM_SDIST_0_34`` /
``KVCACHE_VLLM_SDIST_0_33`` name a local copy of the tarball instead (offline machines).
``run()`` runs a selection of those tests in a child pytest with ``upstream_swap_plugin``
choosing whose manager and primary tier they build, and returns one record per test.
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

# The source releases of the vLLM releases kvcache follows, by semantics name.
RELEASES = {
    "0.34": (
        "0.34.0",
        "https://files.pythonhosted.org/packages/92/21/"
        "6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/vllm-0.34.0.tar.gz",
        "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
    ),
    "0.33": (
        "0.33.0",
        "https://files.pythonhosted.org/packages/f7/25/"
        "aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz",
        "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    ),
}

REPO = Path(__file__).resolve().parents[2]
KEEP = ("tests/__init__.py", "tests/v1/__init__.py", "tests/v1/kv_offload/")
TIERING = "tests/v1/kv_offload/tiering"


def tests_root(release: str) -> Path:
    """The directory holding vLLM ``release``'s ``tests/`` package, fetched on first use."""
    version, url, sha256 = RELEASES[release]
    cache = REPO / ".cache" / f"vllm-{version}-tests"
    done = cache / ".complete"
    if done.exists():
        return cache
    local = os.environ.get(f"KVCACHE_VLLM_SDIST_{release.replace('.', '_')}")
    with tempfile.TemporaryDirectory() as scratch:
        tarball = Path(local or Path(scratch) / "vllm.tar.gz")
        if local is None:
            with (
                urllib.request.urlopen(url, timeout=120) as response,
                tarball.open("wb") as out,
            ):
                shutil.copyfileobj(response, out)
        digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
        if digest != sha256:
            raise RuntimeError(f"{tarball}: SHA-256 {digest}, expected {sha256}")
        staging = Path(scratch) / "tree"
        prefix = f"vllm-{version}/"
        with tarfile.open(tarball) as archive:
            members = [
                m
                for m in archive.getmembers()
                if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(KEEP)
            ]
            archive.extractall(staging, members=members, filter="data")
        shutil.rmtree(cache, ignore_errors=True)
        cache.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(staging / prefix, cache)
    done.touch()
    return cache


def run(
    root: Path, mode: str, selection: list[str], report: Path, *, timeout: float = 3600
) -> dict[str, dict]:
    """Runs ``selection`` (paths or node ids under ``root``) on the side ``mode`` (see
    ``upstream_swap_plugin``); returns ``{node id: {"outcome", "built", "longrepr"}}``.
    ``timeout`` only bounds a hang: on a busy two-core machine vLLM's suite has taken over 15
    minutes.

    The child uses none of this project's pytest settings (``-c`` names an empty file: vLLM's
    tests are not written for warnings as errors)."""
    ini = report.with_suffix(".ini")
    report.unlink(missing_ok=True)
    ini.write_text("[pytest]\n")
    env = dict(os.environ)
    # vLLM's test tree first (its package is also named ``tests``), then the plugin, then
    # whatever chose the vLLM release (the 0.33.0 pass puts that release first).
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPO / "tests" / "support"), *inherited])
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
        timeout=timeout,
        check=False,
    )
    if not report.exists():
        raise RuntimeError(f"vLLM's tests wrote no report under mode {mode!r}")
    records: dict[str, dict] = {}
    for line in report.read_text().splitlines():
        record = json.loads(line)
        records[record["node"]] = record
    return records
