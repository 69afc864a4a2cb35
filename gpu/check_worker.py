"""kvcache's vLLM worker under each release's contract (0.33: block ids; 0.34: device
pointers), through the stand-ins for vLLM's types, each in a child process of the GPU check
(the release is chosen at import)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from check_devices import Device, make_device
from check_paths import BLOCKS, PAGE, KiB
from check_results import Failed, Row, out

MAIN = Path(__file__).with_name("check.py")


def path_worker(device: Device, row: Row, contract: str, args: argparse.Namespace) -> None:
    """kvcache's worker under a release's contract, in a child process (the release is chosen
    at import)."""
    child = subprocess.run(
        [sys.executable, str(MAIN), "--device", args.device, "--worker-contract", contract],
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [ln for ln in child.stdout.splitlines() if ln.startswith("WORKER ")]
    if child.returncode != 0 or not lines:
        raise Failed(f"the worker child failed: {(child.stdout + child.stderr)[-1500:]}")
    result = json.loads(lines[-1][len("WORKER ") :])
    row.checked_bytes = result["checked_bytes"]
    row.methods = result["methods"]
    if result.get("failed"):
        raise Failed(result["failed"])


def worker_child(device_kind: str, contract: str) -> int:
    """Runs in the child: the stand-ins of vLLM ``contract``, then kvcache's worker."""
    import vllm_standins

    vllm_standins.install(f"{contract}.0")
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    CPUOffloadingWorker = vllm_standins.import_worker().CPUOffloadingWorker

    device = make_device(device_kind)
    torch = device.torch
    page, bpc = PAGE, 4
    raw = device.tensors(3, BLOCKS, page, 12)
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t.view(torch.int8), page) for t in raw],
        [
            [CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)],
            [CanonicalKVCacheRef(2, page - 4 * KiB)],
        ],
    )
    worker = CPUOffloadingWorker(caches, blocks_per_chunk=bpc, num_chunks=16, pin="blocking")
    if device.kind == "fake":
        eng = worker.engine
        on_fake = device.engine(
            eng._layers,
            eng.pool,
            blocks_per_chunk=bpc,
            groups=eng._group_refs,
            offsets=eng._offsets,
        )
        eng._backend.close()
        eng._backend, on_fake._backend = on_fake._backend, eng._backend
        on_fake._closed = True

    def device_side(spec: Any) -> Any:
        if contract == "0.33":
            return spec
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

        return resolve_device_pointers(spec, caches)

    checked = 0
    failed = None
    try:
        src = GPULoadStoreSpec([3, 4, 5, 6, 7, 9, 10], [4, 3], [1, 0])
        worker.submit_store(1, device_side(src), CPULoadStoreSpec([0, 1, 2]))
        worker.wait({1})
        dst = GPULoadStoreSpec([30, 31, 32, 33, 40, 41, 42], [4, 3], [1, 0])
        worker.submit_load(2, CPULoadStoreSpec([0, 1, 2]), device_side(dst), expedited=True)
        worker.wait({2})
        results = worker.get_finished() + worker.get_finished()
        if sorted((r.job_id, r.success) for r in results) != [(1, True), (2, True)]:
            failed = f"results {results}"
        for t, pairs in (
            (0, [(3, 30), (4, 31), (5, 32), (6, 33)]),
            (1, [(3, 30), (4, 31), (5, 32), (6, 33)]),
        ):
            c = device.cpu(raw[t])
            for s, d in pairs:
                if not torch.equal(c[d], c[s]):
                    failed = f"tensor {t} block {s} -> {d}"
                checked += page
        c = device.cpu(raw[2])
        for s, d in ((7, 40), (9, 41), (10, 42)):
            if not torch.equal(c[d][: page - 4 * KiB], c[s][: page - 4 * KiB]):
                failed = f"tensor 2 block {s} -> {d}"
            checked += page - 4 * KiB
        methods = worker.engine.jobs_by_method
    finally:
        worker.shutdown()
    out("WORKER " + json.dumps({"checked_bytes": checked, "methods": methods, "failed": failed}))
    return 0
