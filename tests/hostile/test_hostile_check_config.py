"""Hostile input for ``kvcache check-config``: each runs the command in a fresh interpreter under
a memory watchdog and must end in one line on stderr, exit status 2, nothing on stdout and no
traceback. What can be refused from the text alone (its size, nesting, shape, a file that is
not a regular file) is refused before vLLM is imported."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvcache._check_config import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH
from tests.support.hostile import run_isolated
from tests.support.oracle import require_oracle

HEAD = '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '


def check_config(arg: str, *, vllm: bool = False) -> tuple[int, str, str]:
    """``kvcache check-config ARG`` in a fresh interpreter: exit status, stdout, stderr. ``ARG``
    is a Python expression (the child builds texts longer than a command line may be). Without
    ``vllm`` the case must end before vLLM (or torch) is imported."""
    script = f"""
    import sys
    from kvcache.cli import main
    code = main(["check-config", {arg}])
    if {not vllm!r} and ("vllm" in sys.modules or "torch" in sys.modules):
        print("imported vLLM for a case that needs none", file=sys.stderr)
    sys.exit(code)
    """
    run = run_isolated(script, max_rss=(4 << 30) if vllm else (512 << 20), timeout=300)
    assert not run.killed_for_memory, run.describe()
    assert not run.timed_out, run.describe()
    return run.returncode, run.stdout, run.stderr


def assert_one_line(result: tuple[int, str, str], *fragments: str) -> None:
    rc, out, err = result
    assert (rc, out) == (2, ""), err
    assert err.startswith("kvcache check-config: error: "), err
    assert err.endswith("\n"), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


DEEP = '"[" * 100_000 + "]" * 100_000'
# (id, the argument as a Python expression, what the line must say)
TEXTS = [
    ("list", repr("[1, 2]"), ["expected a JSON object", "list"]),
    ("string", repr('"OffloadingConnector"'), ["expected a JSON object", "str"]),
    ("null", repr("null"), ["expected a JSON object", "NoneType"]),
    ("number", repr("5"), ["expected a JSON object", "int"]),
    ("deep-nesting", DEEP, [f"deeper than {MAX_CONFIG_DEPTH} levels"]),
    ("deep-in-a-config", repr(HEAD + '"kv_connector_extra_config": {"x": ') + " + " + DEEP
     + " + '}}'", [f"deeper than {MAX_CONFIG_DEPTH} levels"]),
    ("4301-digits", repr(HEAD + '"kv_port": ' + "9" * 4301 + "}"), ["not valid JSON", "4300"]),
    ("huge", repr(HEAD + '"x": "') + f" + 'a' * {MAX_CONFIG_BYTES} + " + repr('"}'),
     ["longer than 1 MiB"]),
    ("extra-config-alone", repr('{"spec_name": "KvCacheOffloadingSpec", "cpu_bytes_to_use": 1}'),
     ["kv_connector_extra_config alone"]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "fragments"), [t[1:] for t in TEXTS], ids=[t[0] for t in TEXTS])
def test_a_hostile_text_is_one_line_before_vllm_is_imported(
    text: str, fragments: list[str]
) -> None:
    assert_one_line(check_config(text), *fragments)


def test_files_are_read_bounded_and_only_when_regular(tmp_path: Path) -> None:
    huge = tmp_path / "huge.json"
    huge.write_text(HEAD + '"x": "' + "a" * (4 * MAX_CONFIG_BYTES) + '"}')
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"kv_connector": "Offloading\xe9"}')
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # no writer: reading it would wait forever
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    cases = [
        (f"@{huge}", ["huge.json", "longer than 1 MiB"]),
        (f"@{latin}", ["latin.json", "not UTF-8"]),
        (f"@{deep}", [f"deeper than {MAX_CONFIG_DEPTH} levels"]),
        (f"@{tmp_path}", ["not a regular file"]),
        (f"@{fifo}", ["fifo.json", "not a regular file"]),
        ("@/dev/zero", ["/dev/zero", "not a regular file"]),
        (f"@{tmp_path / 'missing.json'}", ["missing.json", "No such file"]),
    ]
    for arg, fragments in cases:
        assert_one_line(check_config(repr(arg)), *fragments)


@pytest.mark.oracle
def test_what_only_vllm_can_refuse_is_one_line_too() -> None:
    """Text that is not JSON even after vLLM's number suffixes are expanded, and a value vLLM's
    own parser refuses, in one interpreter (vLLM is imported once)."""
    require_oracle()
    script_cases = [
        ('{"kv_connector": ', "not valid JSON"),
        (HEAD + '"kv_connector_extra_config": {"cpu_bytes_to_use": 64Q}}', "not valid JSON"),
        (HEAD + '"kv_port": "many"}', "kv_port"),
        (HEAD + '"kv_connector_extra_config": {"store_threshold": NaN, "cpu_bytes_to_use": 1}}',
         "store_threshold"),
    ]  # fmt: skip
    script = f"""
    import contextlib, io, json, sys
    from kvcache.cli import main
    results = []
    for text, _ in {script_cases!r}:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["check-config", text])
        results.append([code, out.getvalue(), err.getvalue()])
    report(results=results)
    """
    run = run_isolated(script, max_rss=4 << 30, timeout=300)
    results = run.check()["results"]
    for (rc, out, err), (_, fragment) in zip(results, script_cases, strict=True):
        assert_one_line((rc, out, err), fragment)
    assert json.dumps(results).count("Traceback") == 0
