"""The GPU check of kvcache's data path: every copy path, every byte, one table, one JSON.

Run on a CUDA machine with torch and Triton (no vLLM, no Rust needed: an installed abi3 wheel
of kvcache is enough; ``gpu/run.sh`` installs one privately and runs this, see
``gpu/README.md``)::

    python gpu/check.py [--json PATH] [--budget-s 240]

Paths, each checked byte for byte against torch indexing of the source:

- ``dma-batched``: a store and a load by DMA through the driver's ``cuMemcpyBatchAsync``; the
  engine's record of what ran (``jobs_by_method``) must say the batched call ran both jobs;
- ``dma-per-run``: the same with one ``cudaMemcpyAsync`` per run;
- ``expedited``: a load on the expedited queue;
- ``kernel-load``, ``kernel-store``: small pages through the Triton copy kernel;
- ``pinning``: copies submitted while the pool is still being pinned in the background, then
  after it has finished;
- ``ordering``: a store of a block the compute stream is still writing (a sleep kernel, then
  the write): the store must see the written bytes;
- ``two-groups``: two KV groups sharing a tensor, one padded, entering their first chunk
  part-way; ``odd-chunks``: 3 blocks per chunk and a chunk size that is not a multiple of 8
  (the kernel must refuse it, DMA must move it);
- ``three-queues``: a store, a load and an expedited load in flight together;
- ``worker-0.33``, ``worker-0.34``: kvcache's vLLM worker under each release's contract
  (block ids; device pointers), through the project's stand-ins for vLLM's types
  (``gpu/vllm_standins.py``), each in a child process;
- ``self-check``: the worker's start-up self-check on this device;
- ``bandwidth``: each page size (4-128 KiB) stored and loaded next to one large copy in each
  direction, the machine's limit. vLLM's own worker cannot run here (its compiled ops need the
  torch it was built for), so the figures are compared with the large copy, not with vLLM.

``--device cpu`` runs what needs no GPU (the Rust CPU copier, the worker contracts) and marks
the rest skipped with why; ``--device fake`` runs the CUDA backend on the fake CUDA runtime of
``tests/fakecuda`` (DMA, kernel model, pinning, ordering), bandwidth skipped. Both exit 0 when
nothing failed; ``make test`` runs them. Exit status: 0 every path run passed, 1 a path
failed, 2 ``--device cuda`` without CUDA.

This file is the command (options, the run, the table, the JSON); its parts sit beside it and
are imported as siblings, so run it by its path: ``check_devices.py`` (CUDA, the fake, the
CPU), ``check_paths.py`` (the copy paths), ``check_worker.py`` (the worker contracts),
``check_bandwidth.py``, ``check_results.py`` (a path's row, skip and failure).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from check_bandwidth import bandwidth
from check_devices import FakeDevice, make_device, version
from check_paths import PATHS
from check_results import Row, Skip, out
from check_worker import path_worker, worker_child
from kvcache.transfer._timing import Budget

NOTE = (
    "vLLM's own worker is not run: its compiled ops need the torch it was built for, so the "
    "bandwidth is compared with one large copy in each direction (the machine's limit)."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu", "fake"], default="cuda")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--worker-contract", choices=["0.33", "0.34"], help=argparse.SUPPRESS)
    # A negative control for the test suite: on the fake, every DMA job's first copy flips a
    # byte, which the byte checks must catch.
    parser.add_argument("--corrupt", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_contract:
        return worker_child(args.device, args.worker_contract)
    budget = Budget(args.budget_s)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            out("no CUDA device: run with --device cpu or --device fake")
            return 2
    device = make_device(args.device)
    if args.corrupt:
        if not isinstance(device, FakeDevice):
            parser.error("--corrupt needs --device fake")
        device.corrupt = True
    out(f"kvcache GPU check on {args.device}: {NOTE}")
    rows: list[Row] = []
    for name, fn in PATHS:
        rows.append(run_path(name, lambda row, fn=fn: fn(device, row)))
    for contract in ("0.33", "0.34"):
        rows.append(
            run_path(
                f"worker-{contract}", lambda row, c=contract: path_worker(device, row, c, args)
            )
        )
    bw_row = Row("bandwidth")
    bw: list[dict[str, Any]] = []
    if args.device != "cuda":
        bw_row.status, bw_row.why = "skipped", "needs a GPU (--device cuda)"
    else:
        t0 = time.perf_counter()
        try:
            bw = bandwidth(device, budget)
            skipped = [r["page_kib"] for r in bw if "skipped" in r]
            if skipped:
                bw_row.status, bw_row.why = "failed", f"time budget: {skipped} KiB not measured"
        except Exception as exc:
            bw_row.status, bw_row.why = "failed", f"{type(exc).__name__}: {exc}"
        bw_row.seconds = time.perf_counter() - t0
    rows.append(bw_row)
    print_table(rows, bw)
    passed = all(r.status != "failed" for r in rows)
    report = {
        "device": device.info(),
        "kvcache": version("kvcache-offload"),
        "kvcache_path": str(Path(sys.modules["kvcache"].__file__ or "").parent),
        "note": NOTE,
        "paths": [r.as_dict() for r in rows],
        "bandwidth": bw,
        "passed": passed and all(r.status == "passed" for r in rows),
        "seconds": round(budget.elapsed(), 1),
    }
    target = args.json or Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=1) + "\n")
    out(f"JSON: {target}")
    return 0 if passed else 1


def run_path(name: str, fn: Callable[[Row], None]) -> Row:
    row = Row(name)
    t0 = time.perf_counter()
    try:
        fn(row)
    except Skip as why:
        row.status, row.why = "skipped", str(why)
    except Exception as exc:
        row.status = "failed"
        row.why = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    row.seconds = time.perf_counter() - t0
    return row


def print_table(rows: list[Row], bw: list[dict[str, Any]]) -> None:
    out(f"{'path':<14} {'status':<8} {'bytes checked':>14} {'s':>6}  methods / why")
    for r in rows:
        detail = (
            r.why
            if r.status != "passed"
            else ", ".join(f"{k}={v}" for k, v in r.methods.items() if v)
        )
        out(f"{r.name:<14} {r.status:<8} {r.checked_bytes:>14,} {r.seconds:>6.2f}  {detail}")
    if bw:
        out()
        head = ("page", "store GB/s", "% large", "load GB/s", "% large")
        out("{:>8} {:>11} {:>8} {:>10} {:>8}  methods".format(*head))
        for b in bw:
            if "skipped" in b:
                out(f"{b['page_kib']:>6}KiB  skipped ({b['skipped']})")
            elif b["page_kib"] is None:
                out(f"{'large':>8} {b['store_gbps']:>11.1f} {'':>8} {b['load_gbps']:>10.1f}")
            else:
                store = f"{b['store_gbps']:>11.1f} {b['store_pct_of_large']:>7.0f}%"
                load = f"{b['load_gbps']:>10.1f} {b['load_pct_of_large']:>7.0f}%"
                out(f"{b['page_kib']:>6}KiB {store} {load}  {b['methods']}")


if __name__ == "__main__":
    sys.exit(main())
