"""bench/worker_submit_cost.py at toy sizes, so the submit-cost table in docs/benchmarks.md
keeps a script that runs: every row has both workers' figures and the in-round hand-off, and
the summary names the smallest ratios. No figure is compared with another (no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_oracle

pytestmark = pytest.mark.oracle

BENCH = Path(__file__).resolve().parent.parent / "bench"

TOY = """
import sys
sys.path.insert(0, {bench!r})
import worker_submit_cost as w
w.LAYERS, w.PAGES, w.JOB_BLOCKS = (2,), (8 * 1024,), (16, 32)
sys.exit(w.main(["--quick", "--json", {out!r}]))
"""


def test_submit_cost_bench_runs_at_toy_sizes(tmp_path: Path) -> None:
    require_oracle()
    out = tmp_path / "submit.json"
    done = subprocess.run(
        [sys.executable, "-c", TOY.format(bench=str(BENCH), out=str(out))],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    import vllm

    report = json.loads(out.read_text())
    assert report["vllm"] == vllm.__version__  # against the installed release's own worker
    rows = report["rows"]
    assert {(r["blocks"], r["ids"]) for r in rows} == {
        (b, ids) for b in (16, 32) for ids in ("fresh", "churned")
    }
    for r in rows:
        for key in ("submit", "total"):
            for side in ("vllm", "ours"):
                for direction in ("store", "load"):
                    assert r[f"{side}_{direction}_{key}_us"] > 0
        assert r["handoff_us"] > 0
        assert r["resolve_us"] >= 0  # the connector's pointer resolution (0.34.0)
        assert r["ceiling_store"] == r["vllm_store_submit_us"] / r["handoff_us"]
    assert f"vLLM {vllm.__version__}: the device side of a job is a" in done.stdout
    assert "smallest vLLM/ours ratio" in done.stdout
    assert "smallest vLLM store / hand-off alone" in done.stdout
