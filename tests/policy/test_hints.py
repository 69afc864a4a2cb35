"""Retention hints without vLLM: reading them (``kvcache._hints``), and kvcache's manager and
policies receiving them from a request's context, once, counting the ones they could not read.

The end-to-end paths through vLLM's scheduler, HTTP request models and metrics are in
``test_vllm_hints.py``; hostile hint objects, each in a fresh interpreter, in
``test_hostile_hints.py``.
"""

from __future__ import annotations

import gc
import logging
import pickle
import typing
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import pytest

import kvcache
from kvcache import _hints
from kvcache._hints import MAX_ACTIONS, MAX_FIELDS, read_retention, retention_params
from tests.support.hint_cases import HINT_KINDS, action, envelope, hint_fields, tally
from tests.support.hostile import raises_unchanged
from tests.support.keys import make_key, request_keys

POLICIES = list(kvcache.POLICY_KINDS)


@pytest.fixture(autouse=True)
def fresh_log() -> Iterator[None]:
    """Each test sees every kind of mistake logged anew (the module logs each kind once)."""
    saved = set(_hints._logged)
    _hints._logged.clear()
    yield
    _hints._logged.clear()
    _hints._logged.update(saved)


# --- retention_params ---------------------------------------------------------------------


def test_retention_params_is_the_schema() -> None:
    assert retention_params("continues") == {"kvcache": {"version": 1, "retention": "continues"}}
    assert retention_params("ends") == {"kvcache": {"version": 1, "retention": "ends"}}
    assert read_retention(retention_params("ends"), None) == ("ends", None)


@pytest.mark.parametrize("value", ["maybe", "", "Continues", None, 1])
def test_retention_params_refuses_other_values(value: Any) -> None:
    with pytest.raises(ValueError, match="retention must be one of"):
        retention_params(value)


# --- read_retention: every problem ----------------------------------------------------------


class RaisingDict(dict):  # type: ignore[type-arg]
    def get(self, *args: Any) -> Any:
        raise RuntimeError("get")

    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("iter")


class Name(str):
    """A str subclass: equal to the schema's names, but not a str."""


class RaisingAttributes:
    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(name)


def fields(n: int) -> dict[str, int]:
    return {f"f{i}": i for i in range(n)}


