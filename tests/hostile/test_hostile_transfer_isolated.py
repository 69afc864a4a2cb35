"""Hostile transfer inputs that could end the process rather than raise: each runs in a fresh
interpreter under a memory watchdog, so an abort, a panic or a segfault fails its case instead
of the test run.

Every case must raise exactly the ``KvCacheError`` subclass it names (also the builtin a
caller catches) and leave the engine usable and unchanged: the pool's bytes, the layers, the
jobs in flight and the next job id. Found by reading the decoding and sizing code for counts
that size allocations, indexes that a count can push past an array, and addresses a caller can
hand to Rust.
"""

from __future__ import annotations

import pytest

from tests.support.hostile import run_isolated

pytest.importorskip("torch")

# The engine of the report: two int8 layers, a pool of 4 chunks of 1 KiB, 4 blocks per chunk,
# one group over both layers and one group without references (what vLLM 0.34's worker can
# hand over for a pipeline stage holding none of that group's layers).
SCRIPT = """
import numpy as np, torch
import kvcache
from kvcache.transfer import HostChunkPool, TransferEngine

layers = [torch.arange(8 * 64, dtype=torch.int32).to(torch.int8).view(8, 64) for _ in range(2)]
pool = HostChunkPool(4, 1024, pin=False)
np.frombuffer(pool, dtype=np.uint8)[:] = np.arange(pool.nbytes, dtype=np.uint8)
engine = TransferEngine(
    layers, pool, blocks_per_chunk=4, groups=[[(0, 64), (1, 64)], []], offsets=[0, 256]
)
z = np.zeros(0, np.uint64)

def ptrs_of(blocks):
    out = [l.data_ptr() + b * 64 for l in layers for b in blocks]
    return np.array(out, np.uint64), np.full(len(out), 64, np.uint64)

def state():
    engine.wait()
    return (bytes(memoryview(pool)), [bytes(l.numpy().tobytes()) for l in layers],
            engine.in_flight)

before = state()
try:
    {call}
    outcome = "returned"
except BaseException as exc:
    outcome = type(exc).__name__
    message = str(exc)
else:
    message = ""
unchanged = state() == before
# Still usable: a store and a load round trip.
job = engine.store([0, 1, 2, 3], [1], group_sizes=[4, 0], block_indices=[0, 0])
engine.wait([job])
ok = (job, True) in engine.poll()
report(outcome=outcome, message=message, unchanged=unchanged, usable=ok)
"""

