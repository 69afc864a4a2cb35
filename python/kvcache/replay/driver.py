"""The replay driver: feeds a workload to an ``OffloadingManager`` the way vLLM's scheduler would.

Semantics (fixed; every backend gets exactly this sequence of calls):

1. Requests are issued in workload order. For request ``i`` the driver builds a request context
   (``req_id = "r<i>"``), calls ``on_new_request(ctx)``, and records each key's end-token
   position on the context (``(j + 1) * block_tokens`` for the key at index ``j``, as the
   scheduler's ``set_offload_key_position`` does).
2. It looks the keys up in prefix order and stops at the first result that is not ``HIT``
   (``MISS``, or ``HIT_PENDING`` for a block whose store has not completed yet). The hits form
   the loadable prefix: ``prepare_load(hits)``.
3. ``prepare_store(all the remaining keys)`` -- not called when every key hit. ``None`` is a
   failed prepare (nothing evictable enough): counted, nothing stored.
4. The request's transfers complete once ``lag`` later requests have been issued (default 8;
   ``0`` completes each request right after it is issued): ``complete_load(hits)``,
   ``complete_store(keys_to_store, success=...)`` and then ``on_request_finished(ctx)``.
   With ``fail_store_every=K`` every K-th store job (a request with a non-empty
   ``keys_to_store``) completes with ``success=False``; off by default.
5. After the last request everything still pending completes, oldest first.

Counting: ``lookups`` counts every key of every request (also those after the first non-hit,
which the driver never asks about), so ``hits + misses == lookups`` and hit ratio is
``hits / lookups``. ``stored`` counts keys handed back in ``keys_to_store`` (failed stores
included; ``failed_store_keys`` says how many of them failed), ``evicted`` the keys in
``evicted_keys``.

Two recordings come out of a run:

* the *script*, always: per request ``(hits, first non-hit result, prepare_store result)``, a
  few appends per request. :class:`kvcache.replay.baseline.NullManager` replays it to measure
  the driver's own cost; recording it in every run keeps that cost identical in both.
* the *decision log*, with ``record=True`` (untimed use): per request the lookup outcome,
  ``keys_to_store``, chunk ids (``store_spec.block_ids``), ``evicted_keys`` and the events taken
  after the request's step. :mod:`kvcache.replay.compare` compares two of them.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcache.replay.backends import Backend
from kvcache.replay.errors import ConfigError
from kvcache.replay.workload import Workload

__all__ = [
    "DEFAULT_OPTIONS",
    "NOT_CALLED",
    "Decision",
    "EventRecord",
    "ReplayOptions",
    "ReplayRun",
    "ScriptStep",
    "replay",
    "result_name",
]

#: Script entry for a request whose keys all hit: ``prepare_store`` was not called.
NOT_CALLED: Any = type("NotCalled", (), {"__repr__": lambda self: "NOT_CALLED"})()

#: One request of a run's script: (hits, first non-HIT lookup result or None, prepare_store
#: result: the manager's output, None for a failed prepare, or NOT_CALLED).
ScriptStep = tuple[int, Any, Any]

#: A normalised event: ("stored" | "removed" | "removed-metadata", keys, medium name).
EventRecord = tuple[str, tuple[bytes, ...], str]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayOptions:
    """How the driver plays a workload, the same for every backend of one experiment.

    ``lag``: a request's loads and stores complete once ``lag`` later requests were issued.
    ``fail_store_every``: every K-th store job completes with ``success=False`` (0: never).
    ``drain_events``: enable the manager's events and take them after every request step.
    """

    lag: int = 8
    fail_store_every: int = 0
    drain_events: bool = False

    def __post_init__(self) -> None:
        if self.lag < 0:
            raise ConfigError(f"lag must be >= 0, not {self.lag}")
        if self.fail_store_every < 0:
            raise ConfigError(f"fail-store-every must be >= 0, not {self.fail_store_every}")


#: The driver's defaults: lag 8, no failed stores, events off.
DEFAULT_OPTIONS = ReplayOptions()


def result_name(result: Any) -> str:
    """A backend-neutral name for a lookup result (vLLM's enum and ours share member names)."""
    name = getattr(result, "name", None)
    return name if isinstance(name, str) else str(result)


@dataclass(frozen=True, slots=True)
class Decision:
    """What a manager decided for one request step (``step == requests`` is the final drain)."""

    step: int
    hits: int
    stop: str | None
    #: "ok", "failed" (prepare_store returned None), "none" (not called) or "drain" (final step)
    store: str
    keys_to_store: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    evicted_keys: tuple[bytes, ...]
    events: tuple[EventRecord, ...]


@dataclass(slots=True, kw_only=True)
class ReplayRun:
    """Counters, time and recordings of one replay."""

    backend: str
    policy: str
    num_chunks: int
    requests: int
    lookups: int
    hits: int
    stored: int
    evicted: int
    failed_prepares: int
    store_jobs: int
    failed_stores: int
    failed_store_keys: int
    stops: dict[str, int]
    elapsed_ns: int
    script: list[ScriptStep] = field(repr=False)
    decisions: list[Decision] | None = field(default=None, repr=False)

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def counters(self) -> dict[str, Any]:
        """The decision-derived figures (no time): equal for runs that decided alike."""
        return {
            "requests": self.requests,
            "lookups": self.lookups,
            "hits": self.hits,
            "stored": self.stored,
            "evicted": self.evicted,
            "failed_prepares": self.failed_prepares,
            "store_jobs": self.store_jobs,
            "failed_stores": self.failed_stores,
            "failed_store_keys": self.failed_store_keys,
            "stops": dict(self.stops),
        }


def _event_record(event: Any) -> EventRecord:
    if getattr(event, "removed", False):
        kind = "removed-metadata" if getattr(event, "metadata_only", False) else "removed"
    else:
        kind = "stored"
    medium = getattr(event, "medium", None)
    medium_name = getattr(medium, "name", None)
    return kind, tuple(event.keys), medium_name if isinstance(medium_name, str) else str(medium)


def _decision(
    step: int, hits: int, stop: Any, out: Any, events: tuple[EventRecord, ...]
) -> Decision:
    stop_name = None if stop is None else result_name(stop)
    if out is NOT_CALLED or out is None:
        return Decision(
            step, hits, stop_name, "none" if out is NOT_CALLED else "failed", (), (), (), events
        )
    return Decision(
        step,
        hits,
        stop_name,
        "ok",
        tuple(out.keys_to_store),
        tuple(map(int, out.store_spec.block_ids)),
        tuple(out.evicted_keys),
        events,
    )


def replay(
    backend: Backend,
    workload: Workload,
    *,
    policy: str,
    num_chunks: int,
    options: ReplayOptions = DEFAULT_OPTIONS,
    record: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayRun:
    """Replay ``workload`` through a fresh manager from ``backend`` (semantics: module docstring).

    Only the request loop and the final drain are timed (``perf_counter_ns``); building the
    manager is not. ``options.drain_events`` enables the manager's events and takes them after
    every request step, as vLLM's scheduler does when KV events are on; ``record`` implies it and
    also keeps the decision log. ``progress(done, total)`` is called about 50 times per run.
    """
    if num_chunks < 1:
        raise ConfigError(f"capacity must be at least one chunk, not {num_chunks}")
    lag = options.lag
    fail_store_every = options.fail_store_every
    take = options.drain_events or record
    manager = backend.make(num_chunks, policy, enable_events=take)
    requests = workload.requests
    total = len(requests)
    bt = workload.block_tokens
    positions = range(bt, (workload.max_request_keys + 1) * bt, bt)
    hit = backend.hit
    make_ctx = backend.req_context
    on_new_request = manager.on_new_request
    prepare_load = manager.prepare_load
    prepare_store = manager.prepare_store
    complete_load = manager.complete_load
    complete_store = manager.complete_store
    on_request_finished = manager.on_request_finished
    take_events = manager.take_events

    script: list[ScriptStep] = []
    decisions: list[Decision] | None = [] if record else None
    pending: deque[tuple[Any, tuple[bytes, ...], Any, bool]] = deque()
    hits = stored = evicted = failed_prepares = 0
    store_seq = failed_stores = failed_store_keys = 0
    tick = max(1, total // 50)
    next_tick = tick if progress is not None else total + 1
    no_keys: tuple[bytes, ...] = ()

    start = time.perf_counter_ns()
    for idx, keys in enumerate(requests):
        ctx = make_ctx(f"r{idx}")
        on_new_request(ctx)
        set_position = ctx.set_offload_key_position
        for key, position in zip(keys, positions, strict=False):
            set_position(key, position)

        lookup = manager.lookup  # fetched per request: the null manager swaps it per request
        n_hit = 0
        stop = None
        for key in keys:
            result = lookup(key, ctx)
            if result != hit:
                stop = result
                break
            n_hit += 1
        hits += n_hit
        load_keys = keys[:n_hit] if n_hit else no_keys
        if n_hit:
            prepare_load(load_keys, ctx)

        success = True
        if n_hit < len(keys):
            out = prepare_store(keys[n_hit:], ctx)
            if out is None:
                failed_prepares += 1
                to_store = no_keys
            else:
                to_store = out.keys_to_store
                stored += len(to_store)
                evicted += len(out.evicted_keys)
                if fail_store_every and to_store:
                    store_seq += 1
                    if store_seq % fail_store_every == 0:
                        success = False
                        failed_stores += 1
                        failed_store_keys += len(to_store)
        else:
            out = NOT_CALLED
            to_store = no_keys
        script.append((n_hit, stop, out))
        pending.append((ctx, load_keys, to_store, success))

        if len(pending) > lag:
            done_ctx, done_load, done_store, done_ok = pending.popleft()
            if done_load:
                complete_load(done_load, done_ctx)
            if done_store:
                complete_store(done_store, done_ctx, success=done_ok)
            on_request_finished(done_ctx)
        if take:
            if decisions is None:
                for _event in take_events():  # consumed, as the scheduler does, not kept
                    pass
            else:
                events = tuple(map(_event_record, take_events()))
                decisions.append(_decision(idx, n_hit, stop, out, events))
        if idx == next_tick:
            progress(idx, total)  # type: ignore[misc]
            next_tick += tick

    while pending:
        done_ctx, done_load, done_store, done_ok = pending.popleft()
        if done_load:
            complete_load(done_load, done_ctx)
        if done_store:
            complete_store(done_store, done_ctx, success=done_ok)
        on_request_finished(done_ctx)
    if take:
        if decisions is None:
            for _event in take_events():
                pass
        else:
            events = tuple(map(_event_record, take_events()))
            decisions.append(Decision(total, 0, None, "drain", (), (), (), events))
    elapsed = time.perf_counter_ns() - start
    if progress is not None:
        progress(total, total)

    store_jobs = sum(
        1 for _, _, out in script if out is not NOT_CALLED and out is not None and out.keys_to_store
    )
    stops = Counter(result_name(stop) for _, stop, _ in script if stop is not None)
    return ReplayRun(
        backend=backend.name,
        policy=policy,
        num_chunks=num_chunks,
        requests=total,
        lookups=workload.key_visits,
        hits=hits,
        stored=stored,
        evicted=evicted,
        failed_prepares=failed_prepares,
        store_jobs=store_jobs,
        failed_stores=failed_stores,
        failed_store_keys=failed_store_keys,
        stops=dict(sorted(stops.items())),
        elapsed_ns=elapsed,
        script=script,
        decisions=decisions,
    )
