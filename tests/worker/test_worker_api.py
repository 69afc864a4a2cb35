"""kvcache's vLLM worker beyond byte conformance: fallbacks with their reason, typed
submission errors, failures reported (never as success) and logged, queues, shutdown."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import kvcache
from tests.support.oracle import require_oracle
from tests.support.vllm_worker_oracle import (
    build_pairs,
    canonical,
    make_tensors,
    offloading_config,
    vllm_on_cpu,
)
from tests.support.worker_specs import PLAIN, cpu_spec, default_spec_for, dev, gpu_spec, spec_for

pytestmark = pytest.mark.oracle


def info_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("kvcache") and r.levelno == logging.INFO
    ]


def test_kvcache_worker_false_selects_vllms_worker_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    require_oracle()
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker as VllmWorker

    with vllm_on_cpu(), caplog.at_level("DEBUG", logger="kvcache"):
        spec = spec_for(PLAIN, kvcache_worker=False)
        worker = spec.get_worker(canonical(PLAIN, make_tensors(PLAIN, 0)))
    try:
        assert isinstance(worker, VllmWorker)
        # One INFO line at start-up, with the reason folded in.
        (line,) = info_lines(caplog)
        assert "worker ready" in line
        assert "worker=vLLM's (kvcache_worker is false in kv_connector_extra_config)" in line
    finally:
        worker.shutdown()


def test_without_a_setting_vllms_worker_runs_until_a_gpu_run_has_passed(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default worker follows the GPU evidence: vLLM's while ``WORKER_GPU_EVIDENCE`` names
    no passed GPU run (the start-up line says so and how to choose kvcache's), kvcache's once
    it does; an explicit setting wins either way."""
    require_oracle()
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker as VllmWorker

    import kvcache.vllm
    from kvcache.vllm import _worker_settings

    with vllm_on_cpu(), caplog.at_level("DEBUG", logger="kvcache"):
        spec = default_spec_for(PLAIN)
        assert "kvcache_worker" not in spec.extra_config
        worker = spec.get_worker(canonical(PLAIN, make_tensors(PLAIN, 0)))
    try:
        if kvcache.vllm.WORKER_GPU_EVIDENCE is None:
            assert isinstance(worker, VllmWorker)
            (line,) = info_lines(caplog)
            assert f"worker=vLLM's ({kvcache.vllm.WORKER_DEFAULT_REASON})" in line
            assert '"kvcache_worker": true selects it' in line
        else:
            assert isinstance(worker, kvcache.vllm.CPUOffloadingWorker)
    finally:
        worker.shutdown()
    # The switch itself: with evidence named, the same configuration builds kvcache's worker.
    monkeypatch.setattr(_worker_settings, "WORKER_GPU_EVIDENCE", "docs/gpu/example.json")
    with vllm_on_cpu():
        spec = default_spec_for(PLAIN)
        worker = spec.get_worker(canonical(PLAIN, make_tensors(PLAIN, 0)))
    try:
        assert isinstance(worker, kvcache.vllm.CPUOffloadingWorker)
    finally:
        worker.shutdown()


def test_our_worker_starts_with_one_info_line(caplog: pytest.LogCaptureFixture) -> None:
    require_oracle()
    from kvcache.vllm import CPUOffloadingWorker

    with vllm_on_cpu(), caplog.at_level("DEBUG", logger="kvcache"):
        spec = spec_for(PLAIN)
        worker = spec.get_worker(canonical(PLAIN, make_tensors(PLAIN, 0)))
    try:
        assert isinstance(worker, CPUOffloadingWorker)
        (line,) = info_lines(caplog)
        for part in ("manager=kvcache (Rust)", "policy=", "worker=kvcache (cpu)", "pool=",
                     "pinned=", "cut-off="):  # fmt: skip
            assert part in line
    finally:
        worker.shutdown()


