"""The null baseline: a manager that only repeats a recorded run's answers.

Replaying a workload against it costs the driver's own work (request contexts, key positions,
the lookup loop, bookkeeping) and next to nothing inside the manager, so the timing subtracts it
from a real replay to get the time spent inside the real manager (see
:mod:`kvcache.replay.runner`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvcache.replay.backends import Backend
from kvcache.replay.driver import NOT_CALLED, ScriptStep
from kvcache.replay.workload import Workload

__all__ = ["NullManager", "null_backend"]


class NullManager:
    """A manager that does nothing but repeat a recorded run's answers.

    It answers each request's lookups, and returns each ``prepare_store`` result (the request's
    own, then the step's re-offers), exactly as the recorded run of a real manager did, so the
    driver takes the same path -- the same number of lookups, the same slices handed to
    ``prepare_load``/``prepare_store``, the same lists to ``complete_store`` -- while the
    manager side costs next to nothing. The difference between a real replay and this one is
    therefore the time spent inside the real manager.

    To keep its own cost off that difference, ``lookup`` is not a Python method: on each
    ``on_new_request`` the instance attribute ``lookup`` becomes the bound ``dict.get`` of that
    request's table ``{key: result}``, which holds exactly the keys the recorded run looked up
    (its hits, then the first non-hit). ``dict.get(key, ctx)`` is a C call, so the driver's
    ``lookup(key, ctx)`` costs the call and a dict probe, nothing more. (The driver fetches
    ``manager.lookup`` once per request, after ``on_new_request``, for every backend alike.)
    """

    def __init__(self, workload: Workload, script: Sequence[ScriptStep], *, hit: Any) -> None:
        if len(script) != len(workload.requests):
            raise ValueError("the script does not belong to this workload")
        tables: list[dict[bytes, Any]] = []
        stores: list[tuple[Any, ...]] = []
        for keys, (n_hit, terminal, store, reoffers) in zip(workload.requests, script, strict=True):
            table = dict.fromkeys(keys[:n_hit], hit)
            if terminal is not None:
                table[keys[n_hit]] = terminal
            tables.append(table)
            # A step's prepare_store calls: its own request's (unless all keys hit), then
            # the re-offers.
            stores.append(reoffers if store is NOT_CALLED else (store, *reoffers))
        self._tables = tables
        self._stores = stores
        self._next = 0
        self._step_stores: Iterator[Any] = iter(())
        self.lookup: Callable[..., Any] = {}.get

    def on_new_request(self, req_context: Any) -> None:
        i = self._next
        self._next = i + 1
        self.lookup = self._tables[i].get
        self._step_stores = iter(self._stores[i])

    def prepare_load(self, keys: Any, req_context: Any) -> None:
        return None

    def touch(self, keys: Any, req_context: Any) -> None:
        return None

    def complete_load(self, keys: Any, req_context: Any) -> None:
        return None

    def prepare_store(self, keys: Any, req_context: Any) -> Any:
        return next(self._step_stores)

    def complete_store(self, keys: Any, req_context: Any, success: bool = True) -> None:
        return None

    def on_request_finished(self, req_context: Any) -> None:
        return None

    def take_events(self) -> tuple[()]:
        return ()

    def reset_cache(self) -> None:
        self._next = 0

    def get_stats(self) -> None:
        return None


def null_backend(base: Backend, workload: Workload, script: Sequence[ScriptStep]) -> Backend:
    """A backend whose managers replay ``script`` (recorded from ``base`` on ``workload``).

    It uses ``base``'s ``hit`` value and ``ReqContext`` factory, so that everything the driver does
    outside the manager (building contexts, recording key positions, comparing results) costs the
    same in both runs.
    """

    def make(
        num_chunks: int, policy: str, *, enable_events: bool = False, store_threshold: int = 1
    ) -> NullManager:
        return NullManager(workload, script, hit=base.hit)

    return Backend(
        name=f"null({base.name})",
        make=make,
        hit=base.hit,
        req_context=base.req_context,
        semantics=base.semantics,
    )
