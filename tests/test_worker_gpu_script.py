"""gpu/worker_check.py, the GPU A/B of the two workers, as a CPU dry run: small sizes, CPU
tensors, vLLM's worker through tests/vllm_worker_oracle.py. It keeps the script runnable (and
its byte checks honest) on machines without a GPU; the bandwidth figures need the GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import require_oracle

pytestmark = pytest.mark.oracle

SCRIPT = Path(__file__).resolve().parent.parent / "gpu" / "worker_check.py"
RUN_SH = SCRIPT.parent / "run.sh"


@pytest.mark.parametrize("ab", [True, False], ids=["vllm-ab", "without-vllm"])
def test_gpu_script_dry_run_on_cpu(tmp_path: Path, ab: bool) -> None:
    require_oracle()
    out = tmp_path / "check.json"
    extra = [] if ab else ["--without-vllm"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["ab"] is ab
    assert {r["direction"] for r in rows} == {"store", "load"}
    assert {r["ids"] for r in rows} == {"fresh", "churned"}
    assert len({r["page_kib"] for r in rows}) >= 2
    assert all(r["check"] == "ok" for r in rows)
    assert all(("vllm_gbps" in r) is ab and "ours_gbps" in r for r in rows)
    assert len(report["startup"]) == len({r["page_kib"] for r in rows})
    assert report["complete"]
    assert all(r["ours_submit_process_us"] >= 0 for r in rows)
    # The method is the engine's record of what ran the job (the CPU copier here).
    assert {r["ours_method"] for r in rows} == {"cpu"}
    assert report["ab_problems"] == []
    assert report["exit_status"] == 0
    if ab:
        # vLLM's worker went through the script's one-rank barrier, the same patch that
        # lets it be built on a GPU, not only through the oracle's CPU fakes.
        assert all(s["vllm_barrier_calls"] == 1 for s in report["startup"])
    assert "submit CPU per job" in done.stdout
    assert "CPU dry run" in done.stdout


# Runs the script with vLLM's own barrier put back where the script puts its one-rank one:
# vLLM's worker then fails to build exactly as it did on a GPU before the patch (no world
# group in this process).
WITH_VLLMS_BARRIER = """
import contextlib
import importlib.util
import sys

from vllm.v1.kv_offload.cpu import spec

vllms_barrier = spec._all_workers_barrier
found = importlib.util.spec_from_file_location("gpu_worker_check", sys.argv[1])
script = importlib.util.module_from_spec(found)
found.loader.exec_module(script)


@contextlib.contextmanager
def vllms_own_barrier(calls):
    saved = spec._all_workers_barrier
    spec._all_workers_barrier = vllms_barrier
    try:
        yield
    finally:
        spec._all_workers_barrier = saved