#: ``(kv_transfer_params, kv_hints)`` and what reading them gives, for every problem kind and
#: the readable shapes next to them.
CASES: dict[str, tuple[Any, Any, str | None, str | None]] = {
    "nothing": (None, None, None, None),
    "foreign params": ({"do_remote_prefill": True}, None, None, None),
    "params not a dict": (["kvcache"], None, None, None),
    "key set to None": ({"kvcache": None}, None, None, None),
    "params": (retention_params("continues"), None, "continues", None),
    "envelope": (None, envelope(action("ends")), "ends", None),
    "both agree": (retention_params("ends"), envelope(action("ends")), "ends", None),
    "two actions agree": (None, envelope(action("ends"), action("ends")), "ends", None),
    "foreign action": (None, envelope(action("x", kind="other")), None, None),
    "foreign action of another version": (
        None,
        envelope(action("x", kind="other", version="9")),
        None,
        None,
    ),
    "hint a string": ({"kvcache": "continues"}, None, None, "not_a_mapping"),
    "hint a list": ({"kvcache": ["continues"]}, None, None, "not_a_mapping"),
    "payload not a mapping": (
        None,
        envelope(SimpleNamespace(action_type="kvcache.retention", action_version="1", payload=[])),
        None,
        "not_a_mapping",
    ),
    "kv_hints a dict": (None, {"actions": [action("ends")]}, None, "not_an_envelope"),
    "actions not a list": (None, SimpleNamespace(actions="ends"), None, "not_an_envelope"),
    "no version": ({"kvcache": {"retention": "ends"}}, None, None, "unknown_version"),
    "version 2": ({"kvcache": {"version": 2, "retention": "ends"}}, None, None, "unknown_version"),
    "version as text": (
        {"kvcache": {"version": "1", "retention": "ends"}},
        None,
        None,
        "unknown_version",
    ),
    "version True": (
        {"kvcache": {"version": True, "retention": "ends"}},
        None,
        None,
        "unknown_version",
    ),
    "version 1.0": (
        {"kvcache": {"version": 1.0, "retention": "ends"}},
        None,
        None,
        "unknown_version",
    ),
    "action version 2": (None, envelope(action("ends", version="2")), None, "unknown_version"),
    "extra field": (
        {"kvcache": {"version": 1, "retention": "ends", "ttl": 3}},
        None,
        None,
        "unknown_field",
    ),
    "field not a str": ({"kvcache": {1: 1, "retention": "ends"}}, None, None, "unknown_field"),
    "field a str subclass": (
        {"kvcache": {"version": 1, Name("retention"): "ends"}},
        None,
        None,
        "unknown_field",
    ),
    "version in a payload": (
        None,
        envelope(
            SimpleNamespace(
                action_type="kvcache.retention",
                action_version="1",
                payload={"version": 1, "retention": "ends"},
            )
        ),
        None,
        "unknown_field",
    ),
    "no retention": ({"kvcache": {"version": 1}}, None, None, "bad_value"),
    "unknown retention": (
        {"kvcache": {"version": 1, "retention": "later"}},
        None,
        None,
        "bad_value",
    ),
    "retention a str subclass": (
        {"kvcache": {"version": 1, "retention": Name("ends")}},
        None,
        None,
        "bad_value",
    ),
    "retention nested deep": (
        {"kvcache": {"version": 1, "retention": [[[["ends"]]]]}},
        None,
        None,
        "bad_value",
    ),
    "too many fields": ({"kvcache": fields(MAX_FIELDS + 1)}, None, None, "oversized"),
    "too many actions": (
        None,
        envelope(*[action("ends")] * (MAX_ACTIONS + 1)),
        None,
        "oversized",
    ),
    "params and envelope disagree": (
        retention_params("continues"),
        envelope(action("ends")),
        None,
        "conflict",
    ),
    "two actions disagree": (None, envelope(action("ends"), action("continues")), None, "conflict"),
    "params raise": (RaisingDict(kvcache=1), None, None, "unreadable"),
    "hint raises": ({"kvcache": RaisingDict(version=1)}, None, None, "unreadable"),
    "envelope raises": (None, RaisingAttributes(), None, "unreadable"),
    "action raises": (None, envelope(RaisingAttributes()), None, "unreadable"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_read_retention(case: str) -> None:
    params, hints, value, problem = CASES[case]
    assert read_retention(params, hints) == (value, problem)


def test_the_cases_cover_every_problem() -> None:
    covered = {problem for *_, problem in CASES.values()}
    assert covered - {None} == set(typing.get_args(_hints.Problem))
    assert set(_hints._PROBLEM_TEXT) == set(typing.get_args(_hints.Problem))


def test_each_kind_of_mistake_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvcache.hints")
    for _ in range(3):
        for params, hints, _, _ in CASES.values():
            read_retention(params, hints)
    problems = {problem for *_, problem in CASES.values()} - {None}
    records = [r for r in caplog.records if r.name == "kvcache.hints"]
    assert len(records) == len(problems)
    assert all(r.levelno == logging.WARNING for r in records)
    texts = {r.getMessage() for r in records}
    for problem in problems:
        (text,) = [t for t in texts if _hints._PROBLEM_TEXT[problem] in t]
        assert text.startswith("kvcache ignored a request's retention hint: ")


def test_a_logged_mistake_shows_no_part_of_the_hint(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvcache.hints")
    read_retention({"kvcache": {"version": 1, "retention": "SECRET-" + "x" * 1000}}, None)
    (record,) = caplog.records
    assert "SECRET" not in record.getMessage()


class CountingMapping(Mapping[str, Any]):
    """A mapping of a million names that counts how many were read."""

    def __init__(self) -> None:
        self.pulled = 0

    def __getitem__(self, name: str) -> Any:
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        for i in range(10**6):
            self.pulled += 1
            yield f"f{i}"

    def __len__(self) -> int:
        return 10**6


class CountingActions(list):  # type: ignore[type-arg]
    def __init__(self) -> None:
        super().__init__()
        self.pulled = 0

    def __iter__(self) -> Iterator[Any]:
        for _ in range(10**6):
            self.pulled += 1
            yield action("ends", kind="other")


def test_reading_is_bounded_whatever_the_size() -> None:
    hint = CountingMapping()
    assert read_retention({"kvcache": hint}, None) == (None, "oversized")
    assert hint.pulled == MAX_FIELDS + 1
    actions = CountingActions()
    assert read_retention(None, SimpleNamespace(actions=actions)) == (None, "oversized")
    assert actions.pulled == MAX_ACTIONS + 1


class Interrupting:
    @property
    def actions(self) -> Any:
        raise KeyboardInterrupt


def test_an_interrupt_while_reading_propagates() -> None:
    with pytest.raises(KeyboardInterrupt):
        read_retention(None, Interrupting())


# --- the manager and the policies receive hints ---------------------------------------------


def context(req_id: str, kind: str) -> kvcache.ReqContext:
    params, hints = hint_fields(kind)
    return kvcache.ReqContext(req_id, params, hints)


def store(manager: Any, ctx: Any, blocks: range) -> None:
    keys = request_keys(ctx, blocks, [0])
    out = manager.prepare_store(keys, ctx)
    if out is not None:
        manager.complete_store(out.keys_to_store, ctx)


@pytest.mark.parametrize("first_call", ["on_new_request", "prepare_store"])
@pytest.mark.parametrize("policy", POLICIES)
def test_the_manager_counts_hinted_requests_and_ignored_hints(policy: str, first_call: str) -> None:
    """Read once per request, from the first call that records it: ``on_new_request``, or
    ``prepare_store`` under vLLM's tiering manager (which does not pass ``on_new_request`` on
    to its primary tier)."""
    m = kvcache.OffloadingManager(256, policy)
    kinds = list(HINT_KINDS) * 2
    contexts = [context(f"r{i}", kind) for i, kind in enumerate(kinds)]
    for i, ctx in enumerate(contexts):
        if first_call == "on_new_request":
            m.on_new_request(ctx)
        store(m, ctx, range(4 * i, 4 * i + 3))
        store(m, ctx, range(4 * i, 4 * i + 4))  # read once, whatever the calls
        m.on_request_finished(ctx)
    stats = m.get_stats()
    hinted, ignored = tally(kinds)
    assert (stats.hinted_requests, stats.ignored_hints) == (hinted, ignored)
    assert hinted > 0
    assert ignored > 0
    again = m.get_stats()
    assert (again.hinted_requests, again.ignored_hints, again.hint_kept_hits) == (0, 0, 0)
    m.validate()


def test_manager_stats_default_to_no_hints() -> None:
    stats = kvcache.OffloadingManager(4).get_stats()
    assert (stats.hinted_requests, stats.ignored_hints, stats.hint_kept_hits) == (0, 0, 0)
    assert kvcache.ManagerStats(0.0, 0.0, 0.0, [], None).hinted_requests == 0


def hint_samples(state: dict[str, Any]) -> int:
    return int(state["continues_sampled"] + state["ends_sampled"] + state["unhinted_sampled"])


def test_turn_in_the_manager_learns_from_hints_and_only_then() -> None:
    """turn keeps hint statistics once a hinted request arrives: the same traffic without
    hints keeps none, so a count there shows the hints arrived."""
    sampled = {}
    for hinted in (False, True):
        m = kvcache.OffloadingManager(512, "turn")
        for r in range(6):
            kind = ("params-continues", "envelope-ends")[r % 2] if hinted else "none"
            ctx = context(f"r{r}", kind)
            m.on_new_request(ctx)
            store(m, ctx, range(64 * r, 64 * r + 64))
            m.on_request_finished(ctx)
        sampled[hinted] = hint_samples(m._debug_state())
        m.validate()
    assert sampled == {False: 0, True: sampled[True]}
    assert sampled[True] > 0


def test_turn_as_a_policy_learns_from_hints_and_only_then() -> None:
    """The same through the policy protocol, as vLLM's manager drives kvcache's policy."""
    sampled = {}
    for hinted in (False, True):
        policy = kvcache.TurnCachePolicy(cache_capacity=512)
        for r in range(6):
            kind = ("params-continues", "envelope-ends")[r % 2] if hinted else "none"
            ctx = context(f"r{r}", kind)
            keys = [make_key(b) for b in range(64 * r, 64 * r + 64)]
            for i, key in enumerate(keys):
                ctx.set_offload_key_position(key, 16 * (i + 1))
                chunk = kvcache.ChunkStatus(64 * r + i)
                chunk.ref_cnt = 0
                policy.insert(key, chunk, ctx)
            policy.on_request_finished((tuple(keys),), set(keys), set(), ctx)
        sampled[hinted] = hint_samples(policy._debug_state())
        policy.validate()
    assert sampled == {False: 0, True: sampled[True]}
    assert sampled[True] > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_hint_state_is_freed_with_the_request(policy: str) -> None:
    m = kvcache.OffloadingManager(64, policy)
    contexts = [context(f"r{i}", kind) for i, kind in enumerate(HINT_KINDS)]
    for ctx in contexts:
        m.on_new_request(ctx)
    assert m.num_requests == len(contexts)
    del contexts, ctx
    gc.collect()
    alive = kvcache.ReqContext("next")
    m.on_new_request(alive)  # buries the dead requests
    assert m.num_requests == 1
    m.validate()


class CallsBack:
    """``kv_transfer_params`` that calls back into the manager reading it."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    @property
    def kv_transfer_params(self) -> Any:
        self.manager.lookup(make_key(0))
        return retention_params("ends")


class CallbackContext(kvcache.ReqContext):
    __slots__ = ("callback",)

    @property  # type: ignore[override]
    def kv_transfer_params(self) -> Any:
        return self.callback.kv_transfer_params

    @kv_transfer_params.setter
    def kv_transfer_params(self, value: Any) -> None:
        pass


def test_a_hint_that_calls_back_into_the_manager_is_ignored() -> None:
    m = kvcache.OffloadingManager(8, "turn")
    ctx = CallbackContext("r")
    ctx.callback = CallsBack(m)
    m.on_new_request(ctx)
    stats = m.get_stats()
    assert (stats.hinted_requests, stats.ignored_hints) == (0, 1)
    m.validate()


class InterruptingContext(kvcache.ReqContext):
    __slots__ = ()

    @property  # type: ignore[override]
    def kv_hints(self) -> Any:
        raise KeyboardInterrupt

    @kv_hints.setter
    def kv_hints(self, value: Any) -> None:
        pass


@pytest.mark.parametrize("call", ["on_new_request", "prepare_store", "prepare_load"])
def test_an_interrupt_while_reading_a_hint_leaves_the_manager_unchanged(call: str) -> None:
    m = kvcache.OffloadingManager(8, "turn")
    warm = kvcache.ReqContext("warm")
    store(m, warm, range(2))
    ctx = InterruptingContext("r")
    keys = [make_key(0)] if call == "prepare_load" else [make_key(5)]
    ctx.set_offload_key_position(keys[0], 16)
    args = () if call == "on_new_request" else (keys,)
    raises_unchanged(m, lambda: getattr(m, call)(*args, ctx), KeyboardInterrupt)
    stats = m.get_stats()
    assert (stats.hinted_requests, stats.ignored_hints) == (0, 0)


def test_req_context_carries_kv_hints() -> None:
    hints = envelope(action("continues"))
    ctx = kvcache.ReqContext("r", None, hints)
    assert ctx.kv_hints is hints
    assert kvcache.ReqContext("r").kv_hints is None
    copy = pickle.loads(pickle.dumps(kvcache.ReqContext("r", retention_params("ends"), hints)))
    assert read_retention(copy.kv_transfer_params, copy.kv_hints) == (None, "conflict")
    m = kvcache.OffloadingManager(4, "lru")
    m.on_new_request(ctx)
    assert m.get_stats().hinted_requests == 1
