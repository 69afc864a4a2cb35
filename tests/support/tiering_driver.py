"""A scheduler-shaped driver for vLLM's tiered offloading, recording every decision.

Two ``TieringOffloadingManager``s are built through vLLM's own spec factory, one by vLLM's
``TieringOffloadingSpec`` (vLLM's Python primary tier), one by kvcache's
``KvCacheTieringOffloadingSpec`` (kvcache's Rust primary tier), with the same secondary tiers
(each its own instance: vLLM's in-memory ``example`` tier, vLLM's ``fs`` tier on a temporary
directory, and the test's ``FaultyTier``). The same multi-turn workload runs through both:
lookups (hits, pending hits, promotions from a secondary tier, retries), loads, stores split
in two batches, failed stores, preempted requests, the end of every scheduler step
(``on_schedule_end``: cascades to the secondary tiers and promotions are submitted there),
request finishes, events, stats and cache resets with transfers in flight. After every step
each asynchronous tier is brought to rest (its I/O threads idle, its background lookups
answered), so that both managers see the same completions at the same point.

The log records everything observable: lookup results, load chunk ids, store decisions, every
event, the stats, the primary tier's counts (and deferred chunks), and each secondary tier's
contents. Two primary tiers decide identically exactly when the logs are equal.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.hint_cases import HINT_KINDS, hint_fields
from tests.support.keys import make_key
from tests.support.manager_driver import event_record, multi_turn_workload, store_batches
from tests.support.waiting import wait_until

TOKENS_PER_BLOCK = 16


def tiering_config(spec: str, tiers: list[dict[str, Any]], **extra: Any) -> Any:
    """The test adapter's configuration (tests/support/adapter_spec.py) for one side of a
    tiering run, with a shared host region of its own (a fresh engine id)."""
    import dataclasses

    from tests.support.adapter_spec import offloading_config

    names = (
        {"spec_name": "TieringOffloadingSpec"}
        if spec == "vllm"
        else {"spec_name": "KvCacheTieringOffloadingSpec", "spec_module_path": "kvcache.vllm"}
    )
    config = offloading_config(
        **{
            "cpu_bytes_to_use": 24 * 4096,
            "secondary_tiers": tiers,
            "tier_poll_interval_s": 0,
            **names,
            **extra,
        }
    )
    return dataclasses.replace(config, engine_id=f"kvcache-tiering-{uuid.uuid4().hex}")


def build(spec: str, tiers: list[dict[str, Any]], **extra: Any) -> tuple[Any, Any]:
    """The spec (through vLLM's factory) and its tiering manager."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    s = OffloadingSpecFactory.create_spec(tiering_config(spec, tiers, **extra))
    return s, s.get_manager()


# --- bringing asynchronous tiers to rest ----------------------------------------------------


class _CountingQueue:
    """A queue wrapper counting the entries of the batches put (None, the stop marker,
    excluded), each once it is in the queue: a reader that sees the count sees the entry."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.entries = 0
        self._lock = threading.Lock()

    def put(self, item: Any, *args: Any, **kw: Any) -> None:
        self._inner.put(item, *args, **kw)
        if item is not None:
            with self._lock:
                self.entries += len(item)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def instrument(manager: Any) -> None:
    """Counts each fs tier's background lookups in and answers out, so that :func:`settle`
    can wait for its lookups to be answered. Entries, not batches: vLLM 0.34's lookup thread
    answers one batch in one put per request."""
    for tier in manager.secondary_tiers:
        lm = getattr(tier, "_lookup_manager", None)
        if lm is not None and not isinstance(lm._lookup_queue, _CountingQueue):
            lm._lookup_queue = _CountingQueue(lm._lookup_queue)
            lm._pending_results = _CountingQueue(lm._pending_results)


def settle(manager: Any) -> None:
    """Until every secondary tier's I/O threads are idle and its background lookups are
    answered (bounded: a hang fails the test)."""
    for tier in manager.secondary_tiers:
        tier.drain_jobs() if hasattr(tier, "_pool") else None
        lm = getattr(tier, "_lookup_manager", None)
        if lm is None:
            continue
        wait_until(
            lambda lm=lm: lm._lookup_queue.entries == lm._pending_results.entries,
            "an fs tier's lookups answered",
        )


# --- the log ---------------------------------------------------------------------------------


def _timing(metric: str) -> bool:
    return any(w in metric for w in ("seconds", "_time", "delay"))


def _stats(manager: Any, hint_counts: Counter[str]) -> tuple:
    """Every metric, with durations (which differ run to run) reduced to how many there were;
    kvcache's retention-hint counters (which vLLM's primary tier has not) are added up in
    ``hint_counts`` instead."""
    from kvcache.vllm._metrics import HINT_METRICS

    stats = manager.get_stats()
    if stats is None:
        return ()
    data = stats.data.get("data", {})
    out = []
    for metric, series in sorted(data.items()):
        if metric in HINT_METRICS:
            hint_counts[metric] += sum(series.values())
            continue
        for labels, value in sorted(series.items(), key=repr):
            if _timing(metric):
                value = ("observations", len(value) if isinstance(value, list) else 1)
            out.append((metric, labels, repr(value)))
    return tuple(out)


def _tier_state(tier: Any) -> tuple:
    if hasattr(tier, "chunks"):
        return ("keys", tuple(sorted(tier.chunks)))
    # The fs tier: the block files under its model directory (the root differs per side).
    base = Path(tier.file_mapper.base_path)
    files = sorted(
        os.path.relpath(os.path.join(d, f), base) for d, _, fs in os.walk(base) for f in fs
    )
    return ("files", tuple(files))


def _primary_state(manager: Any) -> tuple:
    p = manager.primary_tier
    pending = (
        p.num_write_pending if hasattr(p, "num_write_pending") else p._num_write_pending_chunks
    )
    # vLLM 0.33's primary tier has no deferred releases.
    deferred = p.num_deferred_release_chunks if hasattr(p, "num_deferred_release_chunks") else 0
    return ("primary", deferred, pending)


@dataclass
class Options:
    lag: int = 2  # a request's transfers complete this many steps later
    fail_store_every: int = 5  # every k-th completed GPU->primary store fails
    preempt_every: int = 6  # every k-th request is preempted before its stores complete
    reset_every: int = 0  # reset_cache() every k requests, transfers still in flight
    conversations: int = 30
    hints: bool = False  # request i carries a retention hint of kind HINT_KINDS[i % n]


def request_hint(i: int, options: Options) -> str:
    """The kind of retention hint (``tests.support.hint_cases``) request ``i`` carries."""
    return list(HINT_KINDS)[i % len(HINT_KINDS)] if options.hints else "none"


def drive(
    manager: Any,
    requests: list[list[int]],
    options: Options,
    hint_counts: Counter[str] | None = None,
) -> list[tuple]:
    """Replays ``requests`` through a tiering manager; returns the decision log (and adds up
    the retention-hint counters of its stats in ``hint_counts``)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    instrument(manager)
    if hint_counts is None:
        hint_counts = Counter()
    log: list[tuple] = []
    pending: deque[tuple[Any, list[bytes], list[bytes], bool]] = deque()
    completed = 0

    def finish_oldest() -> None:
        nonlocal completed
        ctx, loaded, stored, preempted = pending.popleft()
        if loaded:
            manager.complete_load(loaded, ctx)
        if stored:
            completed += 1
            ok = not preempted and not (
                options.fail_store_every and completed % options.fail_store_every == 0
            )
            manager.complete_store(stored, ctx, success=ok)
        manager.on_request_finished(ctx)

    # Requests whose lookups were deferred (a promotion in flight, a tier to ask again) come
    # back at the next step, as vLLM's scheduler asks again; at most `retries` times.
    queue: deque[tuple[int, int]] = deque((i, 0) for i in range(len(requests)))
    contexts: dict[int, Any] = {}
    step = 0
    while queue:
        i, tries = queue.popleft()
        blocks = requests[i]
        step += 1
        if options.reset_every and step % options.reset_every == 0:
            pending.clear()  # vLLM's scheduler drops the pre-reset jobs
            manager.reset_cache()
            manager.on_reset_flushed()
            log.append(("reset", step))
        ctx = contexts.get(i)
        keys = [make_key(b, 0) for b in blocks]
        if ctx is None:
            params, kv_hints = hint_fields(request_hint(i, options))
            ctx = contexts[i] = ReqContext(
                req_id=f"req-{i}", kv_transfer_params=params, kv_hints=kv_hints
            )
            for j, key in enumerate(keys):
                ctx.set_offload_key_position(key, TOKENS_PER_BLOCK * (j + 1))
            manager.on_new_request(ctx)
        # vLLM's connector: hits and pending hits count and the scan goes on, a retry goes
        # on too (so tiers start their lookups), a miss ends it; any pending hit or retry
        # defers the request to a later step.
        results = []
        hits = 0
        deferred = False
        for key in keys:
            result = manager.lookup(key, ctx)
            results.append(getattr(result, "name", repr(result)))
            if result is LookupResult.MISS:
                break
            if result is LookupResult.HIT or result is LookupResult.HIT_PENDING:
                hits += 1
            deferred |= result is not LookupResult.HIT
        log.append(("lookup", i, tuple(results)))
        if deferred and tries < 4:
            queue.append((i, tries + 1))
            manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))
            settle(manager)
            log.append(("events", i, [event_record(e) for e in manager.take_events()]))
            log.append(_primary_state(manager))
            continue
        loaded = keys[:hits] if not deferred else []
        if loaded:
            spec = manager.prepare_load(loaded, ctx)
            log.append(("load", i, [int(x) for x in spec.block_ids]))
            log.append(("source", i, [manager.get_load_source(k, ctx).name for k in loaded[:2]]))
        rest = keys[hits:] if not deferred else []
        cut = max(1, len(rest) // 2)
        batches = [batch for batch in (rest[:cut], rest[cut:]) if batch]
        stored = store_batches(manager, batches, ctx, i, log)
        preempted = bool(options.preempt_every and i % options.preempt_every == 3)
        pending.append((ctx, loaded, stored, preempted))
        while len(pending) > options.lag:
            finish_oldest()
        manager.on_schedule_end(
            ScheduleEndContext(
                new_req_ids=[ctx.req_id], preempted_req_ids=[ctx.req_id] if preempted else []
            )
        )
        settle(manager)
        log.append(("events", i, [event_record(e) for e in manager.take_events()]))
        log.append(_primary_state(manager))
        log.append(("tiers", tuple(_tier_state(t) for t in manager.secondary_tiers)))
        if step % 5 == 0:
            log.append(("stats", i, _stats(manager, hint_counts)))
    while pending:
        finish_oldest()
    for _ in range(4):  # let every tier's last completions and deferred releases land
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))
        settle(manager)
    log.append(("events", "end", [event_record(e) for e in manager.take_events()]))
    log.append(_primary_state(manager))
    log.append(("stats", "end", _stats(manager, hint_counts)))
    return log


def run_both(
    tiers: list[dict[str, Any]],
    options: Options,
    seed: int,
    *,
    hint_counts: dict[str, Counter[str]] | None = None,
    **extra: Any,
) -> tuple[list[tuple], list[tuple]]:
    """The logs of vLLM's primary tier and kvcache's on the same workload and tiers. ``tiers``
    may hold ``{root}`` in an fs tier's ``root_dir``: each side gets a directory of its own.
    ``hint_counts`` gets each side's retention-hint counters (by side: "vllm", "kvcache")."""
    import tempfile

    requests = multi_turn_workload(seed, conversations=options.conversations)
    logs = []
    for side in ("vllm", "kvcache"):
        with tempfile.TemporaryDirectory() as root:
            side_tiers = [
                {**t, "root_dir": t["root_dir"].format(root=root)} if "root_dir" in t else dict(t)
                for t in tiers
            ]
            _spec, manager = build(side, side_tiers, **extra)
            counts: Counter[str] = Counter()
            if hint_counts is not None:
                hint_counts[side] = counts
            try:
                logs.append(drive(manager, requests, options, counts))
            finally:
                manager.shutdown()
    return logs[0], logs[1]