CASES = [
    # The reported abort: a count of 2**40 blocks for the group without references sized an
    # 8 TiB allocation ("memory allocation of 8796093022208 bytes failed", SIGABRT).
    (
        "empty-group-2**40-blocks",
        "engine.block_ids_from_pointers(z, z, group_block_counts=[0, 2**40], "
        "group_data_ref_counts=[2, 0])",
        "InvalidArgumentError",
    ),
    # Any block count for the group without references indexed its missing first reference
    # (a Rust panic, PanicException).
    (
        "empty-group-beyond-the-pool",
        "engine.block_ids_from_pointers(z, z, group_block_counts=[0, 17], "
        "group_data_ref_counts=[2, 0])",
        "InvalidArgumentError",
    ),
    (
        "empty-group-2**63",
        "engine.block_ids_from_pointers(z, z, group_block_counts=[0, 2**63 - 1], "
        "group_data_ref_counts=[2, 0])",
        "InvalidArgumentError",
    ),
    (
        "counts-beyond-uint64",
        "engine.block_ids_from_pointers(z, z, group_block_counts=[0, 2**64], "
        "group_data_ref_counts=[2, 0])",
        "InvalidArgumentError",
    ),
    (
        "counts-2**64-1",
        "engine.block_ids_from_pointers(z, z, group_block_counts=[2**64 - 1, 0], "
        "group_data_ref_counts=[2, 0])",
        "InvalidArgumentError",
    ),
    # block count x reference count overflows 64 bits.
    (
        "pointer-count-overflows",
        "engine.block_ids_from_pointers(z, z, group_block_counts=[2**63, 1], "
        "group_data_ref_counts=[2, 0])",
        "InvalidArgumentError",
    ),
    (
        "pointer-count-near-2**62",
        "engine.block_ids_from_pointers(z, z, group_block_counts=[2**62, 0], "
        "group_data_ref_counts=[2, 0])",
        "InvalidArgumentError",
    ),
    # The counts' entries drained without bound.
    (
        "endless-counts",
        "import itertools; engine.block_ids_from_pointers(z, z, "
        "group_block_counts=itertools.repeat(0), group_data_ref_counts=[2, 0])",
        "InvalidArgumentError",
    ),
    # Spans of a job whose total overflows when summed.
    (
        "spans-overflow",
        "engine.store([0], [0], group_sizes=[2**63, 2**63], block_indices=[0, 0])",
        "InvalidArgumentError",
    ),
    (
        "spans-near-2**62",
        "engine.load([0], [0], group_sizes=[2**62, 2**62], block_indices=[0, 0])",
        "InvalidArgumentError",
    ),
    (
        "block-index-2**64",
        "engine.load([0], [0], group_sizes=[1, 0], block_indices=[2**64, 0])",
        "InvalidArgumentError",
    ),
    # Registration once took function addresses from Python and called them: any int
    # crashed the process. It takes a runtime loaded by name now, and nothing else.
    (
        "register-with-an-address",
        "pool._register(0xdeadbeef, 3, 1 << 20)",
        "InvalidTypeError",
    ),
    (
        "register-with-addresses-by-keyword",
        "pool._register(api=id(pool), flags=3, max_piece_bytes=1 << 20, background=True)",
        "InvalidTypeError",
    ),
    # A library that is not a CUDA runtime is refused when it is loaded, not called.
    (
        "runtime-that-is-not-cuda",
        "kvcache._core.CudaApi('libc.so.6')",
        "TransferError",
    ),
    (
        "runtime-path-with-nul",
        "kvcache._core.CudaApi('libcudart\\x00.so')",
        "InvalidArgumentError",
    ),
    # glibc's dlopen copies the name onto the stack: 10 MB of it was a SIGSEGV.
    (
        "runtime-path-of-megabytes",
        "kvcache._core.CudaApi('x' * 10**7)",
        "InvalidArgumentError",
    ),
    ("runtime-path-none", "kvcache._core.CudaApi(None)", "InvalidTypeError"),
    # A real job decoded and run, for contrast: the group without references gets
    # placeholders, nothing of it is copied.
    (
        "empty-group-placeholders-load",
        "p, s = ptrs_of([5, 6]); ids = engine.block_ids_from_pointers(p, s, "
        "group_block_counts=[2, 3], group_data_ref_counts=[2, 0]); "
        "assert ids.tolist() == [5, 6, 0, 0, 0], ids; "
        "engine.load([0, 1], ids, group_sizes=[2, 3], block_indices=[0, 0]); "
        "raise kvcache.InvalidStateError('decoded and queued')",
        "InvalidStateError",
    ),
]