@pytest.mark.parametrize("fault", ["corrupt", "raise"])
def test_a_failed_self_check_falls_back_to_vllms_worker_with_one_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """Our worker's start-up self-check runs its copy paths on scratch memory; a path that
    moves a wrong byte (here: the CUDA backend over a fake runtime that flips one) or raises
    makes get_worker hand vLLM's worker over, with one WARNING naming the cause and the reason
    in the one INFO line."""
    require_oracle()
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker as VllmWorker

    from kvcache.transfer import TransferEngine
    from tests.support.fakecuda.shim import fake, scratch_on_fake

    if fault == "corrupt":
        fake().reset(1)
        # The CUDA backend over the fake CUDA runtime, whose first copy flips a byte.
        scratch = scratch_on_fake(lambda: fake().corrupt_copy(1))
    else:

        def scratch(*args: Any) -> Any:
            raise RuntimeError("injected launch failure")

    monkeypatch.setattr(TransferEngine, "_scratch_engine", scratch)
    with vllm_on_cpu(), caplog.at_level("DEBUG", logger="kvcache"):
        spec = spec_for(PLAIN)
        worker = spec.get_worker(canonical(PLAIN, make_tensors(PLAIN, 0)))
    try:
        assert isinstance(worker, VllmWorker)
        assert spec.get_worker(canonical(PLAIN, make_tensors(PLAIN, 0))) is worker
        cause = "wrong bytes" if fault == "corrupt" else "RuntimeError: injected launch failure"
        (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert "self-check" in warning
        assert cause in warning
        (line,) = info_lines(caplog)
        assert "worker=vLLM's (kvcache's start-up self-check failed" in line
        assert cause in line
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("replicated", "replicated (MLA) layout"),
        ("meta", "device type 'meta'"),
    ],
)
def test_unsupported_configurations_name_their_reason(change: str, reason: str) -> None:
    require_oracle()
    import dataclasses

    import torch

    import kvcache.vllm

    config = offloading_config(PLAIN, rank=0, cpu_bytes_to_use=1 << 20, engine_id="t")
    tensors = make_tensors(PLAIN, 0)
    if change == "canonical":
        config = dataclasses.replace(config, canonical_layout=True)
    spec = kvcache.vllm.CPUOffloadingSpec(config)
    if change == "replicated":
        spec.replicated_layout = True
    if change == "meta":
        tensors = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors]
    assert reason in (spec.worker_unsupported(canonical(PLAIN, tensors)) or "")
    assert spec_for(PLAIN).worker_unsupported(canonical(PLAIN, make_tensors(PLAIN, 0))) is None


def test_canonical_layout_is_served_as_vllms_cpu_worker_serves_it() -> None:
    """vLLM 0.33.0's CPU spec never passes canonical_layout to its worker (the direct layout
    is used either way), so ours serves the setting too."""
    require_oracle()
    import dataclasses

    import kvcache.vllm

    config = offloading_config(PLAIN, rank=0, cpu_bytes_to_use=1 << 20, engine_id="t")
    spec = kvcache.vllm.CPUOffloadingSpec(dataclasses.replace(config, canonical_layout=True))
    assert spec.worker_unsupported(canonical(PLAIN, make_tensors(PLAIN, 0))) is None


def test_submission_errors_are_typed_and_change_nothing() -> None:
    require_oracle()
    import kvcache

    with vllm_on_cpu():
        (pair,) = build_pairs(PLAIN, cpu_bytes_to_use=1 << 20, seed=3)
    worker, caches = pair.our_worker, pair.our_caches
    before = bytes(memoryview(worker.pool))
    try:
        with pytest.raises(kvcache.OutOfRangeError):  # block 64 of 64
            worker.submit_store(1, dev(caches, [0, 64], [2], [0]), cpu_spec([0]))
        with pytest.raises(kvcache.OutOfRangeError):  # chunk beyond the pool
            worker.submit_store(1, dev(caches, [0, 1], [2], [0]), cpu_spec([10_000]))
        with pytest.raises(kvcache.InvalidArgumentError):  # 3 blocks from slot 0 need 2 chunks
            worker.submit_store(1, dev(caches, [0, 1, 2], [3], [0]), cpu_spec([0]))
        with pytest.raises(kvcache.OutOfRangeError):  # a repeat does not excuse a bad id
            worker.submit_load(1, cpu_spec([0, 1]), dev(caches, [5, 6, 5, 700], [4], [0]))
        with pytest.raises(kvcache.InvalidTypeError):  # vLLM numbers jobs with ints
            worker.submit_store(None, dev(caches, [0, 1], [2], [0]), cpu_spec([0]))  # type: ignore[arg-type]
        with pytest.raises(kvcache.InvalidTypeError):  # the host side must be CPU chunks
            worker.submit_store(1, dev(caches, [0, 1], [2], [0]), gpu_spec([0], [1], [0]))
        with pytest.raises(kvcache.InvalidTypeError):
            worker.submit_load(1, gpu_spec([0], [1], [0]), dev(caches, [0, 1], [2], [0]))
        assert worker.get_finished() == []
        assert bytes(memoryview(worker.pool)) == before
        assert worker.submit_store(1, dev(caches, [0, 1], [2], [0]), cpu_spec([0]))
        with pytest.raises(kvcache.InvalidArgumentError, match="already in flight"):
            worker.submit_store(1, dev(caches, [2, 3], [2], [0]), cpu_spec([1]))
        worker.wait({1})
        (result,) = worker.get_finished()
        assert (result.job_id, result.success, result.transfer_size) == (1, True, 2 * 2 * 256)
        assert result.transfer_time is not None
        assert result.transfer_time >= 0
    finally:
        pair.shutdown()


