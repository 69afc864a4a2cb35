"""Pinning through the fake CUDA runtime (``tests/support/fakecuda``): pieces, rollback,
sticky-error clearing, exactly-once unregistration, the device every call runs on. kvcache loads the
fake by path as it loads the real runtime, so the pool's Rust registrar calls its
``cudaHostRegister`` and friends exactly as it calls CUDA's."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvcache.transfer import HostChunkPool, TransferEngine, _cuda
from tests.support.fakecuda.shim import fake, runtime
from tests.support.waiting import HANG_S

MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation


@pytest.fixture(autouse=True)
def fresh_fake() -> Iterator[None]:
    fake().reset(4)
    yield
    fake().reset(4)


def registered() -> list[tuple[int, int, int, int]]:
    return fake().registrations()


def unregistered() -> list[int]:
    return [start for start, _, _, _ in fake().registrations(unregistered=True)]


def test_registers_in_chunk_aligned_pieces_and_unregisters_once_on_close() -> None:
    rt = runtime()
    pool = HostChunkPool(10, 12 * 1024, pin=False)
    # Pieces must hold whole chunks and whole pages: 36 KiB fits under a 40 KiB limit.
    assert _cuda.register_pool(pool, rt, required=True, max_piece_bytes=40 * 1024)
    assert pool.pinned
    assert pool.registration_pieces == 4
    assert pool.device_can_use_host_pointer
    starts = [p for p, _, _, _ in registered()]
    sizes = [s for _, s, _, _ in registered()]
    assert sizes == [36 * 1024] * 3 + [12 * 1024]
    assert starts == [pool.address + i * 36 * 1024 for i in range(4)]
    assert {f for _, _, f, _ in registered()} == {_cuda.REGISTER_FLAGS}
    pool.close()
    assert unregistered() == starts[::-1]
    assert not pool.pinned
    pool.close()
    del pool
    gc.collect()
    assert unregistered() == starts[::-1]


def test_collecting_a_pinned_pool_unregisters_every_piece_once() -> None:
    pool = HostChunkPool(8, 4096, pin=False)
    assert _cuda.register_pool(pool, runtime(), required=False, max_piece_bytes=3 * 4096)
    starts = [p for p, _, _, _ in registered()]
    assert len(starts) == 3
    del pool
    gc.collect()
    assert sorted(unregistered()) == sorted(starts)
    assert len(unregistered()) == 3


def test_failed_registration_rolls_back_clears_the_error_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake().fail_register(3, MEMORY_ALLOCATION)
    with HostChunkPool(8, 4096, pin=False) as pool, caplog.at_level("WARNING"):
        assert not _cuda.register_pool(pool, runtime(), required=False, max_piece_bytes=2 * 4096)
        assert not pool.pinned
        assert pool.registration_pieces == 0
        assert unregistered() == [p for p, _, _, _ in registered()][::-1]
        assert len(unregistered()) == 2
        assert fake().peek_at_last_error() == 0  # the error was read and cleared
        assert any("staying pageable" in r.getMessage() for r in caplog.records)
        memoryview(pool)[:] = b"\x01" * pool.nbytes  # still usable, pageable
    assert len(unregistered()) == 2  # nothing more on close


def test_failed_registration_raises_when_pinning_is_required() -> None:
    fake().fail_register(1, MEMORY_ALLOCATION)
    with HostChunkPool(4, 4096, pin=False) as pool:
        with pytest.raises(RuntimeError, match="code 2"):
            _cuda.register_pool(pool, runtime(), required=True)
        assert not pool.pinned
        assert fake().peek_at_last_error() == 0
        assert unregistered() == []


def test_registration_is_refused_twice_and_after_close() -> None:
    rt = runtime()
    pool = HostChunkPool(4, 4096, pin=False)
    assert _cuda.register_pool(pool, rt, required=True)
    with pytest.raises(ValueError, match="already registered"):
        _cuda.register_pool(pool, rt, required=True)
    pool.close()
    with pytest.raises(ValueError, match="closed"):
        _cuda.register_pool(pool, rt, required=True)
    assert len(registered()) == 1 == len(unregistered())


def test_copies_never_span_two_registrations() -> None:
    import torch

    page = 4096
    layer = torch.randint(0, 256, (16, page), dtype=torch.uint8)
    pool = HostChunkPool(10, page, pin=False)
    assert _cuda.register_pool(pool, runtime(), required=True, max_piece_bytes=3 * page)
    engine = TransferEngine([layer], pool)
    plan = engine.plan(store=True, gpu_block_ids=range(2, 12), chunk_ids=range(10))
    # One contiguous run on both sides, cut at every piece boundary (chunks 3, 6, 9).
    assert len(plan) == 4
    assert plan.num_pages == 10
    del plan
    engine.wait([engine.store(range(2, 12), range(10))])
    assert engine.poll() == [(0, True)]
    np.testing.assert_array_equal(pool.tensor().numpy(), layer[2:12].numpy())
    engine.close()
    pool.close()


def test_background_registration_binds_its_thread_and_completes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with HostChunkPool(8, 4096, pin=False) as pool, caplog.at_level("INFO"):
        assert _cuda.register_pool(
            pool, runtime(), required=False, background=True, max_piece_bytes=2 * 4096, device=3
        )
        # Boundaries are known before the registration finishes.
        assert pool.registration_piece_bytes == 2 * 4096
        status = pool.wait_pinned(HANG_S)
        assert status["state"] == "pinned"
        assert status["pieces"] == 4
        assert pool.pinned
        assert pool.kernel_ready  # finishes the bookkeeping (device pointer check) and logs
        assert any("pinned in the background" in r.getMessage() for r in caplog.records)
        # The pinning thread selected the device before registering; this thread's device
        # is untouched; the unregistration on close runs on device 3 too.
        assert [d for _, _, _, d in registered()] == [3] * 4
        assert fake().get_device() == 0
    assert len(unregistered()) == 4
    assert {d for _, _, _, d in fake().registrations(unregistered=True)} == {3}
    assert fake().touched_devices() == {3}


class ArrivalLock:
    """A lock that counts the threads that have asked for it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.arrived = 0
        self._cond = threading.Condition()

    def __enter__(self) -> ArrivalLock:
        with self._cond:
            self.arrived += 1
            self._cond.notify_all()
        self.inner.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.release()

    def wait_for(self, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.arrived >= n, HANG_S), (
                f"{self.arrived} of {n} threads asked for the lock"
            )


