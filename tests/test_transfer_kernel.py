"""The Triton copy kernel and the bench CLI, exercised on CPU.

The kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess because the
variable is read when kernels are defined), on block and tensor tables produced by real plans
over host memory (groups, a partial chunk, padded pages): this checks the kernel's address
arithmetic and the table formats byte for byte, everything except the GPU itself.
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

from tests import no_oracle

KERNEL_CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from kvcache.transfer import HostChunkPool, TransferEngine, _kernel

    def run(engine, plan):
        # What the CUDA backend does, with host tensors: per-group block table and tensor
        # table, one launch per group.
        layout = engine._layout
        for group, n in enumerate(plan.group_blocks):
            if n == 0:
                continue
            table = torch.empty(3 * n, dtype=torch.int64)
            plan.write_block_table(group, table.numpy())
            rows = layout.group_refs(group)
            refs = torch.tensor(rows, dtype=torch.int64).reshape(-1)
            _kernel.launch(table, refs, n, to_device=not plan.store, programs=3,
                           max_page_bytes=max(r[4] for r in rows))
        plan.release()

    rng = np.random.default_rng(11)
    page = 2048  # bytes per block per layer
    layers = [torch.from_numpy(rng.integers(0, 256, (96, page), dtype=np.uint8)) for _ in range(2)]
    bpc = 2
    with HostChunkPool(48, 2 * bpc * page, pin=False) as pool:
        engine = TransferEngine(layers, pool, blocks_per_chunk=bpc)
        host = pool.tensor()
        chunks = rng.permutation(48)[:10]
        blocks = rng.permutation(96)[:20]
        run(engine, engine.plan(store=True, gpu_block_ids=blocks, chunk_ids=chunks))
        for j, c in enumerate(chunks):
            ids = torch.as_tensor(blocks[2 * j : 2 * j + 2])
            want = torch.cat([layer[ids].reshape(-1) for layer in layers])
            assert torch.equal(host[c], want), f"chunk {c}"
        # Two groups, a partial first chunk, padded pages (only 1024 of 2048 bytes move).
        dst = [torch.zeros_like(t) for t in layers]
        eng2 = TransferEngine(dst, pool, blocks_per_chunk=bpc, groups=[[(0, 1024)], [(1, 2048)]])
        plan = eng2.plan(store=False, gpu_block_ids=[7, 8, 9, 40], chunk_ids=[int(chunks[0]),
                         int(chunks[1]), int(chunks[2])], group_sizes=[3, 1], block_indices=[1, 0])
        run(eng2, plan)
        # Group 0: blocks 7, 8, 9 from slot 1 of chunk 0, then slots 0-1 of chunk 1.
        src0 = [(chunks[0], 1), (chunks[1], 0), (chunks[1], 1)]
        for b, (c, slot) in zip([7, 8, 9], src0):
            want = host[c][slot * page : slot * page + 1024]
            assert torch.equal(dst[0][b][:1024], want), b
            assert not dst[0][b][1024:].any()
        want = host[chunks[2]][bpc * page : bpc * page + page]
        assert torch.equal(dst[1][40], want)
        assert dst[0].count_nonzero() == 3 * 1024 - (dst[0][[7, 8, 9], :1024] == 0).sum()
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
    no_oracle.needs("torch")  # the child process imports it
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
