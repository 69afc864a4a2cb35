"""Hostile options and traces for ``kvcache replay``: each runs the CLI in a fresh interpreter
under a memory watchdog, and must end in one line on stderr naming what is wrong, exit status
2 and no traceback. Numbers are refused as they are parsed, with the accepted range; a trace
names its file and line. Before these bounds, a number out of range ended in an
``OverflowError`` traceback, ``/dev/zero`` was read until memory ran out, an integer of 4,301
digits hit Python's conversion limit and deep nesting a ``RecursionError``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import IO, Any

import pytest

import kvcache.replay.trace as trace_module
from kvcache.replay.errors import TraceError
from kvcache.replay.trace import MAX_JSON_DEPTH, load_mooncake_trace
from tests.hostile import run_isolated

GOOD = json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]})
DIGITS = "9" * 4301
INT64 = "9,223,372,036,854,775,807"


def command(
    argv: list[str], *, stdout: int | IO[Any] = subprocess.PIPE, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """``kvcache ARGV`` in a fresh interpreter: exit status, stdout, stderr. ``stdout`` and
    ``env``: see ``run_isolated``."""
    script = f"import sys\nfrom kvcache.cli import main\nsys.exit(main({argv!r}))\n"
    run = run_isolated(script, max_rss=768 << 20, timeout=300, stdout=stdout, env=env)
    assert not run.killed_for_memory, run.describe()
    assert not run.timed_out, run.describe()
    return run.returncode, run.stdout, run.stderr


def replay(argv: list[str], **kwargs: Any) -> tuple[int, str, str]:
    """``kvcache replay ARGV`` (see :func:`command`)."""
    return command(["replay", *argv], **kwargs)


def assert_one_line(result: tuple[int, str, str], *fragments: str) -> None:
    rc, out, err = result
    assert (rc, out) == (2, ""), err
    assert err.endswith("\n"), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err, err
    assert "error" in err, err
    for fragment in fragments:
        assert fragment in err, err


OPTIONS = [
    (["--capacity", "1.5e308%"], ["at most 10,000%"]),
    (["--capacity", "9223372036854775808"], [f"at most {INT64} chunks"]),
    (["--capacity", DIGITS], ["(4,301 characters)"]),
    (["--capacity", "99999999999999999999GiB", "--bytes-per-block", "1"], ["at most 1 EiB"]),
    # One byte past 1 EiB: a float rounded it to 1 EiB, which was then replayed without a word.
    (["--capacity", "1152921504606846977B", "--bytes-per-block", "1"], ["at most 1 EiB"]),
    (["--bytes-per-block", "1152921504606846977B"], ["--bytes-per-block", "at most 1 EiB"]),
    (["--seed", "9223372036854775808"], ["--seed", f"from -9,223,372,036,854,775,808 to {INT64}"]),
    (["--seed", "-9223372036854775809"], ["--seed", "from -9,223,372,036,854,775,808"]),
    (["--seed", DIGITS], ["--seed", "(4,301 characters)"]),
    (["--requests", DIGITS], ["--requests", f"from 1 to {INT64}"]),
    (["--lag", str(1 << 63)], ["--lag", f"from 0 to {INT64}"]),
    (["--fail-store-every", "-1"], ["--fail-store-every", "from 0"]),
    (["--preempt-every", str(1 << 63)], ["--preempt-every", f"to {INT64}"]),
    (["--store-threshold", "1000001"], ["--store-threshold", "from 0 to 1,000,000"]),
    (["--repeat", "1001"], ["--repeat", "from 1 to 1,000"]),
    (["--block-tokens", "0"], ["--block-tokens", "from 1 to 1,048,576"]),
    (["--num-layers", str((1 << 20) + 1)], ["--num-layers", "from 1 to 1,048,576"]),
    (["--bytes-per-block", str((1 << 60) + 1)], ["--bytes-per-block", "1 EiB"]),
    (["--bytes-per-block", DIGITS], ["--bytes-per-block", "(4,301 characters)"]),
    (["--max-line-bytes", "2GiB", "--trace", "t.jsonl"], ["--max-line-bytes", "to 1 GiB"]),
    (["--max-line-bytes", "1MiB"], ["--max-line-bytes", "--trace"]),
]


@pytest.mark.parametrize(("argv", "fragments"), OPTIONS, ids=[" ".join(a)[:40] for a, _ in OPTIONS])
def test_a_bad_option_is_one_line(argv: list[str], fragments: list[str]) -> None:
    assert_one_line(replay(argv), *fragments)


# (id, the trace's third line, what the error says about it)
LINES = [
    ("input-length-4301-digits", f'{{"input_length": {DIGITS}, "hash_ids": [3]}}', "4,301 digits"),
    ("hash-id-4301-digits", f'{{"hash_ids": [{DIGITS}]}}', "4,301 digits"),
    ("hash-id-2**64", f'{{"hash_ids": [{1 << 64}]}}', "does not fit in 64 bits"),
    ("deep-nesting", '{"hash_ids": [1], "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested"),
    ("nesting-one-too-deep", '{"hash_ids": [[1]]}', f"nested deeper than {MAX_JSON_DEPTH}"),
    ("nan", '{"hash_ids": [1], "timestamp": NaN}', "NaN"),
    ("infinite-float", '{"hash_ids": [1], "input_length": 1e999}', "'input_length' must be"),
]


@pytest.mark.parametrize(("line", "fragment"), [c[1:] for c in LINES], ids=[c[0] for c in LINES])
def test_a_bad_trace_line_is_named(tmp_path: Path, line: str, fragment: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD}\n{GOOD}\n{line}\n{GOOD}\n", encoding="utf-8")
    assert_one_line(replay(["--trace", str(path)]), f"{path}:3:", fragment)


def test_a_line_over_the_limit_names_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD}\n{GOOD}\n" + " " * 2048 + f"{GOOD}\n", encoding="utf-8")
    result = replay(["--trace", str(path), "--max-line-bytes", "1KiB"])
    assert_one_line(result, f"{path}:3:", "longer than 1,024 bytes", "--max-line-bytes")


def test_a_file_without_newlines_stops_at_the_default_limit(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\0" * ((8 << 20) + 1))
    assert_one_line(replay(["--trace", str(path)]), f"{path}:1:", "longer than 8,388,608 bytes")


def test_invalid_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(f"{GOOD}\n".encode() + b'{"hash_ids": [1], "x": "\xff"}\n')
    assert_one_line(replay(["--trace", str(path)]), f"{path}:2:", "not UTF-8")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_dev_zero_is_refused() -> None:
    assert_one_line(replay(["--trace", "/dev/zero"]), "/dev/zero", "not a regular file")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert_one_line(replay(["--trace", str(fifo)]), str(fifo), "not a regular file")


def test_a_directory_is_refused(tmp_path: Path) -> None:
    assert_one_line(replay(["--trace", str(tmp_path)]), "is a directory")


# --- the reader's bounds, in process ---------------------------------------------------------


def test_a_request_over_the_managers_bound_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request names at most MAX_ITEMS ids, the most the manager takes in one call (the
    bound is lowered here: a real line over it is tens of megabytes)."""
    monkeypatch.setattr(trace_module, "MAX_ITEMS", 3)
    path = tmp_path / "t.jsonl"
    path.write_text('{"hash_ids": [1, 2, 3]}\n{"hash_ids": [1, 2, 3, 4]}\n', encoding="utf-8")
    with pytest.raises(TraceError, match=rf"{path}:2: 4 hash ids, more than the 3"):
        load_mooncake_trace(path)


