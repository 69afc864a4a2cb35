"""Tests of the fake CUDA library itself: other tests use it as their oracle of CUDA's rules."""

from __future__ import annotations

import ctypes
import time

import pytest

from tests.support.fakecuda import (
    EVENT_DISABLE_TIMING,
    HOST_MEMORY_ALREADY_REGISTERED,
    HOST_MEMORY_NOT_REGISTERED,
    HOST_REGISTER_PORTABLE,
    ILLEGAL_ADDRESS,
    INVALID_DEVICE,
    INVALID_HANDLE,
    INVALID_VALUE,
    LAUNCH_FAILURE,
    MISALIGNED_ADDRESS,
    NON_UVA_OFFSET,
    NOT_READY,
    SIZE_MAX,
    SUCCESS,
    CudaError,
    FakeCuda,
    MemcpyAttributes,
    library_path,
)
from tests.support.fakecuda_calls import (
    Call,
    addr,
    at_gate,
    device,
    filled,
    on_thread,
    pinned,
    waiting,
)
from tests.support.waiting import wait_until

# ---- library and symbols ---------------------------------------------------------------


def test_library_is_cached_per_source(fake: FakeCuda) -> None:
    path = library_path()
    assert path == fake.path
    assert path.exists()
    assert library_path() == path


def test_exports_the_real_cuda_names(fake: FakeCuda) -> None:
    names = [
        "cudaSetDevice",
        "cudaGetDevice",
        "cudaGetDeviceCount",
        "cudaGetLastError",
        "cudaPeekAtLastError",
        "cudaGetErrorString",
        "cudaStreamCreateWithFlags",
        "cudaStreamCreate",
        "cudaStreamDestroy",
        "cudaStreamSynchronize",
        "cudaStreamQuery",
        "cudaStreamWaitEvent",
        "cudaEventCreateWithFlags",
        "cudaEventCreate",
        "cudaEventDestroy",
        "cudaEventRecord",
        "cudaEventQuery",
        "cudaEventSynchronize",
        "cudaEventElapsedTime",
        "cudaMemcpyAsync",
        "cudaHostRegister",
        "cudaHostUnregister",
        "cudaHostGetDevicePointer",
        "cuGetErrorString",
        "cuMemcpyBatchAsync",
        "cuMemcpyBatchAsync_v2",
    ]
    for name in names:
        assert fake.address(name) != 0


def test_error_strings(cuda: FakeCuda) -> None:
    assert cuda.error_string(ILLEGAL_ADDRESS).startswith("cudaErrorIllegalAddress")
    assert cuda.error_string(12345) == "unknown error"
    text = ctypes.c_char_p()
    assert cuda.lib.cuGetErrorString(MISALIGNED_ADDRESS, ctypes.byref(text)) == SUCCESS
    assert text.value is not None
    assert b"misaligned" in text.value
    assert cuda.lib.cuGetErrorString(0, None) == INVALID_VALUE
    # Error strings answer even under a sticky fault: the engine reports with them.
    cuda.fault(LAUNCH_FAILURE)
    assert "launch failure" in cuda.error_string(LAUNCH_FAILURE)


# ---- streams -------------------------------------------------------------------------------


