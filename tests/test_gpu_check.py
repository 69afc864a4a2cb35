"""``gpu/check.py``, the one GPU command, in the modes that need no GPU: ``--device cpu``
(the Rust CPU copier, the worker contracts) and ``--device fake`` (the CUDA backend on the fake
CUDA runtime of tests/fakecuda). Every path must be listed, run or skipped with why; nothing may
fail; and a corrupted copy must make the run fail (the byte checks can fail)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import no_oracle

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "gpu" / "check.py"
PATHS = {
    "dma-batched", "dma-per-run", "expedited", "kernel-load", "kernel-store", "pinning",
    "ordering", "two-groups", "odd-chunks", "three-queues", "self-check", "worker-0.33",
    "worker-0.34", "bandwidth",
}  # fmt: skip
# What each mode cannot run, and must say so.
SKIPPED = {
    "cpu": {"dma-batched", "dma-per-run", "kernel-load", "kernel-store", "pinning", "ordering",
            "bandwidth"},
    "fake": {"self-check", "bandwidth"},
}  # fmt: skip


def run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done, json.loads(out.read_text())


@pytest.mark.parametrize("device", ["cpu", "fake"])
def test_every_path_runs_or_says_why_not(tmp_path: Path, device: str) -> None:
    no_oracle.needs("torch")  # the child process imports it
    done, report = run(tmp_path, "--device", device)
    assert done.returncode == 0, done.stdout + done.stderr
    paths = {p["name"]: p for p in report["paths"]}
    assert set(paths) == PATHS
    skipped = {n for n, p in paths.items() if p["status"] == "skipped"}
    assert skipped == SKIPPED[device]
    assert all(paths[n]["why"] for n in skipped)
    ran = [p for p in paths.values() if p["status"] == "passed"]
    assert all(p["checked_bytes"] > 0 for p in ran if p["name"] != "self-check")
    assert report["device"]["type"] == device
    assert report["passed"] is False  # skipped paths: never evidence for the default
    assert "vLLM's own worker is not run" in done.stdout
    if device == "fake":
        # The engine's record of what ran: the batched driver call, per run, the kernel.
        assert paths["dma-batched"]["methods"]["dma-batched"] == 2
        assert paths["dma-per-run"]["methods"]["dma-per-run"] == 2
        assert paths["kernel-store"]["methods"]["kernel"] == 2
        assert paths["odd-chunks"]["methods"]["kernel"] == 0


def test_a_wrong_byte_fails_the_run(tmp_path: Path) -> None:
    no_oracle.needs("torch")  # the child process imports it
    done, report = run(tmp_path, "--device", "fake", "--corrupt")
    assert done.returncode == 1
    failed = {p["name"] for p in report["paths"] if p["status"] == "failed"}
    assert {"dma-batched", "dma-per-run", "expedited"} <= failed
    assert "wrong bytes" in next(p["why"] for p in report["paths"] if p["name"] == "dma-batched")


def test_the_gpu_command_runs_from_the_carried_wheel(tmp_path: Path) -> None:
    no_oracle.needs("torch")  # the child process imports it
    """``bench/gpu_transfer_check.sh``, the command operators' runbooks name, as the GPU
    machine runs it: it forwards to ``gpu/run.sh``, which installs the wheel from dist/
    privately and runs the default mode (this check); here on the CPU."""
    from tests.test_worker_gpu_script import run_sh_from_wheel

    shim = REPO / "bench" / "gpu_transfer_check.sh"
    done, out = run_sh_from_wheel(tmp_path, "--device", "cpu", command=shim)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert {p["name"] for p in report["paths"]} == PATHS
    assert not report["kvcache_path"].startswith(str(REPO))
