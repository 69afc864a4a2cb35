"""kvcache's vLLM worker with its copies through the Triton copy kernel, against vLLM's worker.

The conformance sequences of tests/worker/test_worker_conformance.py (the hand-picked corners and a
few random geometries, fixed seeds) with our worker's jobs on the CUDA backend's kernel path:
``copy="kernel"`` (every store and load through the kernel) and ``copy="auto"`` with cut-offs
that send small loads to the kernel and the rest to the fake DMA; also the order of jobs of one
queue that different methods run. The kernel runs under Triton's interpreter on the CPU
tensors and the host pool, so its address arithmetic and tables are checked byte for byte
against vLLM's worker. The cases live in tests/support/worker_kernel_cases.py and run in a child
pytest, because ``TRITON_INTERPRET=1`` must be set before Triton defines its kernels.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.oracle import require_oracle

pytestmark = pytest.mark.oracle

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "support" / "worker_kernel_cases.py"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_worker_through_the_copy_kernel_matches_vllms_worker_under_the_interpreter() -> None:
    require_oracle()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,  # a hang must not stall the suite
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # Every case ran (none skipped or deselected) and nothing warned (warnings are errors in
    # the child too, but a warning pytest only records would show in its summary).
    summary = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed in [\d.]+s( \(\S+\))?", summary), output
