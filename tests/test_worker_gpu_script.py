"""bench/gpu_worker_check.py, the GPU A/B of the two workers, as a CPU dry run: small sizes, CPU
tensors, vLLM's worker through tests/vllm_worker_oracle.py. It keeps the script runnable (and
its byte checks honest) on machines without a GPU; the bandwidth figures need the GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_oracle

pytestmark = pytest.mark.oracle

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_worker_check.py"


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
    assert "CPU dry run" in done.stdout
