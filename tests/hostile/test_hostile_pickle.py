"""Pickling and copying every public class.

kvcache's Rust classes (policies, chunks, the managers and their results, host pools, plans)
and the Python classes built over them (the transfer engine, the vLLM worker) refuse
``pickle.dumps`` (old and new protocols), ``copy.copy`` and ``copy.deepcopy`` with exactly
``kvcache.InvalidTypeError``: a ``KvCacheError`` that is also the ``TypeError`` Python's own
refusal is, so code that catches either keeps working. The refusal changes nothing. Plain
values (the exceptions, ``LookupResult``, ``ManagerStats``, ``JobResult``, a ``ReqContext`` no
policy has used yet) pickle and copy as any Python value does.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import kvcache
from tests.support.hostile import raises_exactly, ready, state_of
from tests.support.keys import make_key
from tests.support.oracle import require_oracle

OPS: dict[str, Callable[[Any], object]] = {
    "pickle-0": lambda obj: pickle.dumps(obj, protocol=0),
    "pickle": lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
}


@dataclass
class Subject:
    obj: Any
    snapshot: Callable[[], Any]
    close: Callable[[], None] = lambda: None
    # What must stay alive while the case runs (the manager of a result, say).
    keep: list[Any] = field(default_factory=list)


# --- subjects that refuse ---------------------------------------------------------------------


def a_policy(cls: type) -> Subject:
    policy = cls(4, vllm_semantics="0.33")  # its protocol has touch
    ctx = kvcache.ReqContext("r")
    for i in range(3):
        policy.insert(make_key(i), ready(i), ctx)
    policy.touch([make_key(0)], ctx)
    return Subject(policy, lambda: state_of(policy), keep=[ctx])


def a_chunk() -> Subject:
    chunk = ready(3)
    return Subject(chunk, lambda: state_of(chunk))


def a_manager(cls: Callable[..., Any]) -> Subject:
    """A full manager that has evicted: its results are all non-empty."""
    manager = cls(4, enable_events=True)
    ctx = kvcache.ReqContext("r")
    for i in range(6):
        out = manager.prepare_store([make_key(i)], ctx)
        manager.complete_store(out.keys_to_store, ctx)
    # The context stays alive: a dropped one is reclaimed by the next call, a change of state.
    return Subject(manager, lambda: state_of(manager), keep=[ctx])


def ours() -> Any:
    return kvcache.OffloadingManager


def vllms() -> Any:
    require_oracle()
    from kvcache.vllm import CPUOffloadingManager

    return CPUOffloadingManager


def result(pick: Callable[[Any, Any], Any], snapshot: Callable[[Any], Any]) -> Subject:
    made = a_manager(kvcache.OffloadingManager)
    manager, ctx = made.obj, kvcache.ReqContext("r")
    obj = pick(manager, ctx)
    return Subject(obj, lambda: (snapshot(obj), state_of(manager)), keep=[manager, ctx, *made.keep])


def store_output(manager: Any, ctx: Any) -> Any:
    out = manager.prepare_store([make_key(9)], ctx)
    assert len(out.evicted_keys) == 1
    return out


def event(manager: Any, _ctx: Any) -> Any:
    (first, *_) = manager.take_events()
    return first


def engine_parts() -> tuple[Any, Any, list[Any]]:
    torch = pytest.importorskip("torch")
    from kvcache.transfer import HostChunkPool, TransferEngine

    pool = HostChunkPool(4, 64, pin=False)
    np.frombuffer(pool, dtype=np.uint8)[:] = np.arange(pool.nbytes, dtype=np.uint8)
    layers = [torch.arange(8 * 64, dtype=torch.int32).to(torch.uint8).view(8, 64)]
    return TransferEngine(layers, pool), pool, layers


def a_pool() -> Subject:
    from kvcache.transfer import HostChunkPool

    pool = HostChunkPool(4, 64, pin=False)
    np.frombuffer(pool, dtype=np.uint8)[:] = 5
    return Subject(pool, lambda: (bytes(memoryview(pool)), pool.closed), pool.close)


def an_engine() -> Subject:
    engine, pool, layers = engine_parts()
    engine.wait([engine.store([0], [1])])

    def snapshot() -> Any:
        engine.wait()
        return (
            bytes(memoryview(pool)),
            [t.numpy().tobytes() for t in layers],
            engine.in_flight,
            engine.closed,
            pool.closed,
        )

    return Subject(engine, snapshot, engine.close, keep=[pool, layers])


def a_plan() -> Subject:
    engine, pool, layers = engine_parts()
    plan = engine.plan(store=True, gpu_block_ids=[0, 1], chunk_ids=[2, 3])

    def snapshot() -> Any:
        return (len(plan), plan.store, plan.num_pages, plan.nbytes, bytes(memoryview(pool)))

    return Subject(plan, snapshot, keep=[engine, pool, layers])


def a_worker() -> Subject:
    require_oracle()
    from tests.support.vllm_worker_oracle import canonical, make_tensors, vllm_on_cpu
    from tests.support.worker_specs import PLAIN, spec_for

    with vllm_on_cpu():
        spec = spec_for(PLAIN)
        worker = spec.get_worker(canonical(PLAIN, make_tensors(PLAIN, 0)))
    assert type(worker).__name__ == "CPUOffloadingWorker", type(worker)
    # Its state is Python attributes over Rust objects: none may be replaced.
    return Subject(
        worker,
        lambda: {k: id(v) for k, v in vars(worker).items()},
        worker.shutdown,
        keep=[spec],
    )


def a_used_context() -> Subject:
    """A context a manager has stored its per-request state on."""
    manager = kvcache.OffloadingManager(4)
    ctx = kvcache.ReqContext("r")
    manager.prepare_store([make_key(0)], ctx)
    assert ctx._state, "the manager stored no state on the context"
    return Subject(ctx, lambda: (dict(ctx._state), state_of(manager)), keep=[manager])


POLICY_CLASSES = {cls.__name__: cls for cls in kvcache._core.POLICY_KINDS.values()}


@dataclass
class Refused:
    make: Callable[[], Subject]
    ops: tuple[str, ...] = tuple(OPS)


REFUSED: dict[str, Refused] = {
    **{name: Refused(lambda c=cls: a_policy(c)) for name, cls in POLICY_CLASSES.items()},
    "ChunkStatus": Refused(a_chunk),
    "OffloadingManager": Refused(lambda: a_manager(ours())),
    "vllm.CPUOffloadingManager": Refused(lambda: a_manager(vllms())),
    "ChunkTableView": Refused(
        lambda: result(lambda m, _: m.chunk_table(), lambda t: bytes(memoryview(t)))
    ),
    "PrepareStoreOutput": Refused(
        lambda: result(
            store_output,
            lambda o: (o.keys_to_store, o.store_spec.block_ids.tolist(), list(o.evicted_keys)),
        )
    ),
    "LoadStoreSpec": Refused(
        lambda: result(lambda m, c: store_output(m, c).store_spec, lambda s: s.block_ids.tolist())
    ),
    "EvictedKeys": Refused(lambda: result(lambda m, c: store_output(m, c).evicted_keys, list)),
    "OffloadingEvent": Refused(
        lambda: result(event, lambda e: (e.keys, e.medium, e.removed, e.metadata_only))
    ),
    "HostChunkPool": Refused(a_pool),
    "TransferEngine": Refused(an_engine),
    "Plan": Refused(a_plan),
    "CPUOffloadingWorker": Refused(a_worker),
    # copy.copy of a context is the user's own shallow copy (it shares the state dict, as
    # vLLM's does); what holds kvcache's state is the object inside, which refuses the rest.
    "ReqContext-used": Refused(a_used_context, ops=("pickle-0", "pickle", "deepcopy")),
}


@pytest.mark.parametrize(
    ("subject", "op"),
    [
        pytest.param(name, op, id=f"{name}-{op}")
        for name, entry in REFUSED.items()
        for op in entry.ops
    ],
)
def test_pickling_or_copying_is_refused_typed_and_changes_nothing(subject: str, op: str) -> None:
    target = REFUSED[subject].make()
    try:
        before = target.snapshot()
        error = raises_exactly(lambda: OPS[op](target.obj), kvcache.InvalidTypeError)
        assert isinstance(error, TypeError)
        assert target.snapshot() == before, "a refused pickle or copy changed the state"
    finally:
        target.close()


def test_the_refusal_names_the_class_it_refused() -> None:
    class Mine(kvcache.OffloadingManager):
        pass

    error = raises_exactly(lambda: pickle.dumps(Mine(4)), kvcache.InvalidTypeError)
    assert "cannot pickle 'Mine' object" in str(error), error


# --- plain values -----------------------------------------------------------------------------


def round_trips(
    value: Any, same: Callable[[Any, Any], bool], ops: tuple[str, ...] = tuple(OPS)
) -> None:
    for name in ops:
        out = OPS[name](value)
        back = pickle.loads(out) if name.startswith("pickle") else out
        assert same(back, value), f"{name} of {value!r} gave {back!r}"


def error_classes() -> list[type[BaseException]]:
    return [
        cls
        for name in kvcache.__all__
        if isinstance(cls := getattr(kvcache, name), type) and issubclass(cls, BaseException)
    ]


@pytest.mark.parametrize("cls", error_classes(), ids=lambda c: c.__name__)
def test_an_error_pickles_and_copies(cls: type[BaseException]) -> None:
    round_trips(cls("why"), lambda a, b: type(a) is type(b) and a.args == b.args)


def test_the_vllm_version_error_pickles_and_copies() -> None:
    require_oracle()
    from kvcache.vllm import UnsupportedVersionError

    error = UnsupportedVersionError("why")
    round_trips(error, lambda a, b: type(a) is type(b) and a.args == b.args)


def test_value_results_pickle_and_copy() -> None:
    from kvcache.transfer import JobResult

    round_trips(kvcache.LookupResult.HIT_PENDING, lambda a, b: a is b)
    stats = a_manager(kvcache.OffloadingManager).obj.get_stats()
    assert stats.allocation_sizes, "the stats are empty"
    round_trips(stats, lambda a, b: type(a) is type(b) and a == b)
    job = JobResult(3, True, 64, 0.5, True, None)
    round_trips(job, lambda a, b: type(a) is type(b) and a == b)


@pytest.mark.parametrize("op", OPS)
def test_a_fresh_context_pickles_and_copies(op: str) -> None:
    ctx = kvcache.ReqContext("r", {"x": 1})
    ctx.set_offload_key_position(make_key(0), 16)
    ctx.set_state(3)

    def same(a: Any, b: Any) -> bool:
        fields = ("req_id", "kv_transfer_params", "_state", "_offload_key_positions")
        return type(a) is type(b) and all(getattr(a, f) == getattr(b, f) for f in fields)

    round_trips(ctx, same, ops=(op,))


# --- every public class has a case --------------------------------------------------------------

VALUES = {
    *(cls.__name__ for cls in error_classes()),
    "UnsupportedVersionError",
    "LookupResult",
    "ManagerStats",
    "JobResult",
    "ReqContext",
}
# Classes with no case of their own, and why.
EXEMPT = {
    "BaseCachePolicy": "not instantiable; every policy class derives from it",
    "CPUOffloadingSpec": "vLLM's spec class, copied as vLLM copies it; what it builds refuses",
    "KvCacheOffloadingSpec": "an alias of CPUOffloadingSpec",
    "KvCacheTieringOffloadingSpec": "vLLM's tiering spec class, copied as vLLM copies it; "
    "its manager's primary tier refuses (tests/tiering/test_tiering_conformance.py)",
}


def public_classes() -> set[str]:
    require_oracle()
    import kvcache.transfer
    import kvcache.vllm

    return {
        name
        for module in (kvcache, kvcache.transfer, kvcache.vllm)
        for name in module.__all__
        if isinstance(getattr(module, name), type)
    }


def test_every_public_class_has_a_case() -> None:
    covered = {name.removeprefix("vllm.") for name in REFUSED} | VALUES | set(EXEMPT)
    missing = public_classes() - covered
    assert not missing, f"no pickling case for {sorted(missing)}"
