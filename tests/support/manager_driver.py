"""A scheduler-shaped driver for offloading managers, recording every decision.

Runs a multi-turn chat workload through any object with vLLM's ``OffloadingManager`` methods and
returns a log of everything observable: lookup results, load chunk ids, store decisions (keys,
chunk ids, evicted keys, or a failed prepare), events and usage figures. Two managers decide
identically exactly when their logs are equal.

The workload and the driver are independent of ``kvcache.replay`` on purpose: this is the
oracle harness the conformance tests trust.
"""

from __future__ import annotations

import itertools
import random
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.support.keys import make_key


def multi_turn_workload(
    seed: int, *, conversations: int = 40, max_turns: int = 6, system_prompts: int = 4
) -> list[list[int]]:
    """Requests as lists of block ids in prefix order: a shared system prompt, then the
    conversation so far, then the new turn. Conversations interleave."""
    rng = random.Random(seed)
    next_block = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_block
        blocks = list(range(next_block, next_block + n))
        next_block += n
        return blocks

    systems = [fresh(rng.randint(2, 6)) for _ in range(system_prompts)]
    live = []
    for _ in range(conversations):
        history = list(systems[min(int(rng.paretovariate(1.2)) - 1, system_prompts - 1)])
        live.append([history, rng.randint(1, max_turns)])
    requests = []
    while live:
        i = rng.randrange(len(live))
        history, _turns = live[i]
        history.extend(fresh(rng.randint(1, 4)))  # the user's new turn
        requests.append(list(history))
        history.extend(fresh(rng.randint(0, 2)))  # the model's answer, part of the next prompt
        live[i][1] -= 1
        if live[i][1] == 0:
            live.pop(i)
    return requests


@dataclass
class DriverOptions:
    lag: int = 4  # a request's transfers complete once this many later requests were issued
    fail_every: int = 0  # every k-th completed store fails (0: never)
    split_stores: bool = True  # store a request's keys in two batches (chunked prefill)
    groups: int = 1  # KV-cache groups: each block yields one key per group
    reset_every: int = 0  # reset_cache() every k requests (0: never)
    touch_hits: bool = True  # where the manager has touch (vLLM 0.33)
    # Every k-th request offers its new keys a second time (a store retried, or re-offered
    # after a preemption): vLLM 0.34 counts a key toward store_threshold once per request.
    reoffer_every: int = 3
    tokens_per_block: int = 16


def _has_touch(manager: Any) -> bool:
    """vLLM 0.33's managers have touch; 0.34's have none (kvcache's native manager keeps the
    method and refuses it under 0.34 semantics)."""
    return hasattr(manager, "touch") and getattr(manager, "vllm_semantics", "0.33") == "0.33"


def _spec_ids(spec: Any) -> list[int]:
    return [int(x) for x in spec.block_ids]


def store_batches(
    manager: Any, batches: list[list[bytes]], ctx: Any, step: int, log: list[tuple]
) -> list[bytes]:
    """``prepare_store`` of each batch in turn, every decision logged; the keys to store."""
    stored: list[bytes] = []
    for batch in batches:
        out = manager.prepare_store(batch, ctx)
        if out is None:
            log.append(("store", step, None))
            continue
        log.append(
            (
                "store",
                step,
                tuple(out.keys_to_store),
                _spec_ids(out.store_spec),
                tuple(out.evicted_keys),
            )
        )
        stored.extend(out.keys_to_store)
    return stored


def event_record(e: Any) -> tuple:
    """Every field of an ``OffloadingEvent`` that either vLLM release has, as a tuple."""
    ctx = getattr(e, "req_context", None)  # vLLM 0.34's stored events carry the request's
    return (
        tuple(e.keys),
        getattr(e.medium, "value", e.medium),
        e.removed,
        getattr(e, "metadata_only", False),
        getattr(e, "removal_expected", False),
        getattr(e, "ownership", None),
        None if ctx is None else ctx.req_id,
    )


