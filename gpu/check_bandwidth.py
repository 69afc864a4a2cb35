"""The GPU check's bandwidth: each page size stored and loaded next to one large copy in each
direction (the machine's limit), timed by the installed package's harness."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from check_devices import Device
from check_results import check
from kvcache.transfer._timing import Budget, gb_per_s, repeat

KiB = 1024


def bandwidth(device: Device, budget: Budget) -> list[dict[str, Any]]:
    """GB/s of a store and a load of ~256 MiB at each page size (scattered blocks, the method
    the engine chooses), and of one large pinned copy in each direction."""
    torch = device.torch
    rows: list[dict[str, Any]] = []
    job_bytes = 256 << 20

    def large_copies() -> tuple[float, float]:
        host = torch.empty(job_bytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(job_bytes, dtype=torch.uint8, device=device.dev)  # type: ignore[attr-defined]
        h2d = gb_per_s(job_bytes, best(device, lambda: dev.copy_(host, non_blocking=True)))
        d2h = gb_per_s(job_bytes, best(device, lambda: host.copy_(dev, non_blocking=True)))
        return h2d, d2h

    h2d, d2h = large_copies()
    rows.append({"page_kib": None, "what": "large copy", "store_gbps": d2h, "load_gbps": h2d})
    for page_kib in (4, 8, 16, 32, 64, 128):
        if budget.over():
            rows.append({"page_kib": page_kib, "skipped": "time budget"})
            continue
        page = page_kib * KiB
        layers_n, bpc = 8, 16
        chunk = layers_n * bpc * page
        chunks = job_bytes // chunk
        blocks = 2 * chunks * bpc
        layers = [
            torch.empty((blocks, page), dtype=torch.uint8, device=device.dev)  # type: ignore[attr-defined]
            for _ in range(layers_n)
        ]
        pool = device.pool(chunks, chunk, "pinned")
        engine = device.engine(layers, pool, blocks_per_chunk=bpc)
        rng = np.random.default_rng(page_kib)
        ids = rng.permutation(blocks)[: chunks * bpc]
        cids = np.arange(chunks)
        try:
            store_s, load_s, before, after = _time_jobs(device, engine, ids, cids)
        finally:
            engine.close()
            pool.close()
        ran = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
        nbytes = chunks * chunk
        store_gbps, load_gbps = gb_per_s(nbytes, store_s), gb_per_s(nbytes, load_s)
        rows.append(
            {
                "page_kib": page_kib,
                "what": "scattered job",
                "job_mib": nbytes >> 20,
                "store_gbps": store_gbps,
                "load_gbps": load_gbps,
                "store_pct_of_large": 100 * store_gbps / d2h,
                "load_pct_of_large": 100 * load_gbps / h2d,
                "methods": ran,
            }
        )
    return rows


def best(device: Device, fn: Callable[[], object]) -> float:
    """The best of four timed runs of ``fn`` (no warm-up run: the best of four drops it)."""
    return min(repeat(fn, 4, sync=device.sync))


def _time_jobs(
    device: Device, engine: Any, ids: Any, cids: Any
) -> tuple[float, float, dict[str, int], dict[str, int]]:
    """Best store and load times of one job over ``ids``/``cids``, and the engine's method
    counts around them."""

    def one(store: bool) -> None:
        job = engine.store(ids, cids) if store else engine.load(cids, ids)
        engine.wait([job])
        check(all(r.success for r in engine.poll_results()), "bandwidth job failed")

    before = engine.jobs_by_method
    store_s = best(device, lambda: one(True))
    load_s = best(device, lambda: one(False))
    return store_s, load_s, before, engine.jobs_by_method
