"""Untrusted counts never size an allocation, never abort, and never narrow a chunk id.

An eviction count, a cache capacity or a manager's ``num_chunks`` comes from the user; before
it is compared with what exists it must not reserve memory in proportion to it (a failed
reservation aborts the interpreter). Each case runs in a fresh interpreter watched for memory:
a regression fails one test instead of killing the test run, and a runaway allocation is
stopped before it takes the machine down.

Memory is read from the child's own ``/proc/self/status``: ``VmPeak`` (address space ever
reserved: an unused ``Vec::with_capacity`` shows there) around an eviction, ``VmRSS`` around
a manager's construction (memory that grows with use, as vLLM's manager does, is allowed a
generous fixed bound, not a bound per chunk).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

import kvcache
from tests.support.hostile import Isolated, run_isolated
from tests.support.keys import make_key

MiB = 1 << 20
# Far below any allocation proportional to the counts used here (10**8 chunks x 16 bytes is
# 1.6 GB; an eviction of 10**8 keys reserves 400 MB), far above the interpreter's own noise.
ADDRESS_SPACE_BOUND = 64 * MiB
RSS_BOUND = 64 * MiB

# Chunk ids reach vLLM as np.int32 arrays (CPULoadStoreSpec.block_ids), so a manager holds at
# most 2**31 - 1 chunks: every id it can hand out fits the dtype.
MAX_CHUNKS = 2**31 - 1


# --- eviction counts --------------------------------------------------------------------------

EVICT_SCRIPT = """
import kvcache
policy = kvcache.{cls}(4)
for i in range(4):
    chunk = kvcache.ChunkStatus(i)
    chunk.ref_cnt = 0
    policy.insert(bytes([i]) * 36, chunk)
before = repr(policy._debug_state())
peak = status("VmPeak")
try:
    result = policy.evict({n}, set())
    outcome = repr(result)
except BaseException as exc:
    outcome = type(exc).__name__ + ": " + str(exc)
grown = status("VmPeak") - peak
policy.validate()
report(outcome=outcome, unchanged=repr(policy._debug_state()) == before, reserved=grown)
"""


def evict_cases() -> list[Any]:
    cases = []
    for cls in ("LRUCachePolicy", "ARCCachePolicy"):
        for label, n, xfail in [
            ("5", 5, None),  # one more than resident: the ordinary None
            ("10**8", 10**8, None),
            ("2**33", 2**33, None),
            ("2**40", 2**40, None),
            ("2**62", 2**62, None),
            ("2**63-1", 2**63 - 1, None),
            ("2**64", 2**64, None),
            ("2**100", 2**100, None),
        ]:
            marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
            cases.append(pytest.param(cls, n, id=f"{cls}-{label}", marks=marks))
    return cases


@pytest.mark.parametrize(("cls", "n"), evict_cases())
def test_evicting_more_than_exists_returns_none_without_reserving(cls: str, n: int) -> None:
    run = run_isolated(EVICT_SCRIPT.format(cls=cls, n=n))
    report = run.check()
    assert report["outcome"] == "None"
    assert report["unchanged"]
    assert report["reserved"] < ADDRESS_SPACE_BOUND, (
        f"evict({n}) reserved {report['reserved'] / MiB:.0f} MiB of address space"
    )


# --- managers of many chunks ------------------------------------------------------------------

MANAGER_SCRIPT = """
import numpy as np
import kvcache
{imports}
rss = status("VmRSS")
manager = {make}
constructed = status("VmRSS") - rss
ctx = kvcache.ReqContext("r")
keys = [bytes([i]) * 36 for i in range(3)]
for i, key in enumerate(keys):
    ctx.set_offload_key_position(key, 16 * (i + 1))