def test_a_finished_background_pin_is_reported_once_by_racing_threads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Threads that see the registration finish at the same time (say, the engine's submitter
    and a describe() from another thread) report it once: the first thread's status read is
    held until every thread has got past the report's unlocked check and asked for its lock,
    so every thread is inside the report before any has marked it done."""
    threads_n = 4
    with HostChunkPool(8, 4096, pin=False) as pool, caplog.at_level("INFO"):
        assert _cuda.register_pool(
            pool, runtime(), required=False, background=True, max_piece_bytes=2 * 4096, device=0
        )
        assert pool.wait_pinned(HANG_S)["state"] == "pinned"
        lock = ArrivalLock(pool._pin_lock)
        pool._pin_lock = lock
        read = pool.pin_status

        def held_status() -> dict[str, object]:
            lock.wait_for(threads_n)
            return read()

        pool.pin_status = held_status  # type: ignore[method-assign]
        threads = [threading.Thread(target=pool.report_pinning) for _ in range(threads_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_S)
            assert not t.is_alive(), "a report never returned"
        del pool.pin_status
        pool._pin_lock = lock.inner
        assert lock.arrived == threads_n
        reports = [r for r in caplog.records if "pinned in the background" in r.getMessage()]
        assert len(reports) == 1


def test_failed_background_registration_is_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake().fail_register(2, MEMORY_ALLOCATION)
    with HostChunkPool(8, 4096, pin=False) as pool, caplog.at_level("WARNING"):
        assert _cuda.register_pool(
            pool, runtime(), required=False, background=True, max_piece_bytes=2 * 4096, device=0
        )
        assert pool.wait_pinned(HANG_S)["state"] == "failed"
        assert not pool.kernel_ready
        assert not pool.kernel_ready
        warnings = [r for r in caplog.records if "stays pageable" in r.getMessage()]
        assert len(warnings) == 1
        # The piece registered before the failure may be under a copy: it stays registered
        # until the pool closes.
        assert unregistered() == []
        assert pool.registration_pieces == 1
    assert unregistered() == [registered()[0][0]]


def test_real_runtime_without_a_gpu_fails_cleanly(caplog: pytest.LogCaptureFixture) -> None:
    """The CUDA runtime torch ships, on a machine without a driver: registration fails with a
    real error code, the pool stays pageable and usable."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present; the GPU check covers real registration")
    paths = _cuda._loaded_cudart_paths()
    if not paths:
        pytest.skip("this torch build has no CUDA runtime loaded")
    rt = _cuda.CudaRuntime.load(paths[0])
    with HostChunkPool(4, 4096, pin=False) as pool, caplog.at_level("WARNING"):
        assert not _cuda.register_pool(pool, rt, required=False)
        assert not pool.pinned
        assert any("staying pageable" in r.getMessage() for r in caplog.records)
        memoryview(pool)[0] = 3


def test_a_failed_background_pin_is_logged_by_a_dma_only_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The outcome of background pinning is reported whatever the copy method: an engine that
    never asks about the kernel still logs the failure, once, when it collects results."""
    import torch

    fake().fail_register(1, MEMORY_ALLOCATION)
    layer = torch.zeros(8, 512, dtype=torch.uint8)
    with HostChunkPool(8, 512, pin=False) as pool, caplog.at_level("WARNING"):
        assert _cuda.register_pool(pool, runtime(), required=False, background=True, device=0)
        assert pool.wait_pinned(HANG_S)["state"] == "failed"
        with TransferEngine([layer], pool, copy="dma") as engine:
            assert engine.poll() == []
            engine.wait([engine.store([1], [2])])
            assert engine.poll() == [(0, True)]
        warnings = [r for r in caplog.records if "stays pageable" in r.getMessage()]
        assert len(warnings) == 1