def test_a_line_of_exactly_the_limit_is_read(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD}\n", encoding="utf-8")
    size = len(GOOD) + 1
    assert len(load_mooncake_trace(path, max_line_bytes=size).requests) == 1
    with pytest.raises(TraceError, match=f"longer than {size - 1} bytes"):
        load_mooncake_trace(path, max_line_bytes=size - 1)


def test_brackets_inside_strings_do_not_count_as_nesting(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    line = json.dumps({"hash_ids": [1], "note": '[[[{{{ \\" ]]]'})
    path.write_text(line + "\n", encoding="utf-8")
    assert len(load_mooncake_trace(path).requests) == 1


def test_the_largest_64_bit_hash_id_is_read(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"hash_ids": [(1 << 64) - 1, 0]}) + "\n", encoding="utf-8")
    (request,) = load_mooncake_trace(path).requests
    assert len(request) == 2


# --- output that cannot be written ------------------------------------------------------------
# The CLI ends like a Unix tool: a reader that went away ends it quietly with status 141 (what
# the shell reports for a writer killed by SIGPIPE), a full disk and an encoding that cannot
# hold the output end in one line and status 2. Before, each ended in a traceback.

SMALL = ["--requests", "20", "--policy", "lru"]


def test_a_closed_pipe_ends_quietly_with_the_sigpipe_status() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write: EPIPE, deterministically
    with os.fdopen(write, "w") as gone:
        rc, _, err = replay([*SMALL, "--quiet"], stdout=gone)
    assert (rc, err) == (141, ""), err


def test_help_into_a_closed_pipe_ends_quietly() -> None:
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as gone:
        rc, _, err = replay(["--help"], stdout=gone)
    assert (rc, err) == (141, ""), err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize(
    "argv",
    [
        ["replay", *SMALL, "--quiet"],
        ["replay", *SMALL, "--quiet", "--csv"],
        # argparse dropped a failed write of the help: these exited 0, writing nothing.
        ["replay", "--help"],
        ["--help"],
        ["transfer", "bench", "--help"],
    ],
)
def test_a_full_disk_is_one_line(argv: list[str]) -> None:
    with open("/dev/full", "w") as full:
        rc, _, err = command(argv, stdout=full)
    assert rc == 2, err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err, err
    assert "No space left on device" in err, err


def test_an_encoding_the_output_lacks_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "café.jsonl"
    path.write_text(f"{GOOD}\n{GOOD}\n", encoding="utf-8")
    argv = ["--trace", str(path), "--capacity", "1", "--policy", "lru", "--quiet"]
    rc, _, err = replay(argv, env={"PYTHONIOENCODING": "ascii", "LC_ALL": "C"})
    assert rc == 2, err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err, err
    for fragment in ("'\\xe9'", "(ascii)", "PYTHONIOENCODING=utf-8"):
        assert fragment in err, err


def test_a_capacity_clamped_to_the_workload_says_so() -> None:
    # Exactly 1 EiB is accepted, and clamped to the workload's unique blocks: one note.
    argv = [*SMALL, "--quiet", "--capacity", "1152921504606846976B", "--bytes-per-block", "4096"]
    rc, out, err = replay(argv)
    assert rc == 0, err
    assert err.count("\n") == 1, err
    assert "note: capacity 1152921504606846976B is 281,474,976,710,656 chunks" in err, err
    assert "clamped" in out, out
