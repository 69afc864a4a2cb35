"""The ``kvcache`` command: error paths (one line, exit 2, no traceback), options and outputs."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvcache
import kvcache.cli as cli
import kvcache.replay.progress as progress_module
from kvcache.replay import Backend, vllm_backend
from tests.support.cli_runs import assert_one_line_error, replay_json, run, write_trace
from tests.support.oracle import require_oracle

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"
REQUIRED = {
    "policy",
    "capacity",
    "requests",
    "lookups",
    "hits",
    "hit_ratio",
    "stored",
    "evicted",
    "failed_prepares",
    "ns_per_visit",
}


GOOD_LINE = json.dumps(
    {"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]}
)


def test_missing_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    assert_one_line_error(
        *run(["replay", "--trace", str(missing)], capsys), "nope.jsonl", "no such"
    )


def test_malformed_line_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path / "t.jsonl", [GOOD_LINE, GOOD_LINE, GOOD_LINE, '{"hash_ids": [1,'])
    assert_one_line_error(*run(["replay", "--trace", str(path)], capsys), f"{path}:4:")


@pytest.mark.parametrize("policy", ["fifo", "lru,mru", "", "lru,"])
def test_unknown_policy(policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(*run(["replay", "--policy", policy], capsys), "unknown policy")


@pytest.mark.parametrize(
    ("capacity", "fragment"),
    [
        ("0", "must be > 0"),
        ("-5", "must be > 0"),
        ("0%", "must be > 0"),
        ("-10%", "must be > 0"),
        ("abc", "malformed capacity"),
        ("10%%", "malformed capacity"),
        ("1.5", "malformed capacity"),
        ("10%,,20%", "empty item"),
        ("nan%", "must be > 0"),
    ],
)
def test_bad_capacity(capacity: str, fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(*run(["replay", f"--capacity={capacity}"], capsys), fragment)


def test_capacity_below_one_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    result = run(["replay", "--requests", "20", "--capacity", "0.0001%"], capsys)
    assert_one_line_error(*result, "less than one chunk")


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "--lag", "-1"],
        ["replay", "--requests", "0"],
        ["replay", "--repeat", "x"],
        ["replay", "--backend", "nonesuch"],
        ["replay", "--no-such-option"],
    ],
)
def test_bad_options_are_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(*run(argv, capsys))


@pytest.mark.parametrize("argv", [["--help"], ["replay", "--help"]])
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(argv, capsys)
    assert rc == 0
    assert "usage: kvcache" in out
    if "replay" in argv:
        assert "--capacity LIST" in out
        assert "10%,25%,50%,100%" in out


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run([], capsys)
    assert rc == 2
    assert "replay" in err


def test_plot_without_matplotlib(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import fail
    result = run(["replay", "--plot", "out.png", "--requests", "5"], capsys)
    assert_one_line_error(*result, "matplotlib")


def subprocess_env() -> dict[str, str]:
    """The environment for a fresh interpreter that imports this checkout's kvcache."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")]),
    }


def run_python(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a fresh interpreter (``subprocess_env()`` unless ``env``)."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=subprocess_env() if env is None else env,
        check=False,
        timeout=timeout,
    )


def test_module_entry_point_error_has_no_traceback(tmp_path: Path) -> None:
    proc = run_python(["-m", "kvcache", "replay", "--trace", str(tmp_path / "missing.jsonl")])
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr


