"""kvcache's vLLM worker trusts no device pointer (vLLM 0.34.0's ``DevicePointers``).

Under vLLM 0.34.0 the connector resolves each job's ``GPULoadStoreSpec`` into one device address
and size per (group, data reference, block) and hands the worker those instead of block ids.
Each case here starts from the pointers vLLM's own ``resolve_device_pointers`` makes for a
valid job, changes one thing (a pointer outside its tensor, between two block starts, in
another reference's tensor, disagreeing with its group's first reference; a wrong size or
count; arrays of another dtype, shape or type; not a ``DevicePointers`` at all), and submits
it as a store and as a load: the worker must raise exactly the ``kvcache`` class the case names
(also the matching builtin), queue nothing, write no byte of the host pool or the KV tensors,
and then take the unchanged job under the same job id. Under vLLM 0.33.0 jobs carry block ids
and these cases do not apply (tests/worker/test_worker_api.py covers that front's refusals).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvcache import InvalidArgumentError, InvalidTypeError, OutOfRangeError
from tests.support.hostile import raises_exactly
from tests.support.oracle import require_oracle
from tests.support.vllm_worker_oracle import (
    Geometry,
    RankPair,
    build_pairs,
    device_bytes,
    pointers_release,
    vllm_on_cpu,
)

pytestmark = pytest.mark.oracle

# Two groups: the first over both tensors (the second strided: 64 padding bytes per block),
# the second over the first tensor's payload only.
GEOMETRY = Geometry(((256, 256), (256, 320)), (((0, 256), (1, 192)), ((0, 128),)), 32, 2)
# Group 0: blocks 4, 9, 6 from slot 1; group 1: blocks 11, 12 from slot 0.
BLOCKS, SIZES, STARTS, CHUNKS = [4, 9, 6, 11, 12], [3, 2], [1, 0], [0, 1, 2]

Change = Callable[[Any, RankPair], Any]


def with_array(field: str, i: int, value: Callable[[int, RankPair], int]) -> Change:
    """Entry ``i`` of ``ptrs`` or ``sizes`` replaced by ``value(old, pair)``."""

    def change(ptrs: Any, pair: RankPair) -> Any:
        array = getattr(ptrs, field).copy()
        array[i] = np.uint64(value(int(array[i]), pair))
        return dataclasses.replace(ptrs, **{field: array})

    return change


def replaced(**fields: Any) -> Change:
    return lambda ptrs, pair: dataclasses.replace(
        ptrs, **{k: v(ptrs) if callable(v) else v for k, v in fields.items()}
    )


def base(pair: RankPair, tensor: int) -> int:
    return int(pair.our_tensors[tensor].data_ptr())


# Flat order: group 0 reference 0 (tensor 0) blocks at 0..2, reference 1 (tensor 1) at 3..5,
# then group 1 reference 0 (tensor 0) at 6..7.
CASES: dict[str, tuple[Change, type[BaseException]]] = {
    "before-its-tensor": (
        with_array("ptrs", 0, lambda p, pair: base(pair, 0) - 256),
        OutOfRangeError,
    ),
    "past-its-last-block": (
        with_array("ptrs", 1, lambda p, pair: base(pair, 0) + 32 * 256),
        OutOfRangeError,
    ),
    "in-another-tensor": (
        with_array("ptrs", 4, lambda p, pair: base(pair, 0) + 9 * 256),
        OutOfRangeError,
    ),
    "null": (with_array("ptrs", 6, lambda p, pair: 0), OutOfRangeError),
    "all-ones": (with_array("ptrs", 7, lambda p, pair: 2**64 - 1), OutOfRangeError),
    "misaligned": (with_array("ptrs", 2, lambda p, pair: p + 8), InvalidArgumentError),
    "in-the-padding": (with_array("ptrs", 5, lambda p, pair: p + 256), InvalidArgumentError),
    "references-disagree": (with_array("ptrs", 3, lambda p, pair: p + 320), InvalidArgumentError),
    "size-not-the-payload": (with_array("sizes", 4, lambda s, pair: 256), InvalidArgumentError),
    "size-zero": (with_array("sizes", 6, lambda s, pair: 0), InvalidArgumentError),
    "block-count-short": (replaced(group_block_counts=(3, 1)), InvalidArgumentError),
    "block-counts-missing": (replaced(group_block_counts=(3,)), InvalidArgumentError),
    "block-counts-extra": (replaced(group_block_counts=(3, 2, 0)), InvalidArgumentError),
    "reference-counts": (replaced(group_data_ref_counts=(1, 2)), InvalidArgumentError),
    "reference-counts-missing": (replaced(group_data_ref_counts=(2,)), InvalidArgumentError),
    "negative-count": (replaced(group_block_counts=(-3, 2)), InvalidArgumentError),
    "float-count": (replaced(group_block_counts=(3.0, 2)), InvalidTypeError),
    "counts-none": (replaced(group_block_counts=None), InvalidTypeError),
    "pointers-truncated": (replaced(ptrs=lambda p: p.ptrs[:-1]), InvalidArgumentError),
    "sizes-truncated": (replaced(sizes=lambda p: p.sizes[:-1]), InvalidArgumentError),
    "pointers-int64": (replaced(ptrs=lambda p: p.ptrs.astype(np.int64)), InvalidTypeError),
    "pointers-byte-swapped": (replaced(ptrs=lambda p: p.ptrs.astype(">u8")), InvalidTypeError),
    "pointers-list": (replaced(ptrs=lambda p: p.ptrs.tolist()), InvalidTypeError),
    "pointers-two-d": (replaced(ptrs=lambda p: p.ptrs.reshape(1, -1)), InvalidTypeError),
    "sizes-int32": (replaced(sizes=lambda p: p.sizes.astype(np.int32)), InvalidTypeError),
    "sizes-float": (replaced(sizes=lambda p: p.sizes.astype(np.float64)), InvalidTypeError),
    "block-indices-negative": (replaced(block_indices=(-1, 0)), InvalidArgumentError),
    "block-indices-missing": (replaced(block_indices=(1,)), InvalidArgumentError),
    "a-gpu-spec": (lambda ptrs, pair: gpu_spec(), InvalidTypeError),
    "none": (lambda ptrs, pair: None, InvalidTypeError),
}


def gpu_spec() -> Any:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return GPULoadStoreSpec(BLOCKS, SIZES, STARTS)


def resolved(pair: RankPair) -> Any:
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    return resolve_device_pointers(gpu_spec(), pair.our_caches)


def state(pair: RankPair) -> tuple[Any, ...]:
    worker = pair.our_worker
    engine = worker.engine
    engine.wait()
    return (
        bytes(memoryview(worker.pool)),
        device_bytes(pair.our_tensors),
        engine.in_flight,
        engine._issued,
        dict(worker._by_vllm),
        engine.jobs_by_method,
    )


@pytest.fixture(scope="module")
def pair() -> Any:
    require_oracle()
    if not pointers_release():
        pytest.skip("vLLM 0.33.0 hands its worker block ids, not device pointers")
    with vllm_on_cpu():
        (built,) = build_pairs(GEOMETRY, cpu_bytes_to_use=1 << 20, seed=13)
    yield built
    built.shutdown()


@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_hostile_pointer_job_is_refused_typed_and_changes_nothing(
    pair: RankPair, name: str, store: bool
) -> None:
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    change, expected = CASES[name]
    worker = pair.our_worker
    good = resolved(pair)
    bad = change(good, pair)
    job_id = 100 + 2 * list(CASES).index(name) + store
    before = state(pair)
    if store:
        raises_exactly(lambda: worker.submit_store(job_id, bad, CPULoadStoreSpec(CHUNKS)), expected)
    else:
        raises_exactly(lambda: worker.submit_load(job_id, CPULoadStoreSpec(CHUNKS), bad), expected)
    assert state(pair) == before
    assert worker.get_finished() == []
    # The unchanged job goes through under the same id: the refusal consumed nothing.
    if store:
        assert worker.submit_store(job_id, good, CPULoadStoreSpec(CHUNKS))
    else:
        assert worker.submit_load(job_id, CPULoadStoreSpec(CHUNKS), good)
    worker.wait({job_id})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(job_id, True)]


def test_every_class_is_also_the_builtin() -> None:
    assert issubclass(OutOfRangeError, IndexError)
    assert issubclass(InvalidArgumentError, ValueError)
    assert issubclass(InvalidTypeError, TypeError)


def test_the_resolved_pointers_are_the_job_vllms_worker_copies(pair: RankPair) -> None:
    """The valid job the cases start from, through both workers: the same host bytes and the
    same result, so the cases change a job vLLM's own worker accepts."""
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    with vllm_on_cpu():
        results = []
        for worker, caches in pair.workers():
            ptrs = resolve_device_pointers(gpu_spec(), caches)
            assert worker.submit_store(1, ptrs, CPULoadStoreSpec(CHUNKS))
            worker.wait({1})
            (r,) = worker.get_finished()
            results.append((r.job_id, r.success, r.transfer_size))
    assert results[0] == results[1] == (1, True, 3 * (256 + 192) + 2 * 128)
    assert pair.our_host().numpy().tobytes() == (
        pair.vllm_host_slot().contiguous().numpy().tobytes()
    )
