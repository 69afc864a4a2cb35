"""kvcache's worker under ``KvCacheTieringOffloadingSpec``, in vLLM's shared host region.

With tiering, the secondary tiers copy chunks to and from the rows of vLLM's shared host region
(``/dev/shm``), so the GPU worker must write exactly those rows. vLLM's own worker (built by
vLLM's ``TieringOffloadingSpec``) and kvcache's (``"kvcache_worker": true``) run the same jobs
on identical CPU tensors, each in a region of its own (vLLM's CUDA edges faked as in
tests/support/vllm_worker_oracle.py); after the stores every byte of the two regions, after the
loads every device byte, and the results must be identical. Without the setting, the spec's worker
is vLLM's (the default until kvcache's passes a GPU run).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest

from tests.support.oracle import require_oracle
from tests.support.vllm_worker_oracle import canonical, make_tensors, offloading_config, vllm_on_cpu
from tests.support.worker_specs import PLAIN, cpu_spec, dev

pytestmark = pytest.mark.oracle


def tiering_spec(side: str, **extra: Any) -> Any:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    import kvcache.vllm

    config = offloading_config(
        PLAIN,
        rank=0,
        cpu_bytes_to_use=16 * 4096 * 2,
        engine_id=f"kvcache-tier-worker-{uuid.uuid4().hex}",
        secondary_tiers=[],
        tier_poll_interval_s=0,
        **extra,
    )
    if "kvcache_worker" not in extra:  # the oracle's configurations name kvcache's worker
        import dataclasses

        trimmed = {k: v for k, v in config.extra_config.items() if k != "kvcache_worker"}
        config = dataclasses.replace(config, extra_config=trimmed)
    cls = TieringOffloadingSpec if side == "vllm" else kvcache.vllm.KvCacheTieringOffloadingSpec
    return cls(config)


def region_bytes(worker: Any) -> bytes:
    """The whole shared region the worker writes (vLLM's: its mapping; ours: the pool over
    it)."""
    region = getattr(worker, "_mmap_region", None)
    if region is not None:
        return bytes(memoryview(region.mmap_obj))
    return bytes(memoryview(worker.pool))


def test_our_worker_writes_the_shared_region_exactly_as_vllms() -> None:
    require_oracle()
    import torch

    from kvcache.vllm import CPUOffloadingWorker

    runs = {}
    with vllm_on_cpu():
        for side in ("vllm", "kvcache"):
            spec = tiering_spec(side, kvcache_worker=side == "kvcache", kvcache_pin="off")
            tensors = make_tensors(PLAIN, 7)
            caches = canonical(PLAIN, tensors)
            worker = spec.get_worker(caches)
            assert isinstance(worker, CPUOffloadingWorker) is (side == "kvcache")
            try:
                worker.submit_store(1, dev(caches, [3, 4, 5, 6, 9], [5], [1]), cpu_spec([0, 1, 2]))
                worker.wait({1})
                stored = region_bytes(worker)
                worker.submit_load(
                    2, cpu_spec([0, 1, 2]), dev(caches, [20, 21, 22, 23, 24], [5], [1])
                )
                worker.wait({2})
                results = sorted(
                    (r.job_id, r.success, r.transfer_size) for r in worker.get_finished()
                )
                runs[side] = (stored, [t.clone() for t in tensors], results)
            finally:
                worker.shutdown()
    ours, theirs = runs["kvcache"], runs["vllm"]
    assert any(ours[0]), "nothing was stored"
    assert ours[0] == theirs[0], "the shared regions differ after the stores"
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1], strict=True))
    assert ours[2] == theirs[2]
    assert all(ok for _, ok, _ in ours[2])


def test_without_the_setting_the_tiered_worker_is_vllms(caplog: pytest.LogCaptureFixture) -> None:
    require_oracle()
    import kvcache.vllm

    with vllm_on_cpu(), caplog.at_level(logging.INFO, logger="kvcache"):
        spec = tiering_spec("kvcache")
        worker = spec.get_worker(canonical(PLAIN, make_tensors(PLAIN, 1)))
    try:
        assert not isinstance(worker, kvcache.vllm.CPUOffloadingWorker)
        if kvcache.vllm.WORKER_GPU_EVIDENCE is None:
            line = next(r.getMessage() for r in caplog.records if "worker ready" in r.getMessage())
            assert kvcache.vllm.WORKER_DEFAULT_REASON in line
    finally:
        worker.shutdown()
