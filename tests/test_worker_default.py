"""The spec's default worker follows the GPU evidence: kvcache's worker is the default only
while ``kvcache.vllm.WORKER_GPU_EVIDENCE`` names a committed ``gpu/check.py`` JSON that
ran on a GPU with every path passed (none skipped, none failed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import require_oracle

ROOT = Path(__file__).resolve().parent.parent


def evidence_problems(report: dict) -> list[str]:
    """Why a ``gpu/check.py`` report does not make kvcache's worker the default."""
    problems = []
    if report.get("device", {}).get("type") != "cuda":
        problems.append("it did not run on a CUDA device")
    paths = report.get("paths") or []
    if not paths:
        problems.append("it lists no paths")
    for p in paths:
        if p.get("status") != "passed":
            problems.append(f"path {p.get('name')!r}: {p.get('status')} ({p.get('why')})")
    if report.get("passed") is not True:
        problems.append("its verdict is not a pass")
    return problems


def test_the_default_worker_names_a_gpu_run_that_passed_every_path() -> None:
    require_oracle()
    import kvcache.vllm

    evidence = kvcache.vllm.WORKER_GPU_EVIDENCE
    if evidence is None:
        return  # vLLM's worker is the default (tests/test_worker_api.py checks the line)
    path = ROOT / evidence
    assert path.is_file(), f"WORKER_GPU_EVIDENCE names {evidence}, which is not committed"
    assert path.parent == ROOT / "docs" / "gpu", "GPU evidence lives under docs/gpu/"
    assert evidence_problems(json.loads(path.read_text())) == []


@pytest.mark.parametrize(
    ("report", "expected"),
    [
        ({"device": {"type": "cpu"}, "paths": [{"name": "a", "status": "passed"}]}, 2),
        ({"device": {"type": "cuda"}, "paths": [], "passed": True}, 1),
        (
            {
                "device": {"type": "cuda"},
                "paths": [{"name": "kernel load", "status": "skipped", "why": "no Triton"}],
                "passed": True,
            },
            1,
        ),
        ({"device": {"type": "cuda"}, "paths": [{"name": "a", "status": "passed"}]}, 1),
        (
            {
                "device": {"type": "cuda"},
                "paths": [{"name": "a", "status": "passed"}],
                "passed": True,
            },
            0,
        ),
    ],
)
def test_only_a_complete_gpu_pass_counts_as_evidence(report: dict, expected: int) -> None:
    assert len(evidence_problems(report)) == expected