def test_a_failed_copy_is_reported_and_logged_never_as_success(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A job whose copy fails (here: its queue's copy thread refuses it) comes back with
    success=False, and one error line names the job, its direction and the cause."""
    require_oracle()
    from kvcache.transfer import JobResult

    with vllm_on_cpu():
        (pair,) = build_pairs(PLAIN, cpu_bytes_to_use=1 << 20, seed=4)
    worker, caches = pair.our_worker, pair.our_caches
    backend = worker.engine._backend
    real_collect = backend.collect

    def failing_collect() -> list[JobResult]:
        return [
            r._replace(success=False, error="copy engine fault (injected)") for r in real_collect()
        ]

    backend.collect = failing_collect
    try:
        worker.submit_load(9, cpu_spec([0]), dev(caches, [4, 5], [2], [0]), expedited=True)
        with caplog.at_level(logging.ERROR, logger="kvcache.vllm"):
            worker.wait({9})
            (result,) = worker.get_finished()
        assert (result.job_id, result.success) == (9, False)
        (line,) = [r.getMessage() for r in caplog.records]
        assert "job 9" in line
        assert "expedited load, CPU -> GPU" in line
        assert "copy engine fault (injected)" in line
    finally:
        backend.collect = real_collect
        pair.shutdown()


def test_queues_and_shutdown() -> None:
    require_oracle()
    with vllm_on_cpu():
        (pair,) = build_pairs(PLAIN, cpu_bytes_to_use=1 << 20, seed=5)
    worker, caches = pair.our_worker, pair.our_caches
    copiers = worker.engine._backend._copiers
    assert len({id(c) for c in copiers.values()}) == 3  # store, load, expedited: own threads
    worker.submit_store(1, dev(caches, list(range(8)), [8], [0]), cpu_spec([0, 1, 2, 3]))
    worker.submit_load(2, cpu_spec([5]), dev(caches, [40, 41], [2], [0]))
    worker.submit_load(3, cpu_spec([6]), dev(caches, [50, 51], [2], [0]), expedited=True)
    worker.wait({999})  # not ours: ignored
    worker.shutdown()  # waits for every job, then releases the pool
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2, 3]
    assert worker.pool.closed
    pair.vllm_worker.shutdown()


def test_a_load_naming_a_block_twice_matches_vllms_worker() -> None:
    """vLLM's scheduler can repeat a destination (a Mamba group's null block); vLLM's worker
    writes it twice. Ours splits the load around the repeat: same bytes, one result with
    vLLM's transfer_size."""
    require_oracle()
    from tests.support.vllm_worker_oracle import device_bytes

    with vllm_on_cpu():
        (pair,) = build_pairs(PLAIN, cpu_bytes_to_use=1 << 20, seed=6)
        try:
            for worker, caches in pair.workers():
                assert worker.submit_store(
                    1, dev(caches, list(range(8)), [8], [0]), cpu_spec([0, 1, 2, 3])
                )
                worker.wait({1})
                worker.get_finished()
            results = []
            for worker, caches in pair.workers():
                spec = dev(caches, [20, 21, 20, 0, 22, 0, 0], [7], [1])
                assert worker.submit_load(2, cpu_spec([0, 1, 2, 3]), spec)
                worker.wait({2})
                (r,) = worker.get_finished()
                results.append((r.job_id, r.success, r.transfer_size))
            assert results[0] == results[1] == (2, True, 7 * 2 * 256)
            assert device_bytes(pair.our_tensors) == device_bytes(pair.vllm_tensors)
            assert pair.our_worker.get_finished() == []
        finally:
            pair.shutdown()


def test_a_split_load_that_fails_part_way_leaves_no_stray_result() -> None:
    """If queueing a later part of a split load raises, the parts already queued still run:
    their results belong to no job, and get_finished must neither report nor trip on them."""
    require_oracle()
    with vllm_on_cpu():
        (pair,) = build_pairs(PLAIN, cpu_bytes_to_use=1 << 20, seed=8)
        try:
            worker, caches = pair.our_worker, pair.our_caches
            real_load = worker.engine.load
            calls = []

            def load_then_fail(*args: object, **kwargs: object) -> int:
                calls.append(1)
                if len(calls) > 2:  # the first call is the unsplit attempt
                    raise kvcache.TransferError("queue refused")
                return real_load(*args, **kwargs)

            worker.engine.load = load_then_fail
            spec = dev(caches, [20, 21, 20, 0, 22, 0, 0], [7], [1])
            with pytest.raises(kvcache.TransferError):
                worker.submit_load(2, cpu_spec([0, 1, 2, 3]), spec)
            worker.engine.load = real_load
            worker.engine.wait(None)
            assert worker.get_finished() == []
            assert worker.submit_load(3, cpu_spec([0]), dev(caches, [5, 6], [2], [0]))
            worker.wait({3})
            assert [(r.job_id, r.success) for r in worker.get_finished()] == [(3, True)]
        finally:
            pair.shutdown()


class HeldCopier:
    """A queue's copier that holds every job submitted to it, in order, until
    :meth:`release` (as a queue busy with a long copy would), then hands them to the real
    one."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.held: list[tuple[int, Any]] = []
        self.holding = True

    def submit(self, job_id: int, plan: Any) -> None:
        if self.holding:
            self.held.append((job_id, plan))
        else:
            self.real.submit(job_id, plan)

    def release(self) -> None:
        self.holding = False
        held, self.held = self.held, []
        for job_id, plan in held:
            self.real.submit(job_id, plan)

    def poll(self) -> list[Any]:
        return list(self.real.poll())

    def wait(self, job_ids: list[int] | None = None) -> None:
        held = {j for j, _ in self.held}
        if held and (job_ids is None or held & set(job_ids)):
            raise AssertionError(f"waiting for held job(s) {sorted(held)} would never return")
        self.real.wait(job_ids)

    def in_flight(self) -> int:
        return int(self.real.in_flight()) + len(self.held)

    def shutdown(self) -> None:
        self.release()
        self.real.shutdown()


def test_an_expedited_load_overtakes_a_regular_load_held_in_flight() -> None:
    """Through vLLM's worker API on the CPU copier: a regular load held on its queue does
    not delay an expedited load submitted after it, which get_finished reports first. Were
    both on one queue, the expedited load would be held too (and waiting for it fails)."""
    require_oracle()
    with vllm_on_cpu():
        (pair,) = build_pairs(PLAIN, cpu_bytes_to_use=1 << 20, seed=9)
    worker, tensors, caches = pair.our_worker, pair.our_tensors, pair.our_caches
    copiers = worker.engine._backend._copiers
    held = HeldCopier(copiers["load"])
    copiers["load"] = held
    try:
        assert worker.submit_store(1, dev(caches, [0, 1, 2, 3], [4], [0]), cpu_spec([0, 1]))
        worker.wait({1})
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
        assert worker.submit_load(2, cpu_spec([0]), dev(caches, [40, 41], [2], [0]))
        assert worker.submit_load(3, cpu_spec([1]), dev(caches, [50, 51], [2], [0]), expedited=True)
        worker.wait({3})
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(3, True)]
        assert all(torch.equal(t[[50, 51]], t[[2, 3]]) for t in tensors)
        assert held.held  # the regular load is still waiting for its queue
        assert not torch.equal(tensors[0][40], tensors[0][0])
        held.release()
        worker.wait({2})
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]
        assert all(torch.equal(t[[40, 41]], t[[0, 1]]) for t in tensors)
    finally:
        held.release()
        pair.shutdown()


def test_null_block_placeholders_in_a_store_match_vllms_worker() -> None:
    """vLLM 0.34.0's scheduler keeps the null block (block 0) in a store wherever the request's
    block table has one inside a chunk, so that the blocks after it keep their slots: the
    store reads block 0 (zeroed on a GPU, random bytes here) into those slots. Both workers
    must fill every slot alike, the placeholders' included, and report the same size."""
    require_oracle()
    from tests.support.vllm_worker_oracle import device_bytes

    with vllm_on_cpu():
        (pair,) = build_pairs(PLAIN, cpu_bytes_to_use=1 << 20, seed=10)
        try:
            results = []
            for worker, caches in pair.workers():
                # Chunks of 2 blocks: [0, 7] [0, 0] [9, 0] [11]: placeholders first, inside and
                # last in a chunk, and a short final chunk.
                spec = dev(caches, [0, 7, 0, 0, 9, 0, 11], [7], [0])
                assert worker.submit_store(1, spec, cpu_spec([3, 1, 4, 2]))
                worker.wait({1})
                (r,) = worker.get_finished()
                results.append((r.job_id, r.success, r.transfer_size))
            assert results[0] == results[1] == (1, True, 7 * 2 * 256)
            ours = pair.our_host().numpy()
            assert ours.tobytes() == pair.vllm_host_slot().contiguous().numpy().tobytes()
            # Chunk 1 holds block 0's pages twice (each tensor's two slots), chunk 3 block 7.
            null = [t[0].numpy().tobytes() for t in pair.our_tensors]
            assert ours[1].tobytes() == null[0] * 2 + null[1] * 2
            assert ours[3][256:512].tobytes() == pair.our_tensors[0][7].numpy().tobytes()
            # Loading them back into fresh blocks moves the same bytes on both sides.
            for worker, caches in pair.workers():
                assert worker.submit_load(2, cpu_spec([3, 1]), dev(caches, [20, 21, 22], [3], [0]))
                worker.wait({2})
                assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]
            assert device_bytes(pair.our_tensors) == device_bytes(pair.vllm_tensors)
        finally:
            pair.shutdown()