manager.on_new_request(ctx)
out = manager.prepare_store(keys, ctx)
stored = out.store_spec.block_ids
manager.complete_store(out.keys_to_store, ctx)
loaded = manager.prepare_load(keys[:1], ctx).block_ids
manager.complete_load(keys[:1], ctx)
manager.validate()
report(
    constructed=constructed,
    used=status("VmRSS") - rss,
    stored=stored.tolist(),
    loaded=loaded.tolist(),
    dtype=str(stored.dtype),
    dtype_max=int(np.iinfo(stored.dtype).max),
    num_chunks=manager.num_chunks,
    resident=len(manager),
)
"""


@functools.cache
def big_manager(flavour: str, num_chunks: int, policy: str) -> Isolated:
    """Builds a manager of ``num_chunks`` chunks in a fresh interpreter, stores three keys and
    loads one (cached: several tests read one run)."""
    if flavour == "ours":
        imports = ""
        make = f"kvcache.OffloadingManager({num_chunks}, {policy!r})"
        max_rss = 768 * MiB
    else:
        imports = "from kvcache.vllm import CPUOffloadingManager"
        make = f"CPUOffloadingManager(num_chunks={num_chunks}, cache_policy={policy!r})"
        max_rss = 2048 * MiB  # torch and vLLM are imported first
    return run_isolated(MANAGER_SCRIPT.format(imports=imports, make=make), max_rss=max_rss)


def manager_cases() -> list[Any]:
    return [
        pytest.param(flavour, num_chunks, policy, id=f"{flavour}-{num_chunks}-{policy}")
        for flavour, num_chunks, policy in [
            ("ours", 10**8, "lru"),
            ("ours", MAX_CHUNKS, "lru"),
            ("ours", MAX_CHUNKS, "arc"),
            ("vllm", MAX_CHUNKS, "lru"),
        ]
    ]


@pytest.mark.parametrize(("flavour", "num_chunks", "policy"), manager_cases())
def test_a_manager_of_many_chunks_allocates_with_use(
    flavour: str, num_chunks: int, policy: str
) -> None:
    report = big_manager(flavour, num_chunks, policy).check()
    assert report["constructed"] < RSS_BOUND, (
        f"constructing {num_chunks} chunks took {report['constructed'] / MiB:.0f} MiB"
    )
    assert report["used"] < RSS_BOUND
    assert report["num_chunks"] == num_chunks
    assert report["stored"] == [0, 1, 2]
    assert report["loaded"] == [0]
    assert report["resident"] == 3


@pytest.mark.parametrize(("flavour", "policy"), [("ours", "lru"), ("vllm", "lru")])
def test_chunk_ids_of_the_largest_manager_are_not_narrowed(flavour: str, policy: str) -> None:
    """The id dtype of a store spec must hold every id the manager can hand out (ids near
    2**31 - 1 need billions of stores to reach; the dtype is the contract that covers them)."""
    report = big_manager(flavour, MAX_CHUNKS, policy).check()
    assert report["dtype_max"] >= report["num_chunks"] - 1, (
        f"{report['dtype']} cannot hold chunk id {report['num_chunks'] - 1}"
    )


@pytest.mark.parametrize("num_chunks", [MAX_CHUNKS + 1, 2**32 - 1, 2**64])
def test_a_manager_beyond_int32_ids_is_refused(num_chunks: int) -> None:
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.OffloadingManager(num_chunks)


@pytest.mark.parametrize("flavour", ["ours", "vllm"])
@pytest.mark.parametrize("policy", list(kvcache.POLICY_KINDS))
def test_chunk_id_dtype_holds_every_id_of_a_small_manager(flavour: str, policy: str) -> None:
    if flavour == "ours":
        manager = kvcache.OffloadingManager(4, policy)
    else:
        from kvcache.vllm import CPUOffloadingManager

        manager = CPUOffloadingManager(4, policy)
    ctx = kvcache.ReqContext("r")
    keys = [make_key(i) for i in range(4)]
    spec = manager.prepare_store(keys, ctx).store_spec
    assert spec.block_ids.dtype.kind in "iu"
    assert np.iinfo(spec.block_ids.dtype).max >= 3
    assert spec.block_ids.tolist() == [0, 1, 2, 3]


def test_a_load_store_spec_holds_any_chunk_id_a_manager_can_have() -> None:
    spec = kvcache.LoadStoreSpec([0, MAX_CHUNKS - 1])
    assert spec.block_ids.tolist() == [0, MAX_CHUNKS - 1]
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.LoadStoreSpec([0, 2**31])


# --- the chunk table of a huge manager --------------------------------------------------------

TABLE_SCRIPT = """
import numpy as np
import kvcache
rss = status("VmRSS")
manager = kvcache.OffloadingManager(2**31 - 1)
try:
    # memoryview first: numpy.asarray turns a failed export into an object scalar.
    table = np.asarray(memoryview(manager.chunk_table()))
except BaseException as exc:
    # In full, so that a failure shows what was raised instead of a view.
    outcome, shape = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}", None
else:
    outcome, shape = "view", list(table.shape)
report(outcome=outcome, shape=shape, used=status("VmRSS") - rss)
"""


def test_the_chunk_table_of_a_huge_manager_is_lazy() -> None:
    """The table copy holds the ids handed out so far (none yet), not one record per chunk."""
    report = run_isolated(TABLE_SCRIPT).check()
    assert report["outcome"] == "view"
    assert report["shape"] == [0]
    assert report["used"] < RSS_BOUND


# --- vLLM's constructor shapes ----------------------------------------------------------------


def test_the_vllm_manager_takes_vllms_positional_arguments() -> None:
    from kvcache.vllm import CPUOffloadingManager

    manager = CPUOffloadingManager(4, "arc", None, True, 2, 1000, None)
    assert (manager.num_chunks, manager.cache_policy, manager.store_threshold) == (4, "arc", 2)
    manager.validate()


def test_the_vllm_manager_takes_vllms_keyword_arguments() -> None:
    from kvcache.vllm import CPUOffloadingManager

    manager = CPUOffloadingManager(
        num_chunks=4,
        cache_policy="arc",
        cache_policy_module_path=None,
        enable_events=True,
        store_threshold=2,
        max_tracker_size=1000,
        info=None,
    )
    assert (manager.num_chunks, manager.cache_policy, manager.store_threshold) == (4, "arc", 2)


GROWTH_SCRIPT = """
import numpy as np
import kvcache
manager = kvcache.OffloadingManager(100_000)
early = memoryview(manager.chunk_table())
ctx = kvcache.ReqContext("r")
keys = [i.to_bytes(32, "big") + bytes(4) for i in range(50_000)]
for i in range(0, len(keys), 1000):
    out = manager.prepare_store(keys[i : i + 1000], ctx)
    manager.complete_store(out.keys_to_store, ctx)
late = np.asarray(memoryview(manager.chunk_table()))
report(
    early_len=len(np.asarray(early)),
    late_ids_ok=late["chunk_id"].tolist() == list(range(len(late))),
    late_len=len(late),
    late_ready=int((late["ref_cnt"] == 0).sum()),
)
"""


def test_a_table_copy_taken_early_stays_valid_while_the_manager_fills() -> None:
    """chunk_table() is a copy: one taken before the manager grows stays readable (it holds
    the records of that moment), and a later one holds every id handed out since."""
    report = run_isolated(GROWTH_SCRIPT).check()
    assert report["early_len"] == 0
    assert report["late_ids_ok"]
    assert report["late_len"] == 50_000
    assert report["late_ready"] == 50_000