def test_importing_the_cli_does_not_import_vllm_or_torch() -> None:
    code = (
        "import sys, kvcache, kvcache.cli, kvcache.replay; "
        "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr


# --- outputs (these replay through vLLM's manager) --------------------------------------------


@pytest.mark.oracle
def test_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(
        [
            "replay", "--backend", "vllm", "--requests", "60", "--policy", "lru,arc",
            "--capacity", "10%,50", "--json", "--quiet",
        ],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    document = json.loads(out)
    assert document["schema"] == 1
    assert document["meta"]["backend"] == "vllm"
    rows = document["rows"]
    assert len(rows) == 4
    for row in rows:
        assert set(row) >= REQUIRED
        assert row["backend"] == "vllm"
        assert row["requests"] == 60
        assert row["hits"] + row["misses"] == row["lookups"]
        assert row["hit_ratio"] == pytest.approx(row["hits"] / row["lookups"])
        assert isinstance(row["ns_per_visit"], float)
    assert [(r["policy"], r["capacity_spec"]) for r in rows] == [
        ("lru", "10%"),
        ("lru", "50"),
        ("arc", "10%"),
        ("arc", "50"),
    ]
    assert rows[1]["capacity"] == 50


@pytest.mark.oracle
def test_table_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [
        json.dumps({"timestamp": i, "input_length": 2048, "output_length": 5, "hash_ids": ids})
        for i, ids in enumerate([[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [6], [1, 2, 3, 5, 7]])
    ]
    path = write_trace(tmp_path / "t.jsonl", lines)
    rc, out, err = run(
        ["replay", "--backend", "vllm", "--trace", str(path), "--capacity", "4,100%", "--lag", "0"],
        capsys,
    )
    assert rc == 0, err
    assert "5 requests, 16 key visits, 7 unique blocks (512 tokens each)" in out
    assert "hit ratio" in out
    assert "ns/visit" in out
    assert len([line for line in out.splitlines() if line.startswith(("lru ", "arc "))]) == 4


@pytest.mark.oracle
def test_compare_vllm_reports_identical(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(
        ["replay", "--backend", "vllm", "--compare-vllm", "--requests", "60", "--capacity", "20%",
         "--fail-store-every", "3", "--quiet"],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert "identical" in out
    assert "speedup" in out


class _LieOnce:
    """A vLLM manager that reports its 5th hit as a miss."""

    def __init__(self, inner: Any, hit: Any) -> None:
        self._inner, self._hit, self._hits = inner, hit, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def lookup(self, key: bytes, ctx: Any) -> Any:
        result = self._inner.lookup(key, ctx)
        if result == self._hit:
            self._hits += 1
            if self._hits == 5:
                return type(result).MISS
        return result


@pytest.mark.oracle
def test_divergence_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    vllm = vllm_backend()
    liar = Backend(
        name="liar",
        make=lambda n, p, *, enable_events=False, store_threshold=1: _LieOnce(
            vllm.make(n, p, enable_events=enable_events), vllm.hit
        ),
        hit=vllm.hit,
        req_context=vllm.req_context,
    )
    monkeypatch.setattr(cli, "get_backend", lambda name, semantics=None: liar)
    rc, out, err = run(
        ["replay", "--compare-vllm", "--requests", "60", "--capacity", "50%", "--policy", "lru"],
        capsys,
    )
    assert rc == 1, err
    assert "DIVERGED" in out
    assert "divergence (lru" in out
    assert "hits differ" in out


@pytest.mark.oracle
def test_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "hits.png"
    rc, _, err = run(
        ["replay", "--backend", "vllm", "--requests", "40", "--capacity", "10%,50%",
         "--plot", str(target), "--quiet"],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert target.stat().st_size > 0


# --- the kvcache backend: options in operator units, outputs, progress ------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--version"], capsys)
    assert rc == 0
    assert out == f"kvcache {kvcache.__version__}\n"


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("ARCCachePolicy,LRUCachePolicy", ["arc", "lru"]),
        ("lrucachepolicy,LRU,arc", ["lru", "arc"]),
    ],
)
def test_policy_accepts_vllm_class_names(
    policy: str, expected: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    document, _ = replay_json(["--requests", "30", "--capacity", "50%", "--policy", policy], capsys)
    assert [row["policy"] for row in document["rows"]] == expected


def test_json_carries_run_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [
        json.dumps({"timestamp": i, "input_length": 1024, "output_length": 5, "hash_ids": ids})
        for i, ids in enumerate([[1, 2], [1, 2, 3], [4], [1, 2, 3, 5]])
    ]
    path = write_trace(tmp_path / "t.jsonl", lines)
    document, _ = replay_json(
        ["--trace", str(path), "--capacity", "3", "--lag", "1", "--repeat", "2"], capsys
    )
    meta = document["meta"]
    assert meta["kvcache"] == kvcache.__version__
    try:
        vllm_version: str | None = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm_version = None
    assert meta["vllm"] == vllm_version
    assert meta["workload"] == {
        "name": "mooncake:t.jsonl",
        "requests": 4,
        "key_visits": 10,
        "unique_blocks": 5,
        "block_tokens": 512,
        "hints": None,
        "trace": str(path.resolve()),
        "trace_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    assert (meta["backend"], meta["reference"], meta["lag"], meta["repeat"]) == (
        "kvcache",
        None,
        1,
        2,
    )
    assert meta["host"] == platform.node()
    assert meta["python"] == platform.python_version()
    date = datetime.datetime.fromisoformat(meta["date"])
    assert date.tzinfo is not None
    assert abs((datetime.datetime.now(datetime.UTC) - date).total_seconds()) < 600
    assert meta["command"].startswith("kvcache replay --quiet --json --trace ")
    row = document["rows"][0]
    assert (row["capacity"], row["lag"], row["repeat"]) == (3, 1, 2)


def test_csv(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(
        ["replay", "--quiet", "--csv", "--requests", "40", "--capacity", "10%,20"], capsys
    )
    assert rc == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [(r["policy"], r["capacity_spec"]) for r in rows] == [
        ("lru", "10%"),
        ("lru", "20"),
        ("arc", "10%"),
        ("arc", "20"),
        ("turn", "10%"),
        ("turn", "20"),
    ]
    for r in rows:
        assert int(r["hits"]) + int(r["misses"]) == int(r["lookups"])
        assert float(r["hit_ratio"]) == pytest.approx(int(r["hits"]) / int(r["lookups"]))
        assert r["capacity_bytes"] == ""  # no block size given
        assert all("=" in part for part in r["lookup_stops"].split(";") if part)


def test_json_and_csv_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(*run(["replay", "--json", "--csv"], capsys), "not allowed")


def test_capacity_in_bytes_with_bytes_per_block(capsys: pytest.CaptureFixture[str]) -> None:
    # 1000-byte blocks take one 4 KiB page each, as vLLM aligns them: 4 MB hold 976 chunks.
    document, _ = replay_json(
        ["--requests", "200", "--policy", "lru", "--capacity", "4MB,10%",
         "--bytes-per-block", "1000"],
        capsys,
    )  # fmt: skip
    first, second = document["rows"]
    assert (first["capacity"], first["capacity_spec"]) == (976, "4MB")
    assert first["capacity_bytes"] == 976 * 4096
    assert second["capacity_bytes"] == second["capacity"] * 4096
    assert document["meta"]["bytes_per_block"] == 1000
    assert document["meta"]["chunk_bytes"] == 4096


def test_capacity_in_bytes_from_the_model_shape(capsys: pytest.CaptureFixture[str]) -> None:
    # 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes x 16 tokens = 2 MiB per block.
    document, _ = replay_json(
        ["--requests", "200", "--policy", "arc", "--capacity", "2GiB", "--num-layers", "32",
         "--num-kv-heads", "8", "--head-size", "128", "--kv-dtype", "bf16"],
        capsys,
    )  # fmt: skip
    [row] = document["rows"]
    assert row["capacity"] == 1024
    assert row["capacity_bytes"] == 2 << 30
    assert document["meta"]["bytes_per_block"] == 2 << 20
    rc, out, err = run(
        ["replay", "--quiet", "--requests", "200", "--policy", "arc", "--capacity", "2GiB",
         "--num-layers", "32", "--num-kv-heads", "8", "--head-size", "128", "--kv-dtype", "fp8"],
        capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert "block: 2 x 32 layers x 8 KV heads x head size 128 x 1 B (fp8) x 16 tokens" in out
    assert "2,048" in out  # 1 MiB blocks: twice the chunks
    assert "2 GiB" in out  # the memory column


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--capacity", "64GiB"], "--bytes-per-block"),
        (["--capacity", "64XB", "--bytes-per-block", "1"], "malformed capacity"),
        (["--capacity", "64G", "--bytes-per-block", "1"], "malformed capacity"),
        (["--capacity", "1KiB", "--bytes-per-block", "1MiB"], "less than one chunk"),
        (["--num-layers", "32"], "--num-kv-heads and --head-size"),
        (["--bytes-per-block", "1MiB", "--num-layers", "2"], "not both"),
        (["--bytes-per-block", "0"], "size"),
        (["--bytes-per-block", "2 parsecs"], "unit"),
        (["--kv-dtype", "int4"], "invalid choice"),
    ],
)
def test_bad_block_size_options(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_error(*run(["replay", "--requests", "5", *argv], capsys), fragment)


def test_capacity_in_bytes_without_block_size_is_refused_before_the_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trace is never opened: the refusal needs nothing but the flags."""
    missing = tmp_path / "no-such-trace.jsonl"
    result = run(["replay", "--trace", str(missing), "--capacity", "50%,64GiB"], capsys)
    assert_one_line_error(*result, "capacity 64GiB is in bytes", "--bytes-per-block")


def test_huge_capacity_is_clamped_with_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    document, err = replay_json(
        ["--requests", "50", "--policy", "lru", "--capacity", "999999999,50%"], capsys
    )
    unique = document["meta"]["workload"]["unique_blocks"]
    clamped, half = document["rows"]
    assert (clamped["capacity"], clamped["capacity_requested"]) == (unique, 999999999)
    assert half["capacity"] < unique
    assert clamped["evicted"] == 0  # the cache that just fits never evicts
    assert err.count("\n") == 1
    assert "note: capacity 999999999 is 999,999,999 chunks" in err
    assert f"replaying with {unique:,}" in err


def test_capacities_of_the_same_chunks_run_once_with_a_note(
    capsys: pytest.CaptureFixture[str],
) -> None:
    document, err = replay_json(
        ["--requests", "50", "--policy", "lru", "--capacity", "100%,150%,100%,999999999"], capsys
    )
    unique = document["meta"]["workload"]["unique_blocks"]
    (row,) = document["rows"]
    assert row["capacity"] == row["capacity_requested"] == unique
    lines = err.splitlines()
    assert lines == [
        f"kvcache replay: note: capacity 150% clamps to the same {unique:,} chunks as 100%; "
        "replayed once",
        "kvcache replay: note: capacity 100% is given twice; replayed once",
        f"kvcache replay: note: capacity 999999999 clamps to the same {unique:,} chunks as "
        "100%; replayed once",
    ]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--requests", "99999999999"], "at most 100,000 requests"),
        (["--requests", str(cli.MAX_SYNTHETIC_REQUESTS + 1)], "generated in memory"),
        (["--block-tokens", "99999999999999999999"], "from 1 to 1,048,576"),
    ],
)
def test_sizes_that_would_exhaust_memory_are_refused(
    argv: list[str],
    fragment: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "synthetic_chat", _no_workload)
    assert_one_line_error(*run(["replay", *argv], capsys), fragment)


def _no_workload(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the workload was generated before the options were checked")


def test_trace_options_are_bounded_and_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "one.jsonl"
    trace.write_text(json.dumps({"hash_ids": [1, 2]}) + "\n")
    huge_block = ["replay", "--trace", str(trace), "--block-tokens", "99999999999999999999"]
    assert_one_line_error(*run(huge_block, capsys), "--block-tokens", "from 1 to")
    seeded = ["replay", "--trace", str(trace), "--seed", "3"]
    assert_one_line_error(*run(seeded, capsys), "--seed", "trace")
    # --requests only caps how much of a trace is read: any count is fine.
    rc, out, err = run(
        [
            "replay",
            "--quiet",
            "--trace",
            str(trace),
            "--requests",
            "99999999999",
            "--capacity",
            "1",
        ],
        capsys,
    )
    assert rc == 0, err
    assert "1 request, 2 key visits, 2 unique blocks (512 tokens each)" in out


def test_a_line_per_finished_run_when_stderr_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, _, err = run(["replay", "--requests", "30", "--capacity", "1,50%"], capsys)
    assert rc == 0
    lines = err.splitlines()
    assert len(lines) == 6, err
    for k, line in enumerate(lines, start=1):
        assert re.fullmatch(
            rf"kvcache replay: run {k}/6 done in \d+\.\d s: kvcache (lru|arc|turn) [\d,]+ chunks?",
            line,
        ), line
    assert lines[0].endswith("lru 1 chunk")
    rc, _, err = run(["replay", "--quiet", "--requests", "30", "--capacity", "1,50%"], capsys)
    assert rc == 0
    assert err == ""


def test_plot_path_is_checked_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")

    def no_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the replay ran before the plot path was checked")

    monkeypatch.setattr(cli, "run_grid", no_run)
    missing_dir = tmp_path / "no" / "such" / "dir" / "hits.png"
    assert_one_line_error(*run(["replay", "--plot", str(missing_dir)], capsys), "cannot write")
    assert_one_line_error(*run(["replay", "--plot", str(tmp_path)], capsys), "cannot write")
    bad_format = tmp_path / "hits.docx"
    assert_one_line_error(*run(["replay", "--plot", str(bad_format)], capsys), "unknown format")
    assert not bad_format.exists()
    # A writable path passes the check and is not left behind by it.
    good = tmp_path / "hits.png"
    with pytest.raises(AssertionError, match="before the plot path"):
        cli.main(["replay", "--plot", str(good), "--requests", "5"])
    assert not good.exists()


def test_plot_axis_is_in_bytes_when_the_block_size_is_known(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    from kvcache.replay.report import hit_ratio_figure

    target = tmp_path / "hits.png"
    rows: list[Any] = []
    real_plot = cli.plot_hit_ratio

    def keep_rows(rows_: Any, path: Any, *, title: str) -> None:
        rows.extend(rows_)
        real_plot(rows_, path, title=title)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "plot_hit_ratio", keep_rows)
        rc, _, err = run(
            ["replay", "--quiet", "--requests", "100", "--policy", "lru", "--capacity",
             "1GiB,2GiB", "--bytes-per-block", "1MiB", "--plot", str(target)],
            capsys,
        )  # fmt: skip
    assert rc == 0, err
    assert target.stat().st_size > 0
    fig = hit_ratio_figure(rows, title="t")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "capacity (GiB of host memory)"
    assert list(ax.lines[0].get_xdata()) == [
        min(r.capacity.bytes for r in rows) / 2**30,
        max(r.capacity.bytes for r in rows) / 2**30,
    ]
    fig_chunks = hit_ratio_figure(
        [dataclasses.replace(r, capacity=dataclasses.replace(r.capacity, chunk_bytes=None))
         for r in rows],
        title="t",
    )  # fmt: skip
    assert fig_chunks.axes[0].get_xlabel() == "capacity (chunks)"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_run_k_of_n_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(progress_module, "MININTERVAL", 0.0)
    rc = cli.main(["replay", "--requests", "60", "--capacity", "10%,20%,30%", "--repeat", "2"])
    assert rc == 0
    drawn = terminal.getvalue()
    # 3 policies x 3 capacities x 2 repeats = 18 timed replays.
    assert "run 1/18: kvcache lru" in drawn
    assert "run 18/18: kvcache turn" in drawn
    assert "run 19/" not in drawn
    assert "<" in drawn  # elapsed<remaining


def test_no_progress_when_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["replay", "--quiet", "--requests", "30", "--capacity", "10%"]) == 0
    assert terminal.getvalue() == ""


# --- missing optional dependencies: one line, exit 2 ------------------------------------------


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make vLLM (and our adapter, which imports it) unimportable for one test."""
    for name in list(sys.modules):
        if name == "vllm" or name.startswith("vllm.") or name == "kvcache.vllm":
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "kvcache.vllm", None)


@pytest.mark.usefixtures("no_vllm")
@pytest.mark.parametrize(
    "argv",
    [
        ["--backend", "vllm-rust-policies"],
        ["--backend", "vllm"],
        ["--compare-vllm"],
    ],
)
def test_vllm_backends_without_vllm(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    result = run(["replay", "--requests", "5", *argv], capsys)
    assert_one_line_error(*result, "needs vLLM 0.33.0 or 0.34.0")


def test_rust_policies_backend_under_an_untested_vllm() -> None:
    """kvcache.vllm refuses a vLLM release it was not tested against: one line, exit 2.

    In a fresh interpreter: the refusal runs once, when kvcache.vllm is first imported."""
    require_oracle()
    env = subprocess_env()
    env.pop("KVCACHE_ALLOW_UNTESTED_VLLM", None)
    code = (
        "import sys, vllm; vllm.__version__ = '0.35.0'; from kvcache.cli import main; "
        "sys.exit(main(['replay', '--requests', '5', '--backend', 'vllm-rust-policies']))"
    )
    proc = run_python(["-c", code], env=env, timeout=300)
    assert_one_line_error(
        proc.returncode,
        proc.stdout,
        proc.stderr,
        "tested against vLLM 0.33.0 or 0.34.0",
        "KVCACHE_ALLOW_UNTESTED_VLLM=1",
    )


def test_transfer_bench_without_torch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    result = run(["transfer", "bench", "--device", "cpu"], capsys)
    assert_one_line_error(*result, "needs torch", "kvcache-offload[transfer]")


def test_transfer_bench_torch_missing_inside_the_bench(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch found by name but failing to import inside the bench: still one line."""
    from kvcache.transfer import _bench

    def needs_torch(args: object) -> int:
        raise ModuleNotFoundError("No module named 'torch._C'", name="torch._C")

    monkeypatch.setattr(_bench, "run", needs_torch)
    assert_one_line_error(*run(["transfer", "bench"], capsys), "needs torch")


def test_transfer_bench_forwards_its_arguments(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcache.transfer import _bench

    seen: list[Any] = []

    def fake_main(argv: list[str] | None = None) -> int:
        seen.append(argv)
        return 7

    monkeypatch.setattr(_bench, "main", fake_main)
    rc, _, _ = run(["transfer", "bench", "--device", "cpu", "--quick", "--json", "x.json"], capsys)
    assert rc == 7
    assert seen == [["--device", "cpu", "--quick", "--json", "x.json"]]


@pytest.fixture
def no_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch unimportable, and the bench failing the test if it ever starts."""
    from kvcache.transfer import _bench

    def must_not_run(args: Any) -> int:
        raise AssertionError("the bench ran")

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(_bench, "run", must_not_run)


@pytest.mark.usefixtures("no_torch")
def test_transfer_bench_help_needs_no_torch(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["transfer", "bench", "--help"], capsys)
    assert rc == 0
    assert err == ""
    assert out.startswith("usage: kvcache transfer bench ")
    for option in ("--device", "--quick", "--json FILE", "--budget-s SECONDS"):
        assert option in out
    # Every option has its help text.
    words = " ".join(out.split())
    assert "cpu: the CPU path" in words
    assert "skip the remaining measurements" in words


@pytest.mark.usefixtures("no_torch")
@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--budget-s", "-1"], "--budget-s: expected a number of seconds > 0"),
        (["--budget-s", "0"], "> 0"),
        (["--budget-s", "nan"], "> 0"),
        (["--budget-s", "soon"], "expected seconds"),
        (["--device", "tpu"], "invalid choice"),
        (["--json", "/nonexistent/x.json"], "directory /nonexistent does not exist"),
        (["--json", "."], "is a directory"),
    ],
)
def test_transfer_bench_bad_options_before_torch_or_the_run(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run(["transfer", "bench", "--device", "cpu", *argv], capsys)
    assert_one_line_error(*result, "kvcache transfer bench: error", fragment)


def test_transfer_bench_json_path_checked_before_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from kvcache.transfer import _bench

    def must_not_run(args: Any) -> int:
        raise AssertionError("the bench ran before its --json path was checked")

    monkeypatch.setattr(_bench, "run", must_not_run)
    missing = tmp_path / "no-such-dir" / "x.json"
    result = run(["transfer", "bench", "--device", "cpu", "--json", str(missing)], capsys)
    assert_one_line_error(*result, f"directory {missing.parent} does not exist")


def test_python_m_transfer_bench_without_torch_is_one_line() -> None:
    code = (
        "import runpy, sys\n"
        "sys.modules['torch'] = None\n"
        "sys.argv = ['kvcache.transfer', 'bench', '--device', 'cpu']\n"
        "runpy.run_module('kvcache.transfer', run_name='__main__', alter_sys=True)\n"
    )
    proc = run_python(["-c", code])
    assert_one_line_error(
        proc.returncode, proc.stdout, proc.stderr, "needs torch", "kvcache-offload[transfer]"
    )


def test_transfer_bench_on_cpu_writes_nothing_unasked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    rc, out, _ = run(["transfer", "bench", "--device", "cpu", "--quick"], capsys)
    assert rc == 0, out
    assert list(tmp_path.iterdir()) == []
    assert "wrote" not in out
    assert "None" not in out
    assert "CPU run: the bandwidth goals apply to a GPU" in out


@pytest.mark.parametrize(
    ("compared", "wins", "expected"),
    [
        ([], None, None),
        ([4, 16, 256], None, "the kernel beats DMA at every page size tried (4-256 KiB)"),
        ([4, 16, 256], 4, "DMA is at least as fast as the kernel at every page size tried"),
        ([16], 16, "DMA is at least as fast as the kernel at every page size tried (16 KiB)"),
        ([4, 16, 256], 16, "DMA is at least as fast as the kernel from 16 KiB pages"),
    ],
)
def test_transfer_bench_crossover_in_words(
    compared: list[int], wins: int | None, expected: str | None
) -> None:
    from kvcache.transfer._bench import crossover_line

    line = crossover_line({"compared_kib": compared, "dma_wins_from_kib": wins})
    if expected is None:
        assert line is None
    else:
        assert line is not None
        assert line.startswith(expected)
        assert "None" not in line


def test_transfer_bench_summary_when_dma_never_wins() -> None:
    from kvcache.transfer._bench import crossover_line, summarize

    def row(kib: int, method: str, gbps: float) -> dict[str, Any]:
        return {
            "page_kib": kib,
            "pattern": "scattered",
            "direction": "load",
            "pool": "pinned",
            "method": method,
            "gbps": gbps,
            "pct_of_large_copy": gbps,
        }

    rows = [row(4, "kernel", 20), row(4, "dma", 5), row(64, "kernel", 30), row(64, "dma", 29)]
    crossover = summarize(rows)["crossover"]
    assert crossover["load"] == {"compared_kib": [4, 64], "dma_wins_from_kib": None}
    assert crossover_line(crossover["load"]) == (
        "the kernel beats DMA at every page size tried (4-64 KiB)"
    )
    assert crossover_line(crossover["store"]) is None


def test_transfer_without_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["transfer"], capsys)
    assert rc == 2
    assert out == ""
    assert "bench" in err


def test_unknown_argument_after_replay_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(*run(["replay", "--requests", "5", "stray"], capsys), "unrecognized")
