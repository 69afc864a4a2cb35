"""Running ``kvcache``'s CLI in this process, as the CLI and replay tests do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import kvcache.cli as cli


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


def replay_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    rc, out, err = run(["replay", "--quiet", "--json", *argv], capsys)
    assert rc == 0, err
    return json.loads(out), err
