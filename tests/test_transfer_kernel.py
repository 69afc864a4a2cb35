"""The Triton copy kernel and the bench CLI, exercised on CPU.

The kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess because the
variable is read when kernels are defined), on descriptors produced by real plans over host
memory: this checks the kernel's indexing, the piece cutting and the descriptor format
byte for byte, everything except the GPU itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

KERNEL_CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from kvcache.transfer import HostChunkPool, TransferEngine, _kernel

    def run(plan, programs):
        n = plan.num_pieces(_kernel.PIECE_BYTES)
        desc = torch.empty(3 * n, dtype=torch.int64)
        plan.write_runs(desc.numpy(), _kernel.PIECE_BYTES)
        _kernel.launch(desc, n, programs=programs, max_run_bytes=plan.max_run_bytes)
        plan.release()
        return n

    rng = np.random.default_rng(11)
    page = 2048  # bytes per block per layer
    layers = [torch.from_numpy(rng.integers(0, 256, (96, page), dtype=np.uint8)) for _ in range(2)]
    bpc = 2
    with HostChunkPool(48, 2 * bpc * page, pin=False) as pool:
        engine = TransferEngine(layers, pool, blocks_per_chunk=bpc)
        host = pool.tensor()
        # Scattered store: one run per page.
        chunks = rng.permutation(48)[:10]
        blocks = rng.permutation(96)[:20]
        assert run(engine.plan(store=True, gpu_block_ids=blocks, chunk_ids=chunks), 3) == 40
        for j, c in enumerate(chunks):
            ids = torch.as_tensor(blocks[2 * j : 2 * j + 2])
            want = torch.cat([layer[ids].reshape(-1) for layer in layers])
            assert torch.equal(host[c], want), f"chunk {c}"
        # Contiguous single-layer load: runs longer than a piece are cut, then copied.
        one = [torch.zeros(96, 4 * page, dtype=torch.uint8)]
        with HostChunkPool(96, 4 * page, pin=False) as pool2:
            src = pool2.tensor()
            src.copy_(torch.from_numpy(rng.integers(0, 256, (96, 4 * page), dtype=np.uint8)))
            eng2 = TransferEngine(one, pool2)
            plan = eng2.plan(store=False, gpu_block_ids=range(10, 60), chunk_ids=range(30, 80))
            assert len(plan) == 1 and plan.num_pieces(_kernel.PIECE_BYTES) == 7
            run(plan, 4)
            assert torch.equal(one[0][10:60], src[30:80])
            assert not one[0][:10].any() and not one[0][60:].any()
            del src
        del host
    print("kernel ok")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_kernel_copies_plans_exactly_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "kernel ok" in done.stdout


def test_block_words_stay_within_bounds() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = (
        "from kvcache.transfer import _kernel as k\n"
        "assert [k.block_words(b) for b in (8, 1000, 4096, 8192, 1 << 20)] == "
        "[128, 128, 512, 1024, 1024]\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def test_bench_cli_runs_on_cpu_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvcache.transfer", "bench", "--device", "cpu", "--quick",
         "--json", str(out)],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["correctness"]
    assert all(c["ok"] for c in report["correctness"])
    assert {r["page_kib"] for r in report["rows"]} >= {4, 16, 64, 256}
    assert {r["pattern"] for r in report["rows"]} == {"scattered", "contiguous", "model"}
    assert report["descriptors"]["scattered"]["ns_per_page"] > 0
    assert "large single copy" in done.stdout


def test_bench_cli_refuses_cuda_without_a_gpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    done = subprocess.run(
        [sys.executable, "-m", "kvcache.transfer", "bench", "--json", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "CUDA is not available" in done.stdout
