"""``kvcache transfer bench``: correctness round trips, then a bandwidth sweep.

On a CUDA machine (the default ``--device cuda``): byte-exact store/load round trips for
several dtypes, layer counts and ``blocks_per_chunk`` through every copy method and both pool
kinds; the CPU cost of building descriptors; the bandwidth of one large copy in each direction
(the reference); and a sweep over page sizes (4-256 KiB), scattered and contiguous ids, both
directions, pinned and pageable pools, kernel and DMA. Prints a table, and writes the report as
JSON with ``--json FILE``. Sized to finish well under 3 minutes on an H200; a time budget
(``--budget-s``) skips the remaining rows if a machine is slower.

``--device cpu`` runs the same steps on the CPU path (Rust worker copies), as a smoke test of
the script itself on machines without a GPU.

Everything up to the run (``--help``, bad options, an unwritable ``--json`` path) works without
torch; a missing torch is then one line on stderr and exit status 2, like every other error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from kvcache._argparse import OneLineParser as _Parser
from kvcache.transfer._checks import as_ids
from kvcache.transfer._engine import TransferEngine

if TYPE_CHECKING:
    from kvcache.transfer._jobs import CopyMode
from kvcache.transfer._pool import HostChunkPool
from kvcache.transfer._timing import Budget, device_sync, gb_per_s, repeat, time_job

KiB = 1024
MiB = 1024 * KiB
PAGE_SIZES = [4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB, 256 * KiB]


def _job(eng: TransferEngine, direction: str, g: np.ndarray, c: np.ndarray) -> Callable[[], int]:
    """A zero-argument submitter for ``timed`` (binds its arguments now, not at call time)."""
    if direction == "store":
        return lambda: eng.store(g, c)
    return lambda: eng.load(c, g)


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _row(
    page: int,
    pattern: str,
    direction: str,
    pool: str,
    method: str,
    runs: int,
    gbps: float,
    reference_gbps: float,
) -> dict[str, Any]:
    """One bandwidth row, relative to the same run's large single copy."""
    return {
        "page_kib": page // KiB,
        "pattern": pattern,
        "direction": direction,
        "pool": pool,
        "method": method,
        "runs": runs,
        "gbps": gbps,
        "pct_of_large_copy": 100 * gbps / reference_gbps,
    }