script.one_rank_barrier = vllms_own_barrier
sys.exit(script.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("ab", [True, False], ids=["vllm-ab", "without-vllm"])
def test_a_vllm_worker_that_cannot_be_built_fails_the_ab(tmp_path: Path, ab: bool) -> None:
    """If vLLM's worker cannot be built (here: the world-group barrier a GPU run hit), the
    A/B is incomplete: the script still writes every row of kvcache's side, then exits with
    status 4 and the reason in its output and JSON. With --without-vllm nothing of vLLM's is
    built and the same run passes."""
    require_oracle()
    wrapper = tmp_path / "with_vllms_barrier.py"
    wrapper.write_text(WITH_VLLMS_BARRIER)
    out = tmp_path / "check.json"
    extra = [] if ab else ["--without-vllm"]
    done = subprocess.run(
        [sys.executable, str(wrapper), str(SCRIPT), "--device", "cpu", "--quick", "--json",
         str(out), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["complete"]
    assert report["rows"]
    assert all(r["check"] == "ok" for r in report["rows"])
    if not ab:
        assert done.returncode == 0, done.stdout + done.stderr
        assert report["ab_problems"] == []
        return
    assert done.returncode == 4, done.stdout + done.stderr
    assert report["exit_status"] == 4
    assert report["ab_problems"]
    assert all("world group is not initialized" in s["vllm_error"] for s in report["startup"])
    assert "A/B INCOMPLETE: vLLM's worker could not be built" in done.stdout
    assert "world group is not initialized" in done.stdout
    assert not any("vllm_gbps" in r for r in report["rows"])


def load_script() -> Any:
    import importlib.util

    found = importlib.util.spec_from_file_location("gpu_worker_check_under_test", SCRIPT)
    assert found is not None
    assert found.loader is not None
    script = importlib.util.module_from_spec(found)
    found.loader.exec_module(script)
    return script


def gpu_row(page_kib: int, descriptors: int, ours: float, vllm: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "page_kib": page_kib,
        "descriptors": descriptors,
        "ids": "fresh",
        "direction": "load",
        "ours_gbps": ours,
        "ours_pct_of_large_copy": ours / 50 * 100,
        "check": "ok",
    }
    if vllm is not None:
        row["vllm_gbps"] = vllm
    return row


def test_gpu_verdicts_say_their_scope_and_a_missing_one_fails_the_ab() -> None:
    """The verdicts as a GPU run computes them (no GPU needed): the large-copy target judges
    jobs of >= 1024 descriptors only and says how many rows it left out; a page size without
    vLLM's figures, or without a large job, leaves a verdict uncomputed, which is an A/B
    problem; so is a row skipped by the time budget."""
    script = load_script()
    KiB = 1024
    rows = [
        gpu_row(4, 16, 10.0, 9.0),
        gpu_row(4, 1024, 20.0, 25.0),
        gpu_row(64, 16, 5.0, 4.0),  # a 1 MiB job: not judged against the large copy
        gpu_row(64, 1024, 46.0, 40.0),
        gpu_row(64, 16384, 48.0, 41.0),
        gpu_row(32, 1024, 30.0, None),  # vLLM's worker was not built at 32 KiB
    ]
    judged = script.verdicts(rows, [4 * KiB, 32 * KiB, 64 * KiB], cuda=True, ab=True)
    by = {(v["page_kib"], v["target"]): v for v in judged}
    assert by[(4, "kvcache >= vLLM")]["passed"] is False
    assert "(1024, 'fresh', 'load')" in by[(4, "kvcache >= vLLM")]["text"]
    assert by[(64, "kvcache >= vLLM")]["passed"] is True
    large = by[(64, ">= 90 % of the large copy")]
    assert (large["passed"], large["rows"], large["rows_not_judged"]) == (True, 2, 1)
    assert large["scope"] == "jobs of >= 1024 page descriptors"
    assert "1 smaller, latency-bound rows not judged" in large["text"]
    assert by[(32, "kvcache >= vLLM")]["passed"] is None
    startups = [
        {"page_kib": 4, "vllm_pinned": True},
        {"page_kib": 32, "vllm_error": "RuntimeError: no room"},
        {"page_kib": 64, "vllm_pinned": False},
    ]
    check = SimpleNamespace(cuda=True, skipped=0)
    problems = script.ab_problems(check, rows, startups, judged)
    assert problems[0] == "vLLM's worker could not be built at 32 KiB: RuntimeError: no room"
    assert any(p.startswith("32 KiB, kvcache >= vLLM: not computed") for p in problems)
    assert "vLLM's host region is not pinned at 64 KiB" in problems[-1]
    assert len(problems) == 3
    # Without any 64 KiB job of >= 1024 descriptors the large-copy verdict is not computed.
    small = [r for r in rows if r["page_kib"] != 64 or r["descriptors"] < 1024]
    judged = script.verdicts(small, [64 * KiB], cuda=True, ab=True)
    (large,) = [v for v in judged if v["target"].startswith(">= 90")]
    assert large["passed"] is None
    ok = [{"page_kib": 64, "vllm_pinned": True}]
    assert script.ab_problems(check, small, ok, judged) == [
        "64 KiB, >= 90 % of the large copy: not computed, no row of >= 1024 page descriptors"
    ]
    check.skipped = 3
    assert "time budget reached: 3 row(s) skipped" in script.ab_problems(check, [], ok, [])[0]
    # kvcache's side alone: nothing to compare with, and no A/B to be incomplete.
    alone = script.verdicts(small, [64 * KiB], cuda=True, ab=False)
    assert [v["target"] for v in alone] == [">= 90 % of the large copy"]


def test_gpu_script_refuses_an_ab_it_cannot_run(tmp_path: Path) -> None:
    """Without vLLM the A/B cannot run: the script says why and exits non-zero, unless
    --without-vllm asks for kvcache's side alone."""
    import os

    blocker = tmp_path / "vllm"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('vLLM hidden for this test')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--json",
         str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert "vLLM hidden for this test" in done.stdout
    assert "--without-vllm" in done.stdout


def stand_in_wheel(dist: Path) -> Path:
    """A wheel named as ``make wheel`` names it, holding this checkout's package and its
    compiled extension (building the real one needs minutes of Rust). ``KVCACHE_WHEEL``
    replaces it with the real one."""
    import base64
    import hashlib
    import zipfile

    import kvcache

    package = Path(kvcache.__file__).resolve().parent
    path = dist / "kvcache_offload-0.0.0-py3-none-any.whl"
    info = "kvcache_offload-0.0.0.dist-info"
    files: dict[str, bytes] = {
        f"kvcache/{f.relative_to(package).as_posix()}": f.read_bytes()
        for f in sorted(package.rglob("*"))
        if f.is_file() and "__pycache__" not in f.parts
    }
    files[f"{info}/METADATA"] = b"Metadata-Version: 2.1\nName: kvcache-offload\nVersion: 0.0.0\n"
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def run_sh_from_wheel(
    tmp_path: Path, *args: str, command: Path = RUN_SH
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``gpu/run.sh`` (or ``command``, a script that forwards to it) as a GPU machine runs it:
    the wheel in ``dist/`` (the real one from ``KVCACHE_WHEEL``, else a stand-in), installed
    privately, ``OUT`` set; returns the run and the ``OUT`` folder."""
    import os
    import shutil

    dist = tmp_path / "dist"
    dist.mkdir()
    given = os.environ.get("KVCACHE_WHEEL")
    if given:
        shutil.copy(given, dist)
    else:
        stand_in_wheel(dist)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=sys.executable, OUT=str(out))
    done = subprocess.run(
        ["bash", str(command), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    return done, out


def test_gpu_run_sh_dry_run_on_cpu(tmp_path: Path) -> None:
    """gpu/run.sh as the GPU machine runs it (default wheel glob in dist/, private install,
    worker mode), here as the CPU dry run."""
    require_oracle()
    done, out = run_sh_from_wheel(tmp_path, "worker", "--device", "cpu", "--quick")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu_worker_check.json").read_text())
    assert report["rows"]
    assert all(r["check"] == "ok" for r in report["rows"])
    assert report["complete"]
    # The wheel's private install ran, not this checkout's python/ directory.
    repo = SCRIPT.parent.parent
    assert not report["kvcache_path"].startswith(str(repo))
    assert report["kvcache_path"].endswith("/kvcache")
