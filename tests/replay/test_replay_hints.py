"""Retention hints in the replay: a trace's ``"hint"`` field, ``--hints``, synthesised hints,
and what reaches the manager (kvcache's, and vLLM's with kvcache's turn policy)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest

from kvcache._hints import retention_params
from kvcache.replay import (
    Backend,
    ConfigError,
    HintMode,
    SyntheticChat,
    TraceError,
    Workload,
    apply_hints,
    compare_backends,
    compare_decisions,
    future_hints,
    kvcache_backend,
    load_mooncake_trace,
    make_key,
    parse_hint_mode,
    replay,
    synthetic_chat,
    vllm_backend,
)
from tests.support.cli_runs import assert_one_line_error, replay_json, run, write_trace
from tests.support.fake_manager import FakeManager


def key(i: int) -> bytes:
    return make_key(i.to_bytes(32, "big"))


def workload(*requests: list[int]) -> Workload:
    return Workload.from_requests("t", [[key(i) for i in r] for r in requests], block_tokens=4)


def line(hash_ids: list[int], **extra: Any) -> str:
    return json.dumps({"timestamp": 0, "input_length": 1024, "hash_ids": hash_ids, **extra})


# --- a trace's "hint" field ---------------------------------------------------------------------


def test_trace_hints_are_read_per_line(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            line([1, 2], hint="continues"),
            line([1, 2, 3]),
            line([4], hint=None),
            line([1, 2, 3, 5], hint="ends"),
        ],
    )
    wl = load_mooncake_trace(path)
    assert wl.hints == ("continues", None, None, "ends")
    assert wl.hint_source == "from the trace"


@pytest.mark.parametrize("value", ["absent", None])
def test_a_trace_without_hints_has_none(tmp_path: Path, value: str | None) -> None:
    extra = {} if value == "absent" else {"hint": value}
    path = write_trace(tmp_path / "t.jsonl", [line([1, 2], **extra), line([1, 2, 3], **extra)])
    wl = load_mooncake_trace(path)
    assert (wl.hints, wl.hint_source) == (None, None)


@pytest.mark.parametrize(
    "value", ["Continues", "ENDS", "continue", "", "yes", 1, 0, True, ["ends"], {"v": 1}]
)
def test_a_bad_hint_is_named_by_file_and_line(tmp_path: Path, value: object) -> None:
    good = line([1, 2], hint="ends")
    path = write_trace(tmp_path / "t.jsonl", [good, good, line([1, 3], hint=value), good])
    with pytest.raises(TraceError, match="'hint' must be one of 'continues', 'ends'") as info:
        load_mooncake_trace(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert "\n" not in str(info.value)


def test_a_bad_hint_is_one_line_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_trace(tmp_path / "t.jsonl", [line([1, 2]), line([1, 2, 3], hint="later")])
    result = run(["replay", "--trace", str(path), "--quiet"], capsys)
    assert_one_line_error(*result, f"{path}:2:", "'hint' must be one of", "'later'")


# --- --hints ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("trace", HintMode("trace")),
        ("off", HintMode("off")),
        ("future", HintMode("future")),
        ("future:0", HintMode("future")),
        ("future:0.1", HintMode("future", 0.1)),
        ("future:1e-1", HintMode("future", 0.1)),
        ("future:1", HintMode("future", 1.0)),
        ("random", HintMode("random")),
    ],
)
def test_hint_modes_parse(text: str, mode: HintMode) -> None:
    assert parse_hint_mode(text) == mode


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("future:", "error rate R from 0 to 1"),
        ("future:x", "error rate R from 0 to 1"),
        ("future:-0.1", "error rate R from 0 to 1"),
        ("future:1.5", "error rate R from 0 to 1"),
        ("future:nan", "error rate R from 0 to 1"),
        ("future:inf", "error rate R from 0 to 1"),
        ("futures", "--hints must be one of"),
        ("Random", "--hints must be one of"),
        ("", "--hints must be one of"),
        ("random:0.1", "--hints must be one of"),
    ],
)
def test_bad_hint_modes_are_one_line(
    text: str, fragment: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_hint_mode(text)
    # Refused before the workload is generated.
    monkeypatch.setattr("kvcache.cli.synthetic_chat", _no_workload)
    assert_one_line_error(*run(["replay", f"--hints={text}"], capsys), "--hints", fragment)


def _no_workload(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the workload was generated before --hints was checked")


def test_future_hints_on_a_hand_made_workload() -> None:
    wl = workload(
        [1, 2, 3],  # continues: request 2 names 2, its second-to-last key
        [7],  # one key, named again by request 5: continues
        [1, 2, 3, 4],  # its second-to-last key, 3, is never named again: ends
        [1, 2, 9, 10],  # 9 is named by request 4: continues
        [1, 2, 9, 11],  # ends (nothing after names 9)
        [7, 8],  # 7 named by nothing later: ends
        [5],  # one key never named again: ends
        [],  # no keys: ends
    )
    assert future_hints(wl) == [
        "continues",
        "continues",
        "ends",
        "continues",
        "ends",
        "ends",
        "ends",
        "ends",
    ]


def test_a_later_request_must_follow_not_precede() -> None:
    # Request 1 repeats request 0's keys, but request 0 comes first: only request 0 continues.
    assert future_hints(workload([1, 2], [1, 2, 3])) == ["continues", "ends"]


def test_synthetic_modes() -> None:
    wl = synthetic_chat(SyntheticChat(requests=400, seed=5))
    truth = future_hints(wl)
    exact = apply_hints(wl, "future")
    assert list(exact.hints or ()) == truth
    assert exact.hint_source == "synthetic: exact"
    inverted = apply_hints(wl, "future:1")
    assert [h != t for h, t in zip(inverted.hints or (), truth, strict=True)] == [True] * 400
    assert inverted.hint_source == "synthetic: 100% wrong"

    wrong = apply_hints(wl, "future:0.2", seed=3)
    assert wrong.hint_source == "synthetic: 20% wrong, seed 3"
    flipped = sum(h != t for h, t in zip(wrong.hints or (), truth, strict=True))
    assert 40 <= flipped <= 120  # 80 expected; binomial(400, 0.2) has a standard error of 8
    assert apply_hints(wl, "future:0.2", seed=3) == wrong  # the seed alone sets the draws
    assert apply_hints(wl, "future:0.2", seed=4).hints != wrong.hints

    coin = apply_hints(wl, "random", seed=3)
    assert coin.hint_source == "synthetic: random, seed 3"
    assert set(coin.hints or ()) == {"continues", "ends"}
    assert apply_hints(wl, "random", seed=3) == coin
    assert apply_hints(wl, "random", seed=4).hints != coin.hints

    assert apply_hints(wl, "trace") is wl
    off = apply_hints(exact, "off")
    assert (off.hints, off.hint_source) == (None, None)
    assert off.requests is wl.requests


def test_trace_mode_keeps_the_trace_hints_and_other_modes_replace_them(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [line([1, 2], hint="ends"), line([1, 2, 3])])
    wl = load_mooncake_trace(path)
    assert apply_hints(wl, "trace").hints == ("ends", None)
    assert apply_hints(wl, "future").hints == ("continues", "ends")
    assert apply_hints(wl, "off").hints is None


# --- labels -------------------------------------------------------------------------------------


def test_synthetic_hints_are_labelled_in_the_table_and_the_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["replay", "--quiet", "--requests", "40", "--capacity", "20%", "--policy", "turn"]
    rc, out, err = run([*argv, "--hints", "future:0.1"], capsys)
    assert rc == 0, err
    assert out.splitlines()[0].endswith("; hints: synthetic: 10% wrong, seed 0")
    document, _ = replay_json([*argv[2:], "--hints", "random", "--seed", "7"], capsys)
    assert document["meta"]["workload"]["hints"] == "synthetic: random, seed 7"
    assert [row["hints"] for row in document["rows"]] == ["synthetic: random, seed 7"]
    document, _ = replay_json([*argv[2:], "--hints", "future"], capsys)
    assert document["meta"]["workload"]["hints"] == "synthetic: exact"
    rc, out, err = run([*argv, "--csv", "--hints", "future:0.2"], capsys)
    assert rc == 0, err
    assert [r["hints"] for r in csv.DictReader(io.StringIO(out))] == [
        "synthetic: 20% wrong, seed 0"
    ]
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    assert "hints:" not in out
    document, _ = replay_json(argv[2:], capsys)
    assert document["meta"]["workload"]["hints"] is None
    assert document["rows"][0]["hints"] is None


def test_trace_hints_are_labelled_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_trace(tmp_path / "t.jsonl", [line([1, 2], hint="continues"), line([1, 2, 3])])
    document, _ = replay_json(["--trace", str(path), "--capacity", "2"], capsys)
    assert document["meta"]["workload"]["hints"] == "from the trace"


# --- --seed -------------------------------------------------------------------------------------


def test_seed_sets_drawn_hints_on_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_trace(tmp_path / "t.jsonl", [line([1, 2]), line([1, 2, 3]), line([4])])
    for mode in ("random", "future:0.5"):
        document, _ = replay_json(
            ["--trace", str(path), "--capacity", "2", "--hints", mode, "--seed", "9"], capsys
        )
        assert document["meta"]["workload"]["hints"].endswith(", seed 9")
    for mode in ("trace", "off", "future", "future:0", "future:1"):
        argv = ["replay", "--trace", str(path), "--hints", mode, "--seed", "9"]
        assert_one_line_error(*run(argv, capsys), "--seed", "drawn hints", "a trace")


def test_seed_sets_the_built_in_workload_and_its_drawn_hints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--requests", "30", "--capacity", "20%", "--policy", "lru", "--hints", "random"]
    one, _ = replay_json([*argv, "--seed", "1"], capsys)
    assert one["meta"]["workload"]["name"] == "synthetic-chat(requests=30, seed=1)"
    assert one["meta"]["workload"]["hints"] == "synthetic: random, seed 1"


# --- what reaches the manager -------------------------------------------------------------------


class ParamsContext:
    """A request context that keeps what the driver built it with."""

    def __init__(self, req_id: str, *args: Any, **kwargs: Any) -> None:
        self.req_id = req_id
        self.args, self.kwargs = args, kwargs
        self.positions: dict[bytes, int] = {}

    def set_offload_key_position(self, key: bytes, end_token: int) -> None:
        self.positions[key] = end_token

    def get_offload_key_position(self, key: bytes) -> int | None:
        return self.positions.get(key)


def test_each_request_carries_its_hint_as_kv_transfer_params() -> None:
    contexts: list[ParamsContext] = []

    class Recording(FakeManager):
        def on_new_request(self, ctx: Any) -> None:
            contexts.append(ctx)
            super().on_new_request(ctx)

    backend = Backend(
        name="fake",
        make=lambda num_chunks, policy, *, enable_events=False, store_threshold=1: Recording(),
        hit="HIT",
        req_context=ParamsContext,
    )
    wl = workload([1], [1, 2], [3]).with_hints(["continues", None, "ends"], "test")
    replay(backend, wl, policy="lru", num_chunks=8)
    assert [(c.req_id, c.args, c.kwargs) for c in contexts] == [
        ("r0", (retention_params("continues"),), {}),
        ("r1", (), {}),  # no hint: built as vLLM builds a context without kv_transfer_params
        ("r2", (retention_params("ends"),), {}),
    ]
    assert retention_params("ends") == {"kvcache": {"version": 1, "retention": "ends"}}


def spy(backend: Backend) -> tuple[Backend, list[Any]]:
    """``backend``, keeping every manager it builds."""
    made: list[Any] = []

    def make(*args: Any, **kwargs: Any) -> Any:
        made.append(backend.make(*args, **kwargs))
        return made[-1]

    return dataclasses.replace(backend, make=make), made


@pytest.mark.parametrize("policy", ["lru", "arc", "turn", "belady"])
def test_kvcache_manager_counts_the_hinted_requests(policy: str) -> None:
    wl = synthetic_chat(SyntheticChat(requests=60, seed=2))
    hinted = wl.with_hints([None if i % 3 == 0 else "ends" for i in range(60)], "test")
    backend, made = spy(kvcache_backend())
    replay(backend, hinted, policy=policy, num_chunks=wl.unique_blocks // 5)
    hinted_requests, ignored, _kept_hits = made[0]._take_stats()[5]
    assert (hinted_requests, ignored) == (40, 0)
    replay(backend, wl, policy=policy, num_chunks=wl.unique_blocks // 5)
    assert made[1]._take_stats()[5] == (0, 0, 0)


#: Large enough for the turn policy to learn what exact hints are worth at 5 % capacity.
HINTED = SyntheticChat(requests=1200, seed=1)


@pytest.fixture(scope="module")
def chat() -> Workload:
    return synthetic_chat(HINTED)


def decisions(backend: Backend, wl: Workload, policy: str, num_chunks: int) -> list[Any]:
    run = replay(backend, wl, policy=policy, num_chunks=num_chunks, record=True)
    assert run.decisions is not None
    return run.decisions


@pytest.mark.parametrize("policy", ["lru", "arc", "belady"])
@pytest.mark.parametrize("mode", ["future", "future:1", "random"])
def test_policies_that_ignore_hints_decide_as_without_them(
    policy: str, mode: str, chat: Workload
) -> None:
    ours = kvcache_backend()
    for num_chunks in (chat.unique_blocks // 20, chat.unique_blocks // 5):
        plain = decisions(ours, chat, policy, num_chunks)
        hinted = decisions(ours, apply_hints(chat, mode), policy, num_chunks)
        result = compare_decisions(plain, hinted, expected_name="off", actual_name=mode)
        assert result.matched, result.divergence


def test_turn_decides_differently_with_exact_hints(chat: Workload) -> None:
    """What makes the comparisons with vLLM below worth something: the hints change turn's
    decisions on this workload."""
    ours = kvcache_backend()
    num_chunks = chat.unique_blocks // 20
    plain = decisions(ours, chat, "turn", num_chunks)
    hinted = decisions(ours, apply_hints(chat, "future"), "turn", num_chunks)
    assert not compare_decisions(plain, hinted, expected_name="off", actual_name="future").matched


@pytest.mark.oracle
@pytest.mark.parametrize("mode", ["future", "future:0.2"])
def test_vllms_manager_with_kvcache_turn_decides_alike_with_hints(
    mode: str, chat: Workload
) -> None:
    """vLLM's manager hands its ReqContext (with kv_transfer_params) to kvcache's turn policy
    loaded by class name; kvcache's manager must decide exactly as that pair does."""
    hinted = apply_hints(chat, mode)
    result = compare_backends(
        vllm_backend(),
        kvcache_backend(),
        hinted,
        policy="turn",
        num_chunks=chat.unique_blocks // 20,
    )
    assert result.matched, result.divergence


@pytest.mark.oracle
def test_compare_vllm_with_hints_from_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(
        ["replay", "--compare-vllm", "--requests", "200", "--capacity", "5%,20%",
         "--policy", "lru,turn", "--hints", "future:0.1", "--quiet"],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert "DIVERGED" not in out
    assert out.count("identical") == 4  # two policies at two capacities