@pytest.mark.parametrize(("call", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_transfer_input_raises_in_a_fresh_interpreter(call: str, expected: str) -> None:
    run = run_isolated(SCRIPT.replace("{call}", call), max_rss=2048 << 20)
    report = run.check()  # an abort, a panic that escaped, a segfault: fails here
    assert report["outcome"] == expected, report
    assert "panicked" not in report["message"], report
    if expected != "InvalidStateError":  # the contrast case queued a real load on purpose
        assert report["unchanged"], report
    assert report["usable"], report


# Device pointer arrays of any stride, dtype and length (what vLLM 0.34's worker is handed as
# `DevicePointers`): the counts, then the arrays' lengths, are checked before anything is
# sized from them or copied. A zero-stride view of 2**30 or 2**40 entries was copied whole
# first ("memory allocation of 8589934592 bytes failed", SIGABRT, under `ulimit -v` 8 GiB).
# Each case runs under that address-space limit, as the hostile round did.
ZERO = "np.lib.stride_tricks.as_strided(np.zeros(1, {dtype}), ({shape}), ({strides}))"


def zero_stride(length: str, dtype: str = "np.uint64") -> str:
    return ZERO.format(dtype=dtype, shape=f"{length},", strides="0,")


POINTER_CASES = [
    (
        "zero-stride-2**30-counts-disagree",
        f"p = {zero_stride('1 << 30')}; engine.block_ids_from_pointers(p, p, "
        "group_block_counts=[1, 0], group_data_ref_counts=[2, 0])",
        "InvalidArgumentError",
    ),
    (
        "zero-stride-2**40-counts-disagree",
        f"p = {zero_stride('1 << 40')}; engine.block_ids_from_pointers(p, p, "
        "group_block_counts=[1, 0], group_data_ref_counts=[2, 0])",
        "InvalidArgumentError",
    ),
    # Counts that agree with the arrays: the blocks they name are past the bound.
    (
        "zero-stride-2**30-counts-agree",
        f"p = {zero_stride('1 << 30')}; engine.block_ids_from_pointers(p, p, "
        "group_block_counts=[1 << 29, 0], group_data_ref_counts=[2, 0])",
        "InvalidArgumentError",
    ),
    (
        "zero-stride-2**40-counts-agree",
        f"p = {zero_stride('1 << 40')}; engine.block_ids_from_pointers(p, p, "
        "group_block_counts=[1 << 39, 0], group_data_ref_counts=[2, 0])",
        "InvalidArgumentError",
    ),
    (
        "zero-stride-sizes-only",
        f"p, _ = ptrs_of([5, 6]); s = {zero_stride('1 << 40')}; "
        "engine.block_ids_from_pointers(p, s, group_block_counts=[2, 0], "
        "group_data_ref_counts=[2, 0])",
        "InvalidArgumentError",
    ),
    # Within the bound, where the copy of a strided array is what the allocator refuses.
    (
        "strided-within-the-bound-out-of-memory",
        f"p = {zero_stride('2 * kvcache._core.MAX_ITEMS')}; limited(4 << 20, lambda: "
        "engine.block_ids_from_pointers(p, p, group_block_counts=[kvcache._core.MAX_ITEMS, 0], "
        "group_data_ref_counts=[2, 0]))",
        "OutOfMemoryError",
    ),
    # Any other dtype, shape or byte order, at any length, is refused before it is read.
    (
        "zero-stride-uint8",
        f"p = {zero_stride('1 << 40', 'np.uint8')}; engine.block_ids_from_pointers(p, p, "
        "group_block_counts=[1, 0], group_data_ref_counts=[2, 0])",
        "InvalidTypeError",
    ),
    (
        "zero-stride-float64",
        f"p = {zero_stride('1 << 40', 'np.float64')}; engine.block_ids_from_pointers(p, p, "
        "group_block_counts=[1, 0], group_data_ref_counts=[2, 0])",
        "InvalidTypeError",
    ),
    (
        "zero-stride-big-endian",
        "p = " + zero_stride("1 << 40", "np.dtype('>u8')") + "; "
        "engine.block_ids_from_pointers(p, p, group_block_counts=[1, 0], "
        "group_data_ref_counts=[2, 0])",
        "InvalidTypeError",
    ),
    (
        "zero-stride-2-d",
        "p = "
        + ZERO.format(dtype="np.uint64", shape="1 << 20, 1 << 20", strides="0, 0")
        + "; engine.block_ids_from_pointers(p, p, group_block_counts=[1, 0], "
        "group_data_ref_counts=[2, 0])",
        "InvalidTypeError",
    ),
    # A strided (copied) pair of arrays that names real blocks decodes as a contiguous one.
    (
        "strided-pointers-decode",
        "p, s = ptrs_of([5, 6]); p, s = np.repeat(p, 2)[::2], np.repeat(s, 2)[::2]; "
        "assert not p.flags.c_contiguous; ids = engine.block_ids_from_pointers(p, s, "
        "group_block_counts=[2, 0], group_data_ref_counts=[2, 0]); "
        "assert ids.tolist() == [5, 6], ids; raise kvcache.InvalidStateError('decoded')",
        "InvalidStateError",
    ),
]


@pytest.mark.parametrize(
    ("call", "expected"), [c[1:] for c in POINTER_CASES], ids=[c[0] for c in POINTER_CASES]
)
def test_hostile_pointer_arrays_raise_under_an_address_space_limit(
    call: str, expected: str
) -> None:
    script = "limit_address_space(8 << 30)\n" + SCRIPT.replace("{call}", call)
    report = run_isolated(script, max_rss=2048 << 20).check()
    assert report["outcome"] == expected, report
    assert report["unchanged"], report
    assert report["usable"], report


# The same arrays through vLLM 0.34's worker front, which hands `DevicePointers` to the engine.
FRONT = """
from vllm.v1.kv_offload.base import DevicePointers
from kvcache.vllm._fronts import PointerFront

p = {array}
job = DevicePointers(ptrs=p, sizes=p, group_block_counts=(1, 0), group_data_ref_counts=(2, 0),
                     block_indices=(0, 0))
PointerFront().device_job(engine, job)
"""


@pytest.mark.parametrize("length", ["1 << 30", "1 << 40"])
def test_zero_stride_device_pointers_through_the_worker_front_raise(length: str) -> None:
    base = pytest.importorskip("vllm.v1.kv_offload.base")
    if not hasattr(base, "DevicePointers"):
        pytest.skip("this vLLM release hands the worker block ids, not pointers")
    call = "exec(" + repr(FRONT.format(array=zero_stride(length))) + ")"
    script = "limit_address_space(8 << 30)\n" + SCRIPT.replace("{call}", call)
    report = run_isolated(script, max_rss=2048 << 20, timeout=300).check()
    assert report["outcome"] == "InvalidArgumentError", report
    assert report["unchanged"], report


# A load vLLM 0.33's worker refuses is parsed once more, to split it around a repeated
# destination: that second read was unbounded. A spec whose block ids became a zero-stride
# view of 2**40 (they are an attribute, set after the spec checked them) or whose group sizes
# never end was read whole (MemoryError, or memory until the process was killed). The worker
# refuses each with the engine's typed error now.
WORKER = """
import itertools
import numpy as np
from tests.support.vllm_worker_oracle import Geometry, build_pairs, vllm_on_cpu
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

def load(mutate):  # a load naming block 0 twice, its spec changed by `mutate` once checked
    spec = GPULoadStoreSpec([0, 0], [2], [0])
    mutate(spec)
    pair.our_worker.submit_load(1, CPULoadStoreSpec([0]), spec)

class Endless:  # says it holds one size, never ends
    def __len__(self):
        return 1
    def __iter__(self):
        return itertools.repeat(1)

with vllm_on_cpu():
    (pair,) = build_pairs(Geometry(((256, 256),), (((0, 256),),), 64, 2),
                          cpu_bytes_to_use=1 << 20, seed=6)
    try:
        {call}
        outcome = "returned"
    except BaseException as exc:
        outcome = type(exc).__name__
    pair.shutdown()
report(outcome=outcome)
"""


@pytest.mark.parametrize(
    "call",
    [
        "load(lambda s: setattr(s, 'block_ids', np.broadcast_to(np.int32(0), (1 << 40,))))",
        "load(lambda s: setattr(s, 'group_sizes', Endless()))",
    ],
    ids=["zero-stride-block-ids", "endless-group-sizes"],
)
def test_a_refused_load_is_not_read_whole_for_repeats(call: str) -> None:
    from tests.support.vllm_worker_oracle import pointers_release

    pytest.importorskip("vllm")
    if pointers_release():
        pytest.skip("vLLM 0.34 hands the worker pointers, decoded within bounds")
    script = "limit_address_space(8 << 30)\n" + WORKER.replace("{call}", call)
    report = run_isolated(script, max_rss=2048 << 20, timeout=300).check()
    assert report["outcome"] == "InvalidArgumentError", report


# The worker's `wait` spun for ever on job ids that never end (none of them its own).
@pytest.mark.parametrize(
    "job_ids", ["itertools.repeat(7)", "range(1 << 62)"], ids=["endless", "range-2**62"]
)
def test_the_workers_wait_reads_job_ids_within_the_bound(job_ids: str) -> None:
    pytest.importorskip("vllm")
    script = WORKER.replace("{call}", f"pair.our_worker.wait({job_ids})")
    report = run_isolated(script, max_rss=2048 << 20, timeout=300).check()
    assert report["outcome"] == "InvalidArgumentError", report
