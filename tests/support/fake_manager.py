"""A stand-in manager for the replay driver's tests: an unbounded cache that records every call."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class FakeContext:
    def __init__(self, req_id: str) -> None:
        self.req_id = req_id
        self.positions: dict[bytes, int] = {}

    def set_offload_key_position(self, key: bytes, end_token: int) -> None:
        self.positions[key] = end_token

    def get_offload_key_position(self, key: bytes) -> int | None:
        return self.positions.get(key)


@dataclass
class FakeManager:
    """Unbounded cache: a key is HIT once its store completed, HIT_PENDING while in flight.

    ``fail_prepare`` makes ``prepare_store`` of those request ids return None;
    ``fail_prepare_times`` only for their first N calls.
    """

    calls: list[tuple[Any, ...]] = field(default_factory=list)
    ready: set[bytes] = field(default_factory=set)
    in_flight: set[bytes] = field(default_factory=set)
    fail_prepare: set[str] = field(default_factory=set)
    fail_prepare_times: dict[str, int] = field(default_factory=dict)
    next_chunk: int = 0

    def on_new_request(self, ctx: FakeContext) -> None:
        self.calls.append(("new", ctx.req_id))

    def lookup(self, k: bytes, ctx: FakeContext) -> str:
        self.calls.append(("lookup", ctx.req_id, k, ctx.get_offload_key_position(k)))
        if k in self.ready:
            return "HIT"
        return "HIT_PENDING" if k in self.in_flight else "MISS"

    def prepare_load(self, keys: Any, ctx: FakeContext) -> None:
        self.calls.append(("load", ctx.req_id, tuple(keys)))

    def complete_load(self, keys: Any, ctx: FakeContext) -> None:
        self.calls.append(("load_done", ctx.req_id, tuple(keys)))

    def prepare_store(self, keys: Any, ctx: FakeContext) -> Any:
        self.calls.append(("store", ctx.req_id, tuple(keys)))
        if ctx.req_id in self.fail_prepare:
            return None
        if self.fail_prepare_times.get(ctx.req_id, 0) > 0:
            self.fail_prepare_times[ctx.req_id] -= 1
            return None
        to_store = [k for k in keys if k not in self.ready and k not in self.in_flight]
        self.in_flight.update(to_store)
        ids = list(range(self.next_chunk, self.next_chunk + len(to_store)))
        self.next_chunk += len(to_store)
        return SimpleNamespace(
            keys_to_store=to_store, evicted_keys=[], store_spec=SimpleNamespace(block_ids=ids)
        )

    def complete_store(self, keys: Any, ctx: FakeContext, success: bool = True) -> None:
        self.calls.append(("store_done", ctx.req_id, tuple(keys), success))
        self.in_flight.difference_update(keys)
        if success:
            self.ready.update(keys)

    def on_request_finished(self, ctx: FakeContext) -> None:
        self.calls.append(("finished", ctx.req_id))

    def take_events(self) -> list[Any]:
        return []