class Bench:
    """Holds the run's settings, clock and results."""

    def __init__(self, *, device: str, quick: bool, budget_s: float) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.quick = quick
        self.budget = Budget(budget_s)
        self.sync = device_sync(torch, self.device)
        self.rng = np.random.default_rng(1234)
        self.job_bytes = (4 if quick else 64) * MiB
        self.reps = 1 if quick else 3
        self.skipped = 0
        self.can_pin = False
        if self.cuda:  # measure pageable alone rather than die if this machine cannot pin
            with HostChunkPool(1, 1 * MiB, pin="auto") as probe:
                self.can_pin = probe.pinned and probe.device_can_use_host_pointer
            if not self.can_pin:
                _out("WARNING: host memory could not be pinned; only pageable pools measured")

    def elapsed(self) -> float:
        return self.budget.elapsed()

    def over_budget(self) -> bool:
        return self.budget.over()

    def pool_kinds(self) -> list[str]:
        return ["pinned", "pageable"] if self.can_pin else ["pageable"]

    def methods(self, pool_kind: str) -> list[str]:
        if not self.cuda:
            return ["cpu"]
        return ["kernel", "dma"] if pool_kind == "pinned" else ["dma"]

    def make_pool(self, num_chunks: int, chunk_bytes: int, kind: str) -> HostChunkPool:
        pool = HostChunkPool(num_chunks, chunk_bytes, pin=kind == "pinned")
        if kind == "pinned" and not pool.pinned:
            raise RuntimeError("pinning failed")
        return pool

    def engine(self, layers: list[Any], pool: HostChunkPool, method: str, **kw: Any) -> Any:
        copy = "auto" if method in ("cpu", "auto") else method
        return TransferEngine(layers, pool, copy=cast("CopyMode", copy), **kw)

    def timed(self, fn: Callable[[], int], engine: Any) -> tuple[float, float, bool]:
        """Median wall seconds of submit+completion, median submit seconds, all succeeded."""
        walls: list[float] = []
        submits: list[float] = []
        ok = True
        for rep in range(self.reps + 1):
            job = time_job(fn, lambda j: engine.wait([j]), sync=self.sync)
            ok &= all(success for _, success in engine.poll())
            if rep:  # the first run warms up (kernel compilation, page faults)
                walls.append(job.wall_s)
                submits.append(job.submit_s)
        return statistics.median(walls), statistics.median(submits), ok

    # --- correctness ----------------------------------------------------------------------

    def correctness(self) -> list[dict[str, Any]]:
        torch = self.torch
        results = []
        dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.int8]
        shapes = [(2, 8, 16), (3, 5)]  # 8-byte aligned pages, and odd 15-element pages
        for dtype in dtypes:
            for num_layers in (1, 3):
                for bpc in (1, 4):
                    for page_shape in shapes:
                        for kind in self.pool_kinds():
                            methods = ["auto", *self.methods(kind)] if self.cuda else ["cpu"]
                            for method in methods:
                                ok, why = self._round_trip(
                                    dtype, num_layers, bpc, page_shape, kind, method
                                )
                                results.append(
                                    {
                                        "dtype": str(dtype).removeprefix("torch."),
                                        "layers": num_layers,
                                        "blocks_per_chunk": bpc,
                                        "page_shape": list(page_shape),
                                        "pool": kind,
                                        "method": method,
                                        "ok": ok,
                                        "error": why,
                                    }
                                )
        return results

    def _random_layers(
        self, dtype: Any, n: int, num_layers: int, page_shape: tuple[int, ...]
    ) -> list[Any]:
        torch = self.torch
        gen = torch.Generator().manual_seed(int(self.rng.integers(1 << 31)))
        out = []
        for _ in range(num_layers):
            raw = torch.randint(
                0, 256, (n, *page_shape, dtype.itemsize), dtype=torch.uint8, generator=gen
            )
            out.append(raw.view(dtype).reshape(n, *page_shape).to(self.device))
        return out

    def _round_trip(
        self,
        dtype: Any,
        num_layers: int,
        bpc: int,
        page_shape: tuple[int, ...],
        kind: str,
        method: str,
    ) -> tuple[bool, str]:
        torch = self.torch
        n_blocks, n_chunks, job_chunks = 64, 24, 6
        src = self._random_layers(dtype, n_blocks, num_layers, page_shape)
        page = int(np.prod(page_shape)) * dtype.itemsize
        chunk_bytes = bpc * num_layers * page
        try:
            with self.make_pool(n_chunks, chunk_bytes, kind) as pool:
                chunks = self.rng.permutation(n_chunks)[:job_chunks]
                blocks = self.rng.permutation(n_blocks)[: job_chunks * bpc]
                eng = self.engine(src, pool, method, blocks_per_chunk=bpc)
                eng.wait([eng.store(blocks, chunks)])
                stored = eng.poll()
                # The pool must hold the layer-major chunk layout, byte for byte.
                host = pool.tensor()
                cpu = [t.cpu().view(torch.uint8).reshape(n_blocks, page) for t in src]
                for j, c in enumerate(chunks):
                    ids = torch.as_tensor(blocks[j * bpc : (j + 1) * bpc])
                    want = torch.cat([layer[ids].reshape(-1) for layer in cpu])
                    if not torch.equal(host[int(c)], want):
                        return False, f"chunk {c} differs after store"
                del host
                dst = [torch.zeros_like(t) for t in src]
                eng2 = self.engine(dst, pool, method, blocks_per_chunk=bpc)
                targets = self.rng.permutation(n_blocks)[: job_chunks * bpc]
                eng2.wait([eng2.load(chunks, targets)])
                loaded = eng2.poll()
                if not all(ok for _, ok in stored + loaded):
                    return False, "a job reported failure"
                untouched = np.setdiff1d(np.arange(n_blocks), targets)
                for s, d in zip(src, dst, strict=True):
                    s8 = s.view(torch.uint8).reshape(n_blocks, page).cpu()
                    d8 = d.view(torch.uint8).reshape(n_blocks, page).cpu()
                    if not torch.equal(d8[torch.as_tensor(targets)], s8[torch.as_tensor(blocks)]):
                        return False, "loaded blocks differ"
                    if d8[torch.as_tensor(untouched)].any():
                        return False, "a load touched blocks it was not asked to"
                eng.close()
                eng2.close()
        except Exception as exc:  # report and continue: the table is still useful
            return False, f"{type(exc).__name__}: {exc}"
        return True, ""

    # --- descriptor building --------------------------------------------------------------

    def descriptor_cost(self) -> dict[str, Any]:
        """CPU ns per page descriptor: id conversion + validation + coalescing, in Rust."""
        from kvcache import _core

        layers, bpc, page, n_blocks = 32, 16, 64, 1 << 16
        n_chunks = 4096
        pool = HostChunkPool(n_chunks, layers * bpc * page, pin=False)
        specs = [
            ((1 << 40) + i * (n_blocks * page), page, page, n_blocks, i) for i in range(layers)
        ]
        layout = _core.TransferLayout(pool, specs, bpc)
        job_chunks = 64 if self.quick else 512
        out: dict[str, Any] = {"layers": layers, "blocks_per_chunk": bpc, "chunks": job_chunks}
        for pattern in ("scattered", "contiguous"):
            chunks = self.rng.permutation(n_chunks)[:job_chunks].tolist()
            if pattern == "scattered":
                blocks = self.rng.permutation(n_blocks)[: job_chunks * bpc].tolist()
            else:
                start = int(self.rng.integers(n_blocks - job_chunks * bpc))
                blocks = list(range(start, start + job_chunks * bpc))
            best = float("inf")
            best_check = float("inf")
            runs = 0
            for _ in range(5):
                t0 = time.perf_counter_ns()
                plan = layout.plan(True, as_ids("g", blocks), as_ids("c", chunks))
                t1 = time.perf_counter_ns()
                runs = len(plan)  # builds the runs (validation happened in plan())
                best = min(best, time.perf_counter_ns() - t0)
                best_check = min(best_check, t1 - t0)
                pages = plan.num_pages
                plan.release()
                del plan
            out[pattern] = {
                "pages": pages,
                "runs": runs,
                "ns_per_page": best / pages,
                "validate_ns_per_page": best_check / pages,
            }
        pool.close()
        return out

    # --- bandwidth ------------------------------------------------------------------------

    def baseline(self) -> dict[str, Any]:
        """One large copy each way between a pool and a device buffer (the reference)."""
        torch = self.torch
        nbytes = (16 if self.quick else 256) * MiB
        out: dict[str, Any] = {"bytes": nbytes}
        for kind in self.pool_kinds():
            with self.make_pool(1, nbytes, kind) as pool:
                host = pool.tensor().view(-1)
                host.fill_(1)
                dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                for direction, (dst, src) in (("store", (host, dev)), ("load", (dev, host))):

                    def copy(dst: Any = dst, src: Any = src) -> None:
                        if self.cuda:
                            dst.copy_(src, non_blocking=True)
                        else:  # numpy: a plain memcpy, like the Rust worker (torch's is slower)
                            np.copyto(dst.numpy(), src.numpy())

                    times = repeat(copy, self.reps + 1, warmup=1, sync=self.sync)
                    out[f"{kind}_{direction}_gbps"] = gb_per_s(nbytes, statistics.median(times))
                del host, dev
        return out

    def sweep(self, baseline: dict[str, Any]) -> list[dict[str, Any]]:
        torch = self.torch
        rows: list[dict[str, Any]] = []
        for page in PAGE_SIZES:
            n = self.job_bytes // page
            total = 2 * n  # blocks (and chunks): jobs use half, so ids can scatter
            layer = torch.randint(0, 255, (total, page), dtype=torch.uint8, device=self.device)
            for kind in self.pool_kinds():
                if self.over_budget():
                    self.skipped += 1
                    continue
                with self.make_pool(total, page, kind) as pool:
                    for method in self.methods(kind):
                        eng = self.engine([layer], pool, method)
                        for pattern in ("scattered", "contiguous"):
                            if pattern == "scattered":
                                g = self.rng.permutation(total)[:n]
                                c = self.rng.permutation(total)[:n]
                            else:
                                g = np.arange(n) + int(self.rng.integers(n))
                                c = np.arange(n) + int(self.rng.integers(n))
                            for direction in ("store", "load"):
                                if self.over_budget():
                                    self.skipped += 1
                                    continue
                                fn = _job(eng, direction, g, c)
                                runs = len(
                                    eng.plan(
                                        store=direction == "store", gpu_block_ids=g, chunk_ids=c
                                    )
                                )
                                wall, submit, ok = self.timed(fn, eng)
                                gbps = gb_per_s(self.job_bytes, wall)
                                ref = baseline.get(f"pinned_{direction}_gbps") or baseline.get(
                                    f"pageable_{direction}_gbps"
                                )
                                rows.append(
                                    # baseline() measured every pool kind, so ref is a figure.
                                    _row(page, pattern, direction, kind, method, runs, gbps, ref)  # type: ignore[arg-type]
                                    | {"submit_us": submit * 1e6, "ok": ok}
                                )
                        eng.close()
            del layer
        rows.extend(self.model_like(baseline))
        return rows

    def model_like(self, baseline: dict[str, Any]) -> list[dict[str, Any]]:
        """8 layers, 16 KiB pages, 16 blocks per chunk, each chunk's blocks consecutive on the
        device (as a prefix-cache store would see): per-layer segments coalesce to 256 KiB."""
        torch = self.torch
        layers_n, page, bpc = 8, 16 * KiB, 16
        chunk_bytes = layers_n * bpc * page
        n = max(1, self.job_bytes // chunk_bytes)
        total_chunks = 2 * n
        layers = [
            torch.randint(0, 255, (total_chunks * bpc, page), dtype=torch.uint8, device=self.device)
            for _ in range(layers_n)
        ]
        rows: list[dict[str, Any]] = []
        kind = self.pool_kinds()[0]
        with self.make_pool(total_chunks, chunk_bytes, kind) as pool:
            starts = self.rng.permutation(total_chunks)[:n] * bpc
            g = (starts[:, None] + np.arange(bpc)[None, :]).reshape(-1)
            c = self.rng.permutation(total_chunks)[:n]
            for method in ["auto", *self.methods(kind)] if self.cuda else ["cpu"]:
                eng = self.engine(layers, pool, method, blocks_per_chunk=bpc)
                for direction in ("store", "load"):
                    if self.over_budget():
                        self.skipped += 1
                        continue
                    runs = len(eng.plan(store=direction == "store", gpu_block_ids=g, chunk_ids=c))
                    wall, submit, ok = self.timed(_job(eng, direction, g, c), eng)
                    gbps = gb_per_s(n * chunk_bytes, wall)
                    ref = baseline[f"{kind}_{direction}_gbps"]
                    rows.append(
                        _row(page, "model", direction, kind, method, runs, gbps, ref)
                        | {"submit_us": submit * 1e6, "ok": ok}
                    )
                eng.close()
        return rows

    def kernel_programs(self, baseline: dict[str, Any]) -> list[dict[str, Any]]:
        """Kernel bandwidth at scattered 16 KiB pages versus the number of programs."""
        if not self.can_pin:
            return []
        torch = self.torch
        page = 16 * KiB
        n = self.job_bytes // page
        layer = torch.randint(0, 255, (2 * n, page), dtype=torch.uint8, device=self.device)
        rows = []
        with self.make_pool(2 * n, page, "pinned") as pool:
            g = self.rng.permutation(2 * n)[:n]
            c = self.rng.permutation(2 * n)[:n]
            for programs in (8, 16, 32, 64, 128):
                if self.over_budget():
                    self.skipped += 1
                    continue
                eng = TransferEngine([layer], pool, copy="kernel", kernel_programs=programs)
                for direction in ("store", "load"):
                    fn = _job(eng, direction, g, c)
                    wall, _, ok = self.timed(fn, eng)
                    gbps = gb_per_s(self.job_bytes, wall)
                    rows.append(
                        {
                            "programs": programs,
                            "direction": direction,
                            "gbps": gbps,
                            "pct_of_large_copy": 100 * gbps / baseline[f"pinned_{direction}_gbps"],
                            "ok": ok,
                        }
                    )
                eng.close()
        return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Best method per scattered page size (pinned pool when there is one), checked against
    the bandwidth goals, and the page size from which DMA beats the kernel."""
    pool = "pinned" if any(r["pool"] == "pinned" for r in rows) else "pageable"
    scattered = [r for r in rows if r["pattern"] == "scattered" and r["pool"] == pool]
    best: dict[tuple[str, int], dict[str, Any]] = {}
    gbps: dict[tuple[str, int, str], float] = {}
    for r in scattered:
        key = (r["direction"], r["page_kib"])
        if key not in best or r["gbps"] > best[key]["gbps"]:
            best[key] = r
        gbps[(r["direction"], r["page_kib"], r["method"])] = r["gbps"]
    targets = []
    for (direction, kib), r in sorted(best.items()):
        goal = 90.0 if kib >= 64 else 75.0 if kib == 16 else None
        if goal is not None:
            targets.append(
                {
                    "direction": direction,
                    "page_kib": kib,
                    "best_method": r["method"],
                    "pct": r["pct_of_large_copy"],
                    "goal_pct": goal,
                    "met": r["pct_of_large_copy"] >= goal,
                }
            )
    crossover = {}
    for direction in ("store", "load"):
        compared = sorted(
            kib
            for (d, kib, method) in gbps
            if d == direction and method == "kernel" and (d, kib, "dma") in gbps
        )
        dma_wins = [
            kib
            for kib in compared
            if gbps[(direction, kib, "dma")] >= gbps[(direction, kib, "kernel")]
        ]
        crossover[direction] = {
            "compared_kib": compared,
            "dma_wins_from_kib": min(dma_wins) if dma_wins else None,
        }
    return {"pool": pool, "targets": targets, "crossover": crossover}


def crossover_line(c: dict[str, Any]) -> str | None:
    """Where DMA catches up with the kernel, in words; None when both were not measured."""
    sizes = c.get("compared_kib") or []
    if not sizes:
        return None
    tried = f"{sizes[0]}-{sizes[-1]} KiB" if len(sizes) > 1 else f"{sizes[0]} KiB"
    wins = c["dma_wins_from_kib"]
    if wins is None:
        return f"the kernel beats DMA at every page size tried ({tried})"
    if wins == sizes[0]:
        return f"DMA is at least as fast as the kernel at every page size tried ({tried})"
    return f"DMA is at least as fast as the kernel from {wins} KiB pages (tried {tried})"


def print_report(report: dict[str, Any]) -> None:
    _out(f"device: {report['device']}  torch {report['torch']}  {report['elapsed_s']:.1f} s")
    checks = report["correctness"]
    bad = [c for c in checks if not c["ok"]]
    _out(f"correctness: {len(checks) - len(bad)}/{len(checks)} round trips byte-exact")
    for c in bad:
        _out(f"  FAIL {c}")
    d = report["descriptors"]
    for pattern in ("scattered", "contiguous"):
        x = d[pattern]
        _out(
            f"descriptors ({pattern}): {x['ns_per_page']:.1f} ns/page "
            f"(validation {x['validate_ns_per_page']:.1f}), {x['pages']} pages -> {x['runs']} runs"
        )
    b = report["baseline"]
    _out(
        "large single copy (GB/s): "
        + ", ".join(
            f"{k.removesuffix('_gbps')} {v:.1f}" for k, v in b.items() if k.endswith("_gbps")
        )
    )
    _out()
    _out(
        f"{'page':>6} {'ids':<10} {'dir':<5} {'pool':<8} {'method':<6} {'runs':>7} "
        f"{'GB/s':>7} {'%large':>7} {'submit us':>10}"
    )
    for r in report["rows"]:
        _out(
            f"{r['page_kib']:>4}Ki {r['pattern']:<10} {r['direction']:<5} {r['pool']:<8} "
            f"{r['method']:<6} {r['runs']:>7} {r['gbps']:>7.1f} "
            f"{r['pct_of_large_copy']:>6.0f}% {r['submit_us']:>10.0f}"
            + ("" if r["ok"] else "  FAILED")
        )
    if report["kernel_programs"]:
        _out()
        _out(
            "kernel programs (16 KiB scattered): "
            + ", ".join(
                f"{r['direction']} {r['programs']}: {r['gbps']:.1f}"
                for r in report["kernel_programs"]
            )
        )
    _out()
    on_gpu = all(t["best_method"] != "cpu" for t in report["summary"]["targets"])
    if not on_gpu:
        _out("CPU run: the bandwidth goals apply to a GPU (PCIe) and are not judged here")
    else:
        for t in report["summary"]["targets"]:
            _out(
                f"goal {t['direction']} {t['page_kib']} KiB scattered: {t['pct']:.0f}% "
                f"({t['best_method']}) vs >= {t['goal_pct']:.0f}%: "
                + ("met" if t["met"] else "NOT met")
            )
    for direction, c in report["summary"]["crossover"].items():
        line = crossover_line(c)
        if line is not None:
            _out(f"crossover {direction}: {line}")
    if report["skipped"]:
        _out(f"time budget reached: {report['skipped']} measurement(s) skipped")


def run(args: argparse.Namespace) -> int:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        _out("CUDA is not available (use --device cpu for a smoke test of the CPU path)")
        return 2
    bench = Bench(device=args.device, quick=args.quick, budget_s=args.budget_s)
    name = torch.cuda.get_device_name(bench.device) if bench.cuda else "cpu"
    _out(f"kvcache.transfer bench on {name}")
    correctness = bench.correctness()
    descriptors = bench.descriptor_cost()
    baseline = bench.baseline()
    rows = bench.sweep(baseline)
    programs = bench.kernel_programs(baseline)
    report = {
        "schema": 1,
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "quick": args.quick,
        "job_bytes": bench.job_bytes,
        "correctness": correctness,
        "descriptors": descriptors,
        "baseline": baseline,
        "rows": rows,
        "kernel_programs": programs,
        "summary": summarize(rows),
        "skipped": bench.skipped,
        "elapsed_s": bench.elapsed(),
    }
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
        _out(f"wrote {args.json}")
    failed = any(not c["ok"] for c in correctness) or any(not r["ok"] for r in rows)
    return 1 if failed else 0


PROG = "kvcache transfer bench"
MISSING_TORCH = f"{PROG}: error: needs torch (pip install 'kvcache-offload[transfer]')"


def _budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, not {text!r}") from None
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, not {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description=(
            "Byte-exact store/load round trips through every copy method and pool kind, the "
            "CPU cost of building copy descriptors, then a bandwidth sweep over page sizes. "
            "Needs torch; --device cuda (the default) needs a CUDA GPU."
        ),
    )
    parser.add_argument(
        "--json", type=Path, metavar="FILE", help="also write the whole report as JSON to FILE"
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda: GPU <-> host transfers (default); cpu: the CPU path, a smoke test of the "
        "bench on machines without a GPU",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one repetition")
    parser.add_argument(
        "--budget-s",
        type=_budget,
        default=150.0,
        metavar="SECONDS",
        help="skip the remaining measurements once this much time has passed (default 150)",
    )
    return parser


def json_path_problem(path: Path) -> str | None:
    """Why the report could not be written to ``path`` (None: it can), checked before the run."""
    if path.is_dir():
        return "is a directory"
    parent = path.parent
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    target = path if path.exists() else parent
    if not os.access(target, os.W_OK):
        return f"{target} is not writable"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the bench; returns the exit status. ``--help`` and option errors need no torch."""
    args = build_parser().parse_args(argv)
    if args.json is not None:
        problem = json_path_problem(args.json)
        if problem is not None:
            sys.stderr.write(f"{PROG}: error: --json {args.json}: {problem}\n")
            return 2
    if importlib.util.find_spec("torch") is None:
        sys.stderr.write(MISSING_TORCH + "\n")
        return 2
    try:
        return run(args)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "torch":
            raise
        sys.stderr.write(MISSING_TORCH + "\n")
        return 2