def failing_copy(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")


def test_a_failed_copy_is_reported_in_the_releases_shape() -> None:
    """vLLM 0.34.0's worker reports a copy that fails as ``TransferResult(job_id,
    success=False)`` (no size, no time) and clears the pending device error; ours reports
    the same result for a failed copy. vLLM 0.33.0's worker cannot report one (the copy's
    error escapes its submit), and ours reports success=False with the job's size."""
    require_oracle()
    from kvcache.transfer import JobResult
    from tests.support.vllm_worker_oracle import CLEARED_DEVICE_ERRORS, pointers_release

    with vllm_on_cpu(copy=failing_copy):
        (pair,) = build_pairs(PLAIN, cpu_bytes_to_use=1 << 20, seed=11)
        backend = pair.our_worker.engine._backend
        real_collect = backend.collect

        def failing_collect() -> list[JobResult]:
            return [r._replace(success=False, error="injected") for r in real_collect()]

        backend.collect = failing_collect
        try:
            ours = []
            for job_id, store in ((1, True), (2, False)):
                spec = dev(pair.our_caches, [4, 5], [2], [0])
                if store:
                    assert pair.our_worker.submit_store(job_id, spec, cpu_spec([0]))
                else:
                    assert pair.our_worker.submit_load(job_id, cpu_spec([1]), spec, True)
                pair.our_worker.wait({job_id})
                ours += pair.our_worker.get_finished()
            if pointers_release():
                cleared = len(CLEARED_DEVICE_ERRORS)
                theirs = []
                for job_id, store in ((1, True), (2, False)):
                    spec = dev(pair.vllm_caches, [4, 5], [2], [0])
                    if store:
                        assert pair.vllm_worker.submit_store(job_id, spec, cpu_spec([0]))
                    else:
                        assert pair.vllm_worker.submit_load(job_id, cpu_spec([1]), spec, True)
                    pair.vllm_worker.wait({job_id})
                    theirs += pair.vllm_worker.get_finished()
                assert len(CLEARED_DEVICE_ERRORS) == cleared + 2
                assert ours == theirs
                assert [(r.transfer_size, r.transfer_time) for r in ours] == [(None, None)] * 2
            else:
                spec = dev(pair.vllm_caches, [4, 5], [2], [0])
                with pytest.raises(RuntimeError, match="injected"):
                    pair.vllm_worker.submit_store(1, spec, cpu_spec([0]))
                assert [r.transfer_size for r in ours] == [2 * 2 * 256] * 2
            assert [(r.job_id, r.success) for r in ours] == [(1, False), (2, False)]
        finally:
            backend.collect = real_collect
            pair.shutdown()