def drive(
    manager: Any,
    hit: Any,
    make_context: Callable[[str], Any],
    requests: list[list[int]],
    options: DriverOptions,
) -> list[tuple]:
    """Replays ``requests`` through ``manager``; returns the decision log."""
    log: list[tuple] = []
    pending: deque[tuple[Any, list[bytes], list[bytes]]] = deque()
    completed_stores = 0

    def complete_oldest() -> None:
        nonlocal completed_stores
        ctx, loaded, stored = pending.popleft()
        if loaded:
            manager.complete_load(loaded, ctx)
        if stored:
            completed_stores += 1
            ok = not (options.fail_every and completed_stores % options.fail_every == 0)
            manager.complete_store(stored, ctx, success=ok)
        manager.on_request_finished(ctx)
        log.append(("events", [event_record(e) for e in manager.take_events()]))

    for i, blocks in enumerate(requests):
        if options.reset_every and i and i % options.reset_every == 0:
            # vLLM's scheduler drops the pre-reset jobs: they never complete.
            pending.clear()
            manager.reset_cache()
            log.append(("reset",))
        ctx = make_context(f"req-{i}")
        keys = []
        for j, block in enumerate(blocks):
            for g in range(options.groups):
                key = make_key(block, g)
                ctx.set_offload_key_position(key, options.tokens_per_block * (j + 1))
                keys.append(key)
        manager.on_new_request(ctx)
        results = []
        hits = 0
        for key in keys:
            result = manager.lookup(key, ctx)
            results.append(result.name)
            if result != hit:
                break
            hits += 1
        log.append(("lookup", i, tuple(results)))
        loaded = keys[:hits]
        if loaded:
            log.append(("load", i, _spec_ids(manager.prepare_load(loaded, ctx))))
            if options.touch_hits and _has_touch(manager):
                manager.touch(loaded, ctx)
        rest = keys[hits:]
        batches = [rest]
        if options.split_stores and len(rest) > 1:
            cut = len(rest) // 2
            batches = [rest[:cut], rest[cut:]]
        if options.reoffer_every and i % options.reoffer_every == 0 and rest:
            batches.append(rest)
        stored = store_batches(manager, batches, ctx, i, log)
        pending.append((ctx, loaded, stored))
        while len(pending) > options.lag:
            complete_oldest()
        if i % 7 == 0:
            log.append(("stats", _stats(manager)))
    while pending:
        complete_oldest()
    log.append(("stats", _stats(manager)))
    return log


def _stats(manager: Any) -> tuple:
    stats = manager.get_stats()
    if stats is None:
        return ()
    data = getattr(stats, "data", stats)
    if isinstance(data, dict):
        return tuple(sorted((k, repr(v)) for k, v in data.items()))
    return (repr(data),)


# Replay configurations: policy, chunks (tight: many evictions and failed prepares; roomy),
# fail every k-th store (0: never), KV-cache groups, store_threshold.
REPLAY_CASES = list(itertools.product(["lru", "arc", "turn"], [24, 96], [0, 5], [1, 2], [1, 2]))
REPLAY_CASE_NAMES = ("policy", "num_chunks", "fail_every", "groups", "threshold")


def replay_both(
    run: Callable[..., list[tuple]],
    policy: str,
    num_chunks: int,
    fail_every: int,
    groups: int,
    threshold: int,
) -> tuple[list[tuple], list[tuple]]:
    """The decision logs of the reference (``run(..., False, ...)``) and ours (``True``) on the
    same seeded workload, with resets every 97 requests."""
    options = DriverOptions(fail_every=fail_every, groups=groups, reset_every=97)
    seed = zlib.crc32(repr((policy, num_chunks, fail_every, groups, threshold)).encode())
    ref = run(policy, False, num_chunks, options, threshold=threshold, seed=seed)
    ours = run(policy, True, num_chunks, options, threshold=threshold, seed=seed)
    return ref, ours


def assert_same_decisions(ref: list[tuple], ours: list[tuple]) -> None:
    for i, (a, b) in enumerate(zip(ref, ours, strict=True)):
        assert a == b, f"decision {i} differs:\n vLLM: {a}\n ours: {b}"