def test_copies_run_later_on_the_stream_in_order(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    first, second = pinned(cuda, 64, 1), pinned(cuda, 64, 2)
    dst = device(cuda, 64, 0)
    gate = cuda.stream_gate(s)
    assert cuda.memcpy_async(addr(dst), addr(first), 64, s) == SUCCESS
    assert cuda.memcpy_async(addr(dst), addr(second), 64, s) == SUCCESS
    at_gate(cuda, gate)
    assert (dst == 0).all()
    assert cuda.stream_pending(s) == 3  # the gate and both copies
    assert cuda.stream_blocked(s)
    assert cuda.stream_query(s) == NOT_READY
    # "Not ready" is an answer, not an error.
    assert cuda.get_last_error() == SUCCESS
    cuda.gate_open(gate)
    assert cuda.stream_synchronize(s) == SUCCESS
    # Enqueue order: the second copy ran last.
    assert (dst == 2).all()
    assert cuda.stream_query(s) == SUCCESS
    assert (cuda.stream_pending(s), cuda.stream_blocked(s)) == (0, False)
    assert cuda.count("memcpy_calls") == 2
    assert cuda.count("pageable_copies") == 0


def test_gate_opened_before_the_stream_reaches_it(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    gate = cuda.stream_gate(s)
    cuda.gate_open(gate)
    assert cuda.stream_synchronize(s) == SUCCESS
    with pytest.raises(ValueError, match="no pending gate"):
        cuda.gate_open(gate)


def test_default_stream_per_device(cuda: FakeCuda) -> None:
    cuda.reset(2)
    src, dst = pinned(cuda, 16, 7), device(cuda, 16, 0, dev=1)
    assert cuda.set_device(1) == SUCCESS
    for handle in (0, 1, 2):
        assert cuda.memcpy_async(addr(dst), addr(src), 16, handle) == SUCCESS
        assert cuda.stream_synchronize(handle) == SUCCESS
    assert (dst == 7).all()
    assert cuda.count("cross_device_calls") == 0
    assert cuda.count("streams_created") == 0
    # The default streams are not the caller's to destroy.
    assert cuda.stream_destroy(0) == INVALID_HANDLE


def test_stream_destroy_drains_then_joins(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    src, dst = pinned(cuda, 8, 3), device(cuda, 8, 0)
    gate = cuda.stream_gate(s)
    assert cuda.memcpy_async(addr(dst), addr(src), 8, s) == SUCCESS
    call = Call(lambda: cuda.stream_destroy(s))
    waiting(cuda)
    assert call.blocked()
    cuda.gate_open(gate)
    assert call.finish() == SUCCESS
    assert (dst == 3).all()
    assert cuda.live_streams() == 0


def test_invalid_handles(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    ev = cuda.event_create()
    src, dst = pinned(cuda, 8, 1), device(cuda, 8, 0)
    assert cuda.stream_destroy(s) == SUCCESS
    assert cuda.event_destroy(ev) == SUCCESS
    bogus = 0xDEADBEEF0
    for stream in (s, bogus, ev):
        assert cuda.stream_synchronize(stream) == INVALID_HANDLE
        assert cuda.stream_query(stream) == INVALID_HANDLE
        assert cuda.stream_destroy(stream) == INVALID_HANDLE
        assert cuda.memcpy_async(addr(dst), addr(src), 8, stream) == INVALID_HANDLE
        assert cuda.memcpy_batch([addr(dst)], [addr(src)], [8], stream)[0] == INVALID_HANDLE
        assert cuda.launch_copy(stream, 0, 0, 0, 0, True) == INVALID_HANDLE
        assert cuda.lib.fakecuda_stream_gate(stream) == 0
    live = cuda.stream_create()
    for event in (ev, bogus, live):
        assert cuda.event_query(event) == INVALID_HANDLE
        assert cuda.event_synchronize(event) == INVALID_HANDLE
        assert cuda.event_record(event, live) == INVALID_HANDLE
        assert cuda.stream_wait_event(live, event) == INVALID_HANDLE
        assert cuda.event_destroy(event) == INVALID_HANDLE
    assert cuda.get_last_error() == INVALID_HANDLE
    assert (dst == 0).all()


def test_stream_flags_and_counters(cuda: FakeCuda) -> None:
    handle = ctypes.c_void_p()
    assert cuda.lib.cudaStreamCreateWithFlags(ctypes.byref(handle), 7) == INVALID_VALUE
    assert cuda.lib.cudaStreamCreate(ctypes.byref(handle)) == SUCCESS
    s = cuda.stream_create(flags=1)
    assert cuda.count("streams_created") == 2
    assert cuda.live_streams() == 2
    assert cuda.stream_device(s) == 0
    assert cuda.stream_device(0) == -1
    with pytest.raises(KeyError):
        cuda.count("no_such_counter")


# ---- events --------------------------------------------------------------------------------


def test_copy_behind_wait_on_unreached_event_does_not_run(cuda: FakeCuda) -> None:
    a, b = cuda.stream_create(), cuda.stream_create()
    ev = cuda.event_create()
    src, dst = pinned(cuda, 32, 9), device(cuda, 32, 0)
    gate = cuda.stream_gate(a)
    assert cuda.event_record(ev, a) == SUCCESS
    assert cuda.stream_wait_event(b, ev) == SUCCESS
    assert cuda.memcpy_async(addr(dst), addr(src), 32, b) == SUCCESS
    wait_until(lambda: cuda.stream_blocked(b), "stream b at its wait for the event")
    assert (dst == 0).all()
    assert cuda.event_query(ev) == NOT_READY
    assert cuda.stream_query(b) == NOT_READY
    cuda.gate_open(gate)
    assert cuda.stream_synchronize(b) == SUCCESS
    assert (dst == 9).all()
    assert cuda.event_query(ev) == SUCCESS


def test_wait_captures_the_generation_at_the_call(cuda: FakeCuda) -> None:
    a, b = cuda.stream_create(), cuda.stream_create()
    ev = cuda.event_create()
    assert cuda.event_record(ev, a) == SUCCESS
    assert cuda.stream_synchronize(a) == SUCCESS
    assert cuda.stream_wait_event(b, ev) == SUCCESS
    # A later record on a gated stream does not hold back the earlier wait.
    gate = cuda.stream_gate(a)
    assert cuda.event_record(ev, a) == SUCCESS
    assert cuda.stream_synchronize(b) == SUCCESS
    assert cuda.event_query(ev) == NOT_READY
    cuda.gate_open(gate)
    assert cuda.event_synchronize(ev) == SUCCESS


def test_wait_on_never_recorded_event_is_a_no_op(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    ev = cuda.event_create()
    assert cuda.event_query(ev) == SUCCESS
    assert cuda.event_synchronize(ev) == SUCCESS
    assert cuda.stream_wait_event(s, ev) == SUCCESS
    assert cuda.stream_query(s) == SUCCESS
    assert cuda.stream_wait_event(s, ev, flags=8) == INVALID_VALUE


def test_event_query_synchronize_and_elapsed(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    start, end = cuda.event_create(), cuda.event_create()
    assert cuda.event_elapsed(start, end)[0] == INVALID_HANDLE  # never recorded
    assert cuda.event_record(start, s) == SUCCESS
    gate = cuda.stream_gate(s)
    assert cuda.event_record(end, s) == SUCCESS
    assert cuda.event_synchronize(start) == SUCCESS
    assert cuda.event_query(end) == NOT_READY
    assert cuda.event_elapsed(start, end)[0] == NOT_READY
    sync = Call(lambda: cuda.event_synchronize(end))
    waiting(cuda)
    assert sync.blocked()
    time.sleep(0.02)  # a span the records must measure: `end` runs after it, `start` before
    cuda.gate_open(gate)
    assert sync.finish() == SUCCESS
    assert cuda.event_query(end) == SUCCESS
    rc, ms = cuda.event_elapsed(start, end)
    assert rc == SUCCESS
    assert ms >= 20.0
    assert cuda.count("event_records") == 2


def test_elapsed_is_positive_for_back_to_back_records(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    start, end = cuda.event_create(), cuda.event_create()
    assert cuda.event_record(start, s) == SUCCESS
    assert cuda.event_record(end, s) == SUCCESS
    assert cuda.stream_synchronize(s) == SUCCESS
    rc, ms = cuda.event_elapsed(start, end)
    assert rc == SUCCESS
    assert ms > 0


def test_disable_timing_events(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    timed, untimed = cuda.event_create(), cuda.event_create(timing=False)
    assert cuda.event_record(timed, s) == SUCCESS
    assert cuda.event_record(untimed, s) == SUCCESS
    assert cuda.stream_synchronize(s) == SUCCESS
    assert cuda.event_query(untimed) == SUCCESS
    assert cuda.event_elapsed(timed, untimed)[0] == INVALID_HANDLE
    assert cuda.event_elapsed(untimed, timed)[0] == INVALID_HANDLE
    handle = ctypes.c_void_p()
    assert cuda.lib.cudaEventCreateWithFlags(ctypes.byref(handle), EVENT_DISABLE_TIMING) == 0
    assert cuda.lib.cudaEventCreateWithFlags(ctypes.byref(handle), 64) == INVALID_VALUE


def test_event_record_on_a_stream_of_another_device(cuda: FakeCuda) -> None:
    cuda.reset(2)
    ev0 = cuda.event_create()
    assert cuda.set_device(1) == SUCCESS
    s1 = cuda.stream_create()
    assert cuda.event_record(ev0, s1) == INVALID_HANDLE
    assert cuda.get_last_error() == INVALID_HANDLE
    ev1 = cuda.event_create()
    assert cuda.event_record(ev1, s1) == SUCCESS
    # Waiting across devices is allowed, as in CUDA.
    assert cuda.set_device(0) == SUCCESS
    s0 = cuda.stream_create()
    assert cuda.stream_wait_event(s0, ev1) == SUCCESS
    assert cuda.stream_synchronize(s0) == SUCCESS
    assert cuda.count("cross_device_calls") == 0


# ---- devices, threads, errors ---------------------------------------------------------------


def test_current_device_and_last_error_are_per_thread(cuda: FakeCuda) -> None:
    cuda.reset(2)
    count = ctypes.c_int()
    assert cuda.lib.cudaGetDeviceCount(ctypes.byref(count)) == SUCCESS
    assert count.value == 2
    assert cuda.set_device(1) == SUCCESS
    assert cuda.set_device(2) == INVALID_DEVICE
    assert cuda.set_device(-1) == INVALID_DEVICE
    assert cuda.get_device() == 1
    assert on_thread(lambda: (cuda.get_device(), cuda.get_last_error())) == (0, SUCCESS)
    assert cuda.peek_at_last_error() == INVALID_DEVICE
    # Success does not clear the last error; reading it does.
    assert cuda.set_device(0) == SUCCESS
    assert cuda.get_last_error() == INVALID_DEVICE
    assert cuda.get_last_error() == SUCCESS


def test_touched_devices(cuda: FakeCuda) -> None:
    cuda.reset(3)
    assert cuda.set_device(2) == SUCCESS
    cuda.get_device()
    cuda.get_last_error()
    cuda.error_string(0)
    assert cuda.touched_devices() == set()
    cuda.stream_create()
    assert cuda.touched_devices() == {2}
    on_thread(lambda: cuda.event_create())
    assert cuda.touched_devices() == {0, 2}
    assert cuda.set_device(1) == SUCCESS
    assert cuda.host_register(0, 0) == INVALID_VALUE  # even a failing call needs a context
    assert cuda.touched_devices() == {0, 1, 2}


def test_copy_to_a_stream_of_another_device_is_counted(cuda: FakeCuda) -> None:
    cuda.reset(2)
    assert cuda.set_device(1) == SUCCESS
    s1 = cuda.stream_create()
    ev = cuda.event_create()
    assert cuda.event_record(ev, s1) == SUCCESS
    assert cuda.set_device(0) == SUCCESS
    src, dst = pinned(cuda, 16, 5), device(cuda, 16, 0, dev=1)
    assert cuda.memcpy_async(addr(dst), addr(src), 16, s1) == SUCCESS
    assert cuda.memcpy_batch([addr(dst)], [addr(src)], [16], s1)[0] == SUCCESS
    assert cuda.stream_wait_event(s1, ev) == SUCCESS
    assert cuda.stream_synchronize(s1) == SUCCESS
    assert (dst == 5).all()
    assert cuda.count("cross_device_calls") == 3
    assert cuda.stream_device(s1) == 1


# ---- memory kinds and copies -------------------------------------------------------------


def test_pageable_copy_blocks_the_call_until_executed(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    src = filled(4096, 4)  # pageable
    dst = device(cuda, 4096, 0)
    gate = cuda.stream_gate(s)
    call = Call(lambda: cuda.memcpy_async(addr(dst), addr(src), 4096, s))
    waiting(cuda)
    assert call.blocked()
    assert (dst == 0).all()
    cuda.gate_open(gate)
    assert call.finish() == SUCCESS
    # The copy is complete when the call returns, without a synchronize.
    assert (dst == 4).all()
    assert cuda.count("pageable_copies") == 1


def test_pageable_destination_blocks_too(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    src, dst = device(cuda, 64, 6), filled(64, 0)
    gate = cuda.stream_gate(s)
    call = Call(lambda: cuda.memcpy_async(addr(dst), addr(src), 64, s))
    waiting(cuda)
    assert call.blocked()
    cuda.gate_open(gate)
    assert call.finish() == SUCCESS
    assert (dst == 6).all()


def test_copy_straddling_a_range_is_refused(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    host = pinned(cuda, 64, 1)
    dev = device(cuda, 64, 0)
    gate = cuda.stream_gate(s)
    assert cuda.memcpy_async(addr(dev) + 32, addr(host), 64, s) == INVALID_VALUE
    assert cuda.memcpy_async(addr(dev), addr(host) + 8, 64, s) == INVALID_VALUE
    assert cuda.memcpy_async(addr(dev), addr(host), 64, s, kind=5) == INVALID_VALUE
    assert cuda.memcpy_async(addr(dev), addr(host), 0, s) == SUCCESS  # nothing to copy
    assert cuda.stream_query(s) == NOT_READY  # only the gate is queued
    cuda.gate_open(gate)
    assert cuda.stream_synchronize(s) == SUCCESS
    assert (dev == 0).all()
    assert cuda.get_last_error() == INVALID_VALUE


def test_registration_rules(cuda: FakeCuda) -> None:
    a = filled(4096, 0)
    base = addr(a)
    assert cuda.host_register(base, 2048, HOST_REGISTER_PORTABLE) == SUCCESS
    assert cuda.host_register(base + 1024, 2048) == HOST_MEMORY_ALREADY_REGISTERED
    assert cuda.host_register(base - 16, 32) == HOST_MEMORY_ALREADY_REGISTERED
    assert cuda.host_register(base + 2048, 2048) == SUCCESS  # adjacent is fine
    assert cuda.host_register(0, 16) == INVALID_VALUE
    assert cuda.host_register(base, 0) == INVALID_VALUE
    assert cuda.host_unregister(base + 8) == HOST_MEMORY_NOT_REGISTERED
    assert cuda.get_last_error() == HOST_MEMORY_NOT_REGISTERED
    assert cuda.host_unregister(base) == SUCCESS
    assert cuda.host_unregister(base) == HOST_MEMORY_NOT_REGISTERED
    assert cuda.host_register(base, 2048) == SUCCESS
    assert cuda.count("registers") == 3


def test_host_get_device_pointer(cuda: FakeCuda) -> None:
    mapped = pinned(cuda, 256, 0)
    portable = pinned(cuda, 256, 0, flags=HOST_REGISTER_PORTABLE)
    pageable = filled(256, 0)
    assert cuda.host_get_device_pointer(addr(mapped) + 16) == (SUCCESS, addr(mapped) + 16)
    assert cuda.host_get_device_pointer(addr(portable))[0] == INVALID_VALUE
    assert cuda.host_get_device_pointer(addr(pageable))[0] == INVALID_VALUE
    out = ctypes.c_void_p()
    assert cuda.lib.cudaHostGetDevicePointer(ctypes.byref(out), addr(mapped), 1) == INVALID_VALUE
    cuda.set_uva(False)
    assert cuda.host_get_device_pointer(addr(mapped)) == (SUCCESS, addr(mapped) + NON_UVA_OFFSET)


def test_non_uva_device_alias_copies_the_host_memory(cuda: FakeCuda) -> None:
    cuda.set_uva(False)
    s = cuda.stream_create()
    host = pinned(cuda, 64, 8)
    dst = device(cuda, 64, 0)
    _, alias = cuda.host_get_device_pointer(addr(host))
    assert cuda.memcpy_async(addr(dst), alias, 64, s) == SUCCESS
    assert cuda.stream_synchronize(s) == SUCCESS
    assert (dst == 8).all()
    assert cuda.count("pageable_copies") == 0


def test_memcpy_failure_injection(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    src, dst = pinned(cuda, 8, 1), device(cuda, 8, 0)
    cuda.fail_memcpy(2, ILLEGAL_ADDRESS)
    assert cuda.memcpy_async(addr(dst), addr(src), 8, s) == SUCCESS
    assert cuda.get_last_error() == SUCCESS
    assert cuda.memcpy_async(addr(dst), addr(src), 8, s) == ILLEGAL_ADDRESS
    assert cuda.memcpy_async(addr(dst), addr(src), 8, s) == SUCCESS
    assert cuda.sticky() == 0
    assert cuda.get_last_error() == ILLEGAL_ADDRESS
    assert cuda.get_last_error() == SUCCESS
    assert cuda.stream_synchronize(s) == SUCCESS
    assert cuda.count("memcpy_calls") == 3
    cuda.fail_memcpy(1, 999)
    cuda.fail_memcpy(0, 999)
    assert cuda.memcpy_async(addr(dst), addr(src), 8, s) == SUCCESS


# ---- batched copies ----------------------------------------------------------------------


@pytest.mark.parametrize("v2", [False, True])
def test_batch_copies(cuda: FakeCuda, v2: bool) -> None:
    s = cuda.stream_create()
    srcs = [pinned(cuda, 32, i + 1) for i in range(3)]
    dst = device(cuda, 96, 0)
    gate = cuda.stream_gate(s)
    dsts = [addr(dst) + 32 * i for i in range(3)]
    rc, fail = cuda.memcpy_batch(dsts, [addr(a) for a in srcs], [32] * 3, s, order=1, v2=v2)
    assert (rc, fail) == (SUCCESS, SIZE_MAX)
    at_gate(cuda, gate)
    assert (dst == 0).all()
    cuda.gate_open(gate)
    assert cuda.stream_synchronize(s) == SUCCESS
    assert dst.tolist() == [1] * 32 + [2] * 32 + [3] * 32
    assert cuda.last_batch_order() == 1
    assert (cuda.count("batch_ok"), cuda.count("batch_copies")) == (1, 3)
    assert cuda.count("batch_failed") == 0
    assert cuda.count("memcpy_calls") == 0


def test_batch_copies_run_in_order(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    a, b = pinned(cuda, 16, 1), pinned(cuda, 16, 2)
    dst = device(cuda, 16, 0)
    rc, _ = cuda.memcpy_batch([addr(dst), addr(dst)], [addr(a), addr(b)], [16, 16], s)
    assert rc == SUCCESS
    assert cuda.stream_synchronize(s) == SUCCESS
    assert (dst == 2).all()
    assert cuda.last_batch_order() == 3


def test_batch_with_pageable_memory_blocks(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    src, dst = filled(16, 5), device(cuda, 16, 0)
    gate = cuda.stream_gate(s)
    call = Call(lambda: cuda.memcpy_batch([addr(dst)], [addr(src)], [16], s))
    waiting(cuda)
    assert call.blocked()
    cuda.gate_open(gate)
    assert call.finish() == (SUCCESS, SIZE_MAX)
    assert (dst == 5).all()
    assert cuda.count("pageable_copies") == 1


def call_batch_raw(
    cuda: FakeCuda, attrs: list[int], idxs: list[int], n_attrs: int, stream: int
) -> tuple[int, int]:
    src, dst = pinned(cuda, 8, 1), device(cuda, 8, 0)
    one = (ctypes.c_uint64 * 1)(addr(dst))
    two = (ctypes.c_uint64 * 1)(addr(src))
    sizes = (ctypes.c_size_t * 1)(8)
    attr_arr = (MemcpyAttributes * max(len(attrs), 1))(
        *[MemcpyAttributes(srcAccessOrder=o) for o in attrs]
    )
    idx_arr = (ctypes.c_size_t * max(len(idxs), 1))(*idxs)
    fail = ctypes.c_size_t(0)
    rc = cuda.lib.cuMemcpyBatchAsync(
        one, two, sizes, 1, attr_arr, idx_arr, n_attrs, ctypes.byref(fail), stream
    )
    return rc, fail.value


@pytest.mark.parametrize(
    ("orders", "idxs", "n_attrs"),
    [([3], [0], 0), ([3], [1], 1), ([0], [0], 1), ([4], [0], 1)],
    ids=["no-attrs", "first-index-not-0", "order-0", "order-4"],
)
def test_batch_attribute_rules(
    cuda: FakeCuda, orders: list[int], idxs: list[int], n_attrs: int
) -> None:
    s = cuda.stream_create()
    assert call_batch_raw(cuda, orders, idxs, n_attrs, s) == (INVALID_VALUE, SIZE_MAX)
    assert cuda.count("batch_failed") == 1
    assert cuda.stream_query(s) == SUCCESS
    # Driver calls leave the runtime's last error alone.
    assert cuda.get_last_error() == SUCCESS


def test_batch_with_a_bad_entry_enqueues_nothing(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    src, dst = pinned(cuda, 16, 1), device(cuda, 16, 0)
    rc, fail = cuda.memcpy_batch([addr(dst), addr(dst) + 8], [addr(src), addr(src)], [8, 16], s)
    assert (rc, fail) == (INVALID_VALUE, 1)
    assert cuda.stream_synchronize(s) == SUCCESS
    assert (dst == 0).all()
    assert cuda.memcpy_batch([], [], [], s) == (INVALID_VALUE, SIZE_MAX)


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("mode", [1, 2, 3])
def test_batch_failure_injection(cuda: FakeCuda, mode: int, v2: bool) -> None:
    s = cuda.stream_create()
    srcs = [pinned(cuda, 8, i + 1) for i in range(4)]
    dst = device(cuda, 32, 0)
    dsts = [addr(dst) + 8 * i for i in range(4)]
    cuda.fail_batch(mode, index=2, code=ILLEGAL_ADDRESS)

    def batch(n: int) -> tuple[int, int]:
        return cuda.memcpy_batch(dsts[:n], [addr(a) for a in srcs[:n]], [8] * n, s, v2=v2)

    expected_idx = SIZE_MAX if mode == 1 or v2 else 2
    assert batch(4) == (ILLEGAL_ADDRESS, expected_idx)
    assert cuda.stream_synchronize(s) == SUCCESS
    assert (dst == 0).all()
    # Modes 2 and 3 spare batches with no copy at the index.
    assert batch(2)[0] == (ILLEGAL_ADDRESS if mode == 1 else SUCCESS)
    # Mode 3 fired once and is off.
    assert batch(4)[0] == (SUCCESS if mode == 3 else ILLEGAL_ADDRESS)
    assert cuda.stream_synchronize(s) == SUCCESS
    ok = {1: 0, 2: 1, 3: 2}[mode]
    assert cuda.count("batch_ok") == ok
    assert cuda.count("batch_failed") == 3 - ok
    assert cuda.sticky() == 0
    cuda.fail_batch(0)
    assert batch(4)[0] == SUCCESS


# ---- gates on submission and registration -------------------------------------------------


def test_hold_memcpy_blocks_inside_the_call(cuda: FakeCuda) -> None:
    s, other = cuda.stream_create(), cuda.stream_create()
    src, dst = pinned(cuda, 8, 1), device(cuda, 8, 0)
    cuda.hold_memcpy(s, True)
    assert cuda.memcpy_async(addr(dst), addr(src), 8, other) == SUCCESS
    memcpy = Call(lambda: cuda.memcpy_async(addr(dst), addr(src), 8, s))
    batch = Call(lambda: cuda.memcpy_batch([addr(dst)], [addr(src)], [8], s))
    wait_until(lambda: cuda.holding() == 2, "both calls held")
    assert memcpy.blocked()
    cuda.hold_memcpy(s, False)
    assert memcpy.finish() == SUCCESS
    assert batch.finish() == (SUCCESS, SIZE_MAX)
    assert cuda.holding() == 0


def test_destroying_a_held_stream_releases_its_callers(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    src, dst = pinned(cuda, 8, 1), device(cuda, 8, 0)
    cuda.hold_memcpy(s, True)
    memcpy = Call(lambda: cuda.memcpy_async(addr(dst), addr(src), 8, s))
    wait_until(lambda: cuda.holding() == 1, "the call held")
    assert cuda.stream_destroy(s) == SUCCESS
    assert memcpy.finish() == INVALID_HANDLE
    assert (dst == 0).all()


def test_register_gate_and_failure_injection(cuda: FakeCuda) -> None:
    a = filled(4096, 0)
    cuda.register_gate(True)
    call = Call(lambda: cuda.host_register(addr(a), 1024))
    wait_until(lambda: cuda.registers_waiting() == 1, "the registration held")
    assert call.blocked()
    cuda.register_gate(False)
    assert call.finish() == SUCCESS
    assert cuda.registers_waiting() == 0
    cuda.fail_register(2, 2)
    assert cuda.host_register(addr(a) + 1024, 1024) == SUCCESS
    assert cuda.host_register(addr(a) + 2048, 1024) == 2
    assert cuda.host_unregister(addr(a) + 2048) == HOST_MEMORY_NOT_REGISTERED
    assert cuda.host_register(addr(a) + 2048, 1024) == SUCCESS
    assert cuda.count("registers") == 3


# ---- sticky faults ---------------------------------------------------------------------------


def test_sticky_fault_fails_every_call(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    ev = cuda.event_create()
    src, dst = pinned(cuda, 8, 1), device(cuda, 8, 0)
    cuda.fault(LAUNCH_FAILURE)
    assert cuda.sticky() == LAUNCH_FAILURE
    assert cuda.set_device(0) == LAUNCH_FAILURE
    with pytest.raises(CudaError) as err:
        cuda.get_device()
    assert err.value.code == LAUNCH_FAILURE
    with pytest.raises(CudaError):
        cuda.stream_create()
    assert cuda.memcpy_async(addr(dst), addr(src), 8, s) == LAUNCH_FAILURE
    assert cuda.memcpy_batch([addr(dst)], [addr(src)], [8], s) == (LAUNCH_FAILURE, SIZE_MAX)
    assert cuda.stream_synchronize(s) == LAUNCH_FAILURE
    assert cuda.event_query(ev) == LAUNCH_FAILURE
    assert cuda.host_register(addr(filled(8, 0)), 8) == LAUNCH_FAILURE
    assert cuda.launch_copy(s, 0, 0, 0, 0, True) == LAUNCH_FAILURE
    text = ctypes.c_char_p()
    assert cuda.lib.cuGetErrorString(LAUNCH_FAILURE, ctypes.byref(text)) == SUCCESS
    for _ in range(3):
        assert cuda.get_last_error() == LAUNCH_FAILURE
        assert cuda.peek_at_last_error() == LAUNCH_FAILURE
    assert on_thread(cuda.get_last_error) == LAUNCH_FAILURE
    assert (dst == 0).all()


def test_sticky_fault_drops_queued_work(cuda: FakeCuda) -> None:
    s = cuda.stream_create()
    src, dst = filled(8, 1), device(cuda, 8, 0)
    gate = cuda.stream_gate(s)
    call = Call(lambda: cuda.memcpy_async(addr(dst), addr(src), 8, s))
    waiting(cuda)  # the pageable copy is queued behind the gate, its caller waiting for it
    assert call.blocked()
    cuda.fault(ILLEGAL_ADDRESS)
    # The stream may drop the gate before this: the gate stays the test's to open.
    cuda.gate_open(gate)
    assert call.finish() == ILLEGAL_ADDRESS
    wait_until(lambda: cuda.stream_pending(s) == 0, "the stream through its queued work")
    assert (dst == 0).all()
    with pytest.raises(ValueError, match="no pending gate"):
        cuda.gate_open(gate)  # once only


# ---- reset ---------------------------------------------------------------------------------


def test_reset_clears_everything(cuda: FakeCuda) -> None:
    cuda.reset(2)
    assert cuda.set_device(1) == SUCCESS
    s = cuda.stream_create()
    ev = cuda.event_create()
    host = pinned(cuda, 64, 1)
    dev = device(cuda, 64, 0, dev=1)
    gate = cuda.stream_gate(s)
    assert cuda.memcpy_async(addr(dev), addr(host), 64, s) == SUCCESS
    assert cuda.event_record(ev, s) == SUCCESS
    assert cuda.memcpy_batch([addr(dev)], [addr(host)], [64], s, order=2)[0] == SUCCESS
    # Callers stuck inside the library: one synchronizing on the event behind the gate, one
    # held in a submission to the gated stream.
    waiter = Call(lambda: cuda.event_synchronize(ev))
    waiting(cuda)
    cuda.hold_memcpy(s, True)
    held = Call(lambda: cuda.memcpy_async(addr(dev), addr(host), 64, s))
    wait_until(lambda: cuda.holding() == 1, "the submission held")
    cuda.fail_memcpy(1, ILLEGAL_ADDRESS)
    cuda.fail_batch(1, code=ILLEGAL_ADDRESS)
    cuda.fail_register(1, ILLEGAL_ADDRESS)
    cuda.set_uva(False)
    cuda.fault(LAUNCH_FAILURE)
    # The fault ends a synchronize, as CUDA's sticky error does.
    assert waiter.finish() == LAUNCH_FAILURE
    # A stream stuck at a gate and a caller still stuck inside must not block the reset; the
    # reset destroys the stream the caller was held on.
    assert held.blocked()
    cuda.reset()
    assert held.finish() == INVALID_HANDLE
    assert (dev == 0).all()  # queued work was dropped, not run
    assert cuda.sticky() == 0
    assert cuda.get_device() == 0
    assert cuda.get_last_error() == SUCCESS
    assert cuda.touched_devices() == set()
    assert cuda.last_batch_order() == 0
    assert cuda.live_streams() == 0
    counters = [
        "memcpy_calls",
        "pageable_copies",
        "batch_ok",
        "batch_failed",
        "batch_copies",
        "kernel_launches",
        "cross_device_calls",
        "event_records",
        "streams_created",
        "registers",
    ]
    assert all(cuda.count(name) == 0 for name in counters)
    assert cuda.set_device(1) == INVALID_DEVICE
    assert cuda.get_last_error() == INVALID_DEVICE
    with pytest.raises(ValueError, match="no pending gate"):
        cuda.gate_open(gate)
    assert cuda.stream_synchronize(s) == INVALID_HANDLE
    assert cuda.event_query(ev) == INVALID_HANDLE
    # Registrations and device memory are gone; injections are off; UVA is back.
    assert cuda.host_register(addr(host), 64) == SUCCESS
    assert cuda.host_get_device_pointer(addr(host)) == (SUCCESS, addr(host))
    cuda.add_device_memory(0, addr(dev), 64)
    s0 = cuda.stream_create()
    assert cuda.memcpy_async(addr(dev), addr(host), 64, s0) == SUCCESS
    assert cuda.memcpy_batch([addr(dev)], [addr(host)], [64], s0)[0] == SUCCESS
    assert cuda.stream_synchronize(s0) == SUCCESS
    assert (dev == 1).all()
    with pytest.raises(ValueError, match="devices"):
        cuda.reset(0)
