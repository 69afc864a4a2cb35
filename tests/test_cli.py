"""``kvcache replay``: error paths (one line, non-zero, no traceback) and the outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvcache.cli as cli
from kvcache.replay import Backend, vllm_backend

PYTHON_DIR = Path(__file__).resolve().parent.parent / "python"
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


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse errors exit from inside main
        rc = int(exc.code or 0)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_one_line_error(rc: int, out: str, err: str, *fragments: str) -> None:
    assert rc == 2
    assert out == ""
    assert err.endswith("\n")
    assert err.count("\n") == 1, f"expected one line, got: {err!r}"
    assert "Traceback" not in err
    assert "error" in err
    for fragment in fragments:
        assert fragment in err


def write_trace(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


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


def test_module_entry_point_error_has_no_traceback(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "kvcache", "replay", "--trace", str(tmp_path / "missing.jsonl")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr


def test_importing_the_cli_does_not_import_vllm_or_torch() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    code = (
        "import sys, kvcache, kvcache.cli, kvcache.replay; "
        "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
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
    rows = json.loads(out)
    assert isinstance(rows, list)
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
        make=lambda n, p, *, enable_events=False: _LieOnce(
            vllm.make(n, p, enable_events=enable_events), vllm.hit
        ),
        hit=vllm.hit,
        req_context=vllm.req_context,
    )
    monkeypatch.setattr(cli, "get_backend", lambda name: liar)
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
