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
   failed prepare (nothing evictable enough): counted, nothing stored, and the same keys are
   offered again at each later step while the request is in flight, as vLLM's scheduler
   retries a failed store on its next step.
4. Re-offers, after the step's own store, oldest request first: the retries above, and with
   ``preempt_every=K`` every K-th request is preempted once and rescheduled at the next step,
   which offers all its keys again (vLLM's scheduler restarts a rescheduled request at token
   0). A re-offer that stores keys adds them to the request's store jobs. With
   ``store_threshold >= 2`` re-offers are where vLLM 0.33 and 0.34 differ (0.34 counts a key
   once per request).
5. The request's transfers complete once ``lag`` later requests have been issued (default 8;
   ``0`` completes each request right after it is issued, leaving nothing to re-offer):
   ``complete_load(hits)``, ``complete_store(keys_to_store, success=...)`` per store job, and
   then ``on_request_finished(ctx)``. With ``fail_store_every=K`` every K-th store job (a
   non-empty ``keys_to_store``) completes with ``success=False``; off by default.
6. After the last request everything still pending completes, oldest first.

Counting: ``lookups`` counts every key of every request (also those after the first non-hit,
which the driver never asks about), so ``hits + misses == lookups`` and hit ratio is
``hits / lookups``. ``stored`` counts keys handed back in ``keys_to_store`` (failed stores
included; ``failed_store_keys`` says how many of them failed), ``evicted`` the keys in
``evicted_keys``.

Two recordings come out of a run:

* the *script*, always: per request ``(hits, first non-hit result, prepare_store result, the
  step's re-offer results)``, a few appends per request.
  :class:`kvcache.replay.baseline.NullManager` replays it to measure the driver's own cost;
  recording it in every run keeps that cost identical in both.
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

from kvcache._hints import retention_params
from kvcache.replay.backends import BOUND_POLICY, Backend
from kvcache.replay.errors import ConfigError
from kvcache.replay.workload import Workload

__all__ = [
    "DEFAULT_OPTIONS",
    "MAX_STORE_THRESHOLD",
    "NOT_CALLED",
    "Decision",
    "EventRecord",
    "ReplayOptions",
    "ReplayRun",
    "ScriptStep",
    "replay",
    "result_name",
]

#: The largest ``store_threshold`` a replay takes (vLLM's tracker counts offers per key).
MAX_STORE_THRESHOLD = 1_000_000

#: Script entry for a request whose keys all hit: ``prepare_store`` was not called.
NOT_CALLED: Any = type("NotCalled", (), {"__repr__": lambda self: "NOT_CALLED"})()

#: One request step of a run's script: (hits, first non-HIT lookup result or None,
#: prepare_store result: the manager's output, None for a failed prepare, or NOT_CALLED; the
#: results of the step's re-offers, in call order).
ScriptStep = tuple[int, Any, Any, tuple[Any, ...]]

#: A normalised event: ("stored" | "removed" | "removed-metadata", keys, medium name).
EventRecord = tuple[str, tuple[bytes, ...], str]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayOptions:
    """How the driver plays a workload, the same for every backend of one experiment.

    ``lag``: a request's loads and stores complete once ``lag`` later requests were issued.
    ``fail_store_every``: every K-th store job completes with ``success=False`` (0: never).
    ``preempt_every``: every K-th request is preempted and re-offers its keys (0: never).
    ``store_threshold``: the manager's ``store_threshold`` (offers a key needs before it is
    stored; below 2: at once).
    ``drain_events``: enable the manager's events and take them after every request step.
    """

    lag: int = 8
    fail_store_every: int = 0
    preempt_every: int = 0
    store_threshold: int = 1
    drain_events: bool = False

    def __post_init__(self) -> None:
        if self.lag < 0:
            raise ConfigError(f"lag must be >= 0, not {self.lag}")
        if self.fail_store_every < 0:
            raise ConfigError(f"fail-store-every must be >= 0, not {self.fail_store_every}")
        if self.preempt_every < 0:
            raise ConfigError(f"preempt-every must be >= 0, not {self.preempt_every}")
        if not 0 <= self.store_threshold <= MAX_STORE_THRESHOLD:
            raise ConfigError(
                f"store-threshold must be between 0 and {MAX_STORE_THRESHOLD}, "
                f"not {self.store_threshold}"
            )


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
    #: The step's re-offers: (request step, "ok" or "failed", keys to store, chunk ids,
    #: evicted keys) each.
    reoffers: tuple[
        tuple[int, str, tuple[bytes, ...], tuple[int, ...], tuple[bytes, ...]], ...
    ] = ()


@dataclass(slots=True, kw_only=True)
class ReplayRun:
    """Counters, time and recordings of one replay."""

    backend: str
    semantics: str
    policy: str
    num_chunks: int
    requests: int
    lookups: int
    hits: int
    stored: int
    evicted: int
    failed_prepares: int
    reoffers: int
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
            "reoffers": self.reoffers,
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


def _outcome(out: Any) -> tuple[str, tuple[bytes, ...], tuple[int, ...], tuple[bytes, ...]]:
    if out is NOT_CALLED or out is None:
        return ("none" if out is NOT_CALLED else "failed"), (), (), ()
    return (
        "ok",
        tuple(out.keys_to_store),
        tuple(map(int, out.store_spec.block_ids)),
        tuple(out.evicted_keys),
    )


def _decision(
    step: int,
    hits: int,
    stop: Any,
    out: Any,
    events: tuple[EventRecord, ...],
    reoffers: list[tuple[int, Any]],
) -> Decision:
    stop_name = None if stop is None else result_name(stop)
    store, keys, ids, evicted = _outcome(out)
    return Decision(
        step,
        hits,
        stop_name,
        store,
        keys,
        ids,
        evicted,
        events,
        tuple((req, *_outcome(result)) for req, result in reoffers),
    )


class _InFlight:
    """A request between its step and its completion: its context, the keys it loads, its
    store jobs ``(keys, success)`` and the keys it will offer again (None: none)."""

    __slots__ = ("ctx", "load", "reoffer", "step", "stores")

    def __init__(self, step: int, ctx: Any, load: tuple[bytes, ...]) -> None:
        self.step = step
        self.ctx = ctx
        self.load = load
        self.stores: list[tuple[Any, bool]] = []
        self.reoffer: Any = None


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
    manager = backend.make(
        num_chunks, policy, enable_events=take, store_threshold=options.store_threshold
    )
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
    pending: deque[_InFlight] = deque()
    hits = stored = evicted = failed_prepares = num_reoffers = 0
    store_seq = store_jobs = failed_stores = failed_store_keys = 0
    tick = max(1, total // 50)
    next_tick = tick if progress is not None else total + 1
    no_keys: tuple[bytes, ...] = ()
    preempt_every = options.preempt_every

    def store_job(job: _InFlight, out: Any) -> None:
        """Accounts for one prepare_store result of ``job``."""
        nonlocal stored, evicted, failed_prepares, store_seq, store_jobs
        nonlocal failed_stores, failed_store_keys
        if out is None:
            failed_prepares += 1
            return
        to_store = out.keys_to_store
        stored += len(to_store)
        evicted += len(out.evicted_keys)
        if not to_store:
            return
        store_jobs += 1
        success = True
        if fail_store_every:
            store_seq += 1
            if store_seq % fail_store_every == 0:
                success = False
                failed_stores += 1
                failed_store_keys += len(to_store)
        job.stores.append((to_store, success))

    def finish(job: _InFlight) -> None:
        if job.load:
            complete_load(job.load, job.ctx)
        for keys_done, ok in job.stores:
            complete_store(keys_done, job.ctx, success=ok)
        on_request_finished(job.ctx)

    # The offline bound is told, after each step, when the keys it stored or kept are used
    # next (computed before the clock starts; its timing is not reported).
    hint = getattr(manager, "_hint_next_uses", None) if policy == BOUND_POLICY else None
    next_uses = workload.next_uses() if hint is not None else ()

    # Each request's kv_transfer_params, built before the clock starts: a hinted request
    # carries kvcache's hint as an application would send it.
    hints = workload.hints
    params: list[dict[str, Any] | None] = (
        [None] * total
        if hints is None
        else [None if h is None else retention_params(h) for h in hints]  # type: ignore[arg-type]
    )

    start = time.perf_counter_ns()
    for idx, keys in enumerate(requests):
        hint_params = params[idx]
        ctx = make_ctx(f"r{idx}") if hint_params is None else make_ctx(f"r{idx}", hint_params)
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

        job = _InFlight(idx, ctx, load_keys)
        if n_hit < len(keys):
            offer = keys[n_hit:]
            out = prepare_store(offer, ctx)
            store_job(job, out)
            if out is None:
                job.reoffer = offer
        else:
            out = NOT_CALLED
        # Re-offers of requests still in flight (this step's own request is not among them).
        reoffers: list[tuple[int, Any]] = []
        for waiting in pending:
            again = waiting.reoffer
            if again is None:
                continue
            result = prepare_store(again, waiting.ctx)
            num_reoffers += 1
            store_job(waiting, result)
            waiting.reoffer = again if result is None else None
            reoffers.append((waiting.step, result))
        if hint is not None:
            hint(keys, next_uses[idx])
            for step, result in reoffers:
                if result is not None:
                    hint(requests[step], next_uses[step])
        if preempt_every and (idx + 1) % preempt_every == 0 and job.reoffer is None:
            job.reoffer = keys  # preempted now: rescheduled next step, from token 0
        pending.append(job)
        script.append((n_hit, stop, out, tuple(result for _, result in reoffers)))

        if len(pending) > lag:
            finish(pending.popleft())
        if take:
            if decisions is None:
                for _event in take_events():  # consumed, as the scheduler does, not kept
                    pass
            else:
                events = tuple(map(_event_record, take_events()))
                decisions.append(_decision(idx, n_hit, stop, out, events, reoffers))
        if idx == next_tick:
            progress(idx, total)  # type: ignore[misc]
            next_tick += tick

    while pending:
        finish(pending.popleft())
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

    stops = Counter(result_name(step[1]) for step in script if step[1] is not None)
    return ReplayRun(
        backend=backend.name,
        semantics=backend.semantics,
        policy=policy,
        num_chunks=num_chunks,
        requests=total,
        lookups=workload.key_visits,
        hits=hits,
        stored=stored,
        evicted=evicted,
        failed_prepares=failed_prepares,
        reoffers=num_reoffers,
        store_jobs=store_jobs,
        failed_stores=failed_stores,
        failed_store_keys=failed_store_keys,
        stops=dict(sorted(stops.items())),
        elapsed_ns=elapsed,
        script=script,
        decisions=decisions,
    )
