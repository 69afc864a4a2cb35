"""A call whose result cannot be built after the manager changed.

``prepare_store`` and ``prepare_load`` decide in Rust, then build the result objects in Python
(vLLM's classes for ``kvcache.vllm.CPUOffloadingManager``). A ``KeyboardInterrupt`` or a
``MemoryError`` there must not strand chunks nobody will ever hear of: the call raises and
gives back what it took (a store's new pending chunks, a load's pins). Evictions a failed
store made stay, and are reported as events. ``take_events`` is all or nothing: if one event
cannot be built, every event waits for the next call.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import kvcache
from kvcache.vllm import CPUOffloadingManager
from tests.support.keys import make_key


class Interrupt:
    """A result class whose construction raises, ``armed`` times."""

    armed = 0

    def __init__(self, real: Any, exc: type[BaseException]) -> None:
        self.real = real
        self.exc = exc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if Interrupt.armed:
            Interrupt.armed -= 1
            raise self.exc("raised while building the result")
        return self.real(*args, **kwargs)


def manager_with(num_chunks: int = 4, *, events: bool = False, **types: Any) -> Any:
    """A ``CPUOffloadingManager`` subclass whose result types are replaced by ``types``."""
    namespace = SimpleNamespace(**{**vars(CPUOffloadingManager._result_types), **types})
    cls = type("Patched", (CPUOffloadingManager,), {"_result_types": namespace})
    return cls(num_chunks, enable_events=events)


def ctx() -> kvcache.ReqContext:
    return kvcache.ReqContext()


@pytest.fixture(autouse=True)
def _disarm() -> Any:
    yield
    Interrupt.armed = 0


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
def test_a_store_whose_output_cannot_be_built_strands_no_chunk(exc: type[BaseException]) -> None:
    from vllm.v1.kv_offload.base import PrepareStoreOutput

    m = manager_with(output_cls=Interrupt(PrepareStoreOutput, exc))
    a, b = make_key(0), make_key(1)
    Interrupt.armed = 1
    with pytest.raises(exc):
        m.prepare_store([a, b], ctx())
    m.validate()
    assert m._debug_state()["chunks"] == {}
    assert m.num_write_pending == 0
    assert len(m) == 0
    # The caller can try again and learns every chunk it must write.
    out = m.prepare_store([a, b], ctx())
    assert list(out.keys_to_store) == [a, b]
    assert len(out.store_spec.block_ids) == 2
    m.validate()


def test_a_failed_store_keeps_its_evictions_and_reports_them() -> None:
    from vllm.v1.kv_offload.base import PrepareStoreOutput

    m = manager_with(2, events=True, output_cls=Interrupt(PrepareStoreOutput, KeyboardInterrupt))
    old = [make_key(i) for i in range(2)]
    m.prepare_store(old, ctx())
    m.complete_store(old)
    m.take_events()
    new = [make_key(10), make_key(11)]
    Interrupt.armed = 1
    with pytest.raises(KeyboardInterrupt):
        m.prepare_store(new, ctx())
    m.validate()
    assert len(m) == 0
    assert m.num_write_pending == 0
    events = [(sorted(e.keys), e.removed, e.metadata_only) for e in m.take_events()]
    assert events == [
        (sorted(old), True, False),  # the eviction happened, and is public
        (sorted(new), True, True),  # the rolled-back chunks: metadata only, as a failed store
    ]


def test_a_load_whose_spec_cannot_be_built_leaves_no_pin() -> None:
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    class Spec(CPULoadStoreSpec):
        def __setattr__(self, name: str, value: Any) -> None:
            if Interrupt.armed:
                Interrupt.armed -= 1
                raise KeyboardInterrupt
            object.__setattr__(self, name, value)

    m = manager_with(spec_cls=Spec)
    keys = [make_key(0), make_key(1)]
    m.prepare_store(keys, ctx())
    m.complete_store(keys)
    before = m._debug_state()
    Interrupt.armed = 1
    with pytest.raises(KeyboardInterrupt):
        m.prepare_load(keys, ctx())
    m.validate()
    assert m._debug_state()["chunks"] == before["chunks"]
    assert m.num_evictable == 2, "a failed load left chunks pinned"
    assert list(m.prepare_load(keys, ctx()).block_ids) == [0, 1]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
def test_take_events_is_all_or_nothing(exc: type[BaseException]) -> None:
    from vllm.v1.kv_offload.base import OffloadingEvent

    class Event(OffloadingEvent):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if Interrupt.armed == 1:
                Interrupt.armed = 0
                raise exc("raised while building an event")
            if Interrupt.armed:
                Interrupt.armed -= 1
            super().__init__(*args, **kwargs)

    m = manager_with(2, events=True, event_cls=Event)
    first, second = [make_key(0)], [make_key(1)]
    for keys in (first, second):
        m.prepare_store(keys, ctx())
        m.complete_store(keys)
    Interrupt.armed = 2  # the second event fails
    with pytest.raises(exc):
        m.take_events()
    events = [(list(e.keys), e.removed) for e in m.take_events()]
    assert events == [(first, False), (second, False)], "events were lost"
    assert m.take_events() == []
