"""Load a Mooncake (FAST'25) trace: JSON Lines, one request per line.

Each line is an object with ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``: the ids of the prompt's prefix blocks (512 tokens each in the published traces;
equal ids mean a reusable prefix). Each id becomes one offload key: the id as a 32-byte big-endian
"hash" followed by group index 0. Requests are replayed in file order; timestamps are checked but
otherwise unused (the replay is about decisions and CPU time, not arrival times).

Malformed input raises :class:`TraceError` naming the file and line, so the CLI can print it on
one line: the replay must never hand a manager something vLLM's scheduler could not produce
(a repeated id inside a request, for example, would trip the manager's own assertions).

What a line may hold is bounded before it is parsed, so that no trace can exhaust memory, the
stack or Python's integer conversion: a line is at most ``max_line_bytes`` long (the CLI's
``--max-line-bytes``), JSON nests at most :data:`MAX_JSON_DEPTH` levels (the format needs an
object holding a list), integers fit in 64 bits, a request names at most ``MAX_ITEMS`` ids
(the most the manager takes in one call), and only regular files are read (a device such as
``/dev/zero`` or a FIFO is refused, and a FIFO is never waited on).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import BinaryIO

from kvcache._core import MAX_ITEMS
from kvcache._hints import RETENTION_VALUES
from kvcache.replay.errors import TraceError
from kvcache.replay.workload import KEY_HASH_BYTES, Workload, make_key

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_TRACE_BLOCK_TOKENS",
    "MAX_JSON_DEPTH",
    "MAX_LINE_BYTES",
    "load_mooncake_trace",
    "nests_deeper",
]

#: Block size of the published Mooncake traces.
DEFAULT_TRACE_BLOCK_TOKENS = 512

#: The longest line read by default, newline included: a request of 500,000 ids of 16 digits.
DEFAULT_MAX_LINE_BYTES = 8 << 20
#: The most ``max_line_bytes`` may be raised to.
MAX_LINE_BYTES = 1 << 30
#: The deepest JSON nesting of a line: an object (1) holding the list of hash ids (2).
MAX_JSON_DEPTH = 2

#: Hash ids are non-negative integers of at most 64 bits (each becomes a 32-byte key).
_MAX_HASH_ID = 1 << 64
#: Integers a line may hold: 64 bits, signed or not (counts are checked for sign afterwards).
_INT_RANGE = range(-(1 << 63), 1 << 64)
#: 20 digits hold every integer of 64 bits; a longer run is refused without converting it.
_LONG_DIGITS = re.compile(r"[0-9]{20}")
#: A JSON string (escapes included) or a bracket: what the nesting check looks at.
_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


class _BadValue(Exception):
    """A number the reader refuses; the message says what, the caller says where."""


def _int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > 20:
        raise _BadValue(f"an integer of {digits:,} digits (integers must fit in 64 bits)")
    value = int(text)
    if value not in _INT_RANGE:
        raise _BadValue(f"integer {value} does not fit in 64 bits")
    return value


def _constant(name: str) -> float:
    raise _BadValue(f"{name} is not a number a trace may hold")


def nests_deeper(text: str, limit: int) -> bool:
    """Whether JSON ``text`` nests deeper than ``limit`` levels (brackets inside strings do not
    count), found without parsing it. Text with few brackets cannot, and is not scanned."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for match in _STRUCTURE.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return True
        elif token in "]}":
            depth -= 1
    return False


def _is_count(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _parse_line(line: str, where: str) -> tuple[list[int], str | None]:
    if nests_deeper(line, MAX_JSON_DEPTH):
        raise TraceError(
            f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels (a trace line is an "
            "object of numbers and one list of hash ids)"
        )
    try:
        if _LONG_DIGITS.search(line):  # rare: every integer is checked as it is converted
            record = json.loads(line, parse_int=_int, parse_constant=_constant)
        else:  # no integer can exceed 64 bits
            record = json.loads(line, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
    except _BadValue as exc:
        raise TraceError(f"{where}: {exc}") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "hash_ids" not in record:
        raise TraceError(f"{where}: missing 'hash_ids'")
    for field in ("timestamp", "input_length", "output_length"):
        if field in record and not _is_count(record[field]):
            raise TraceError(f"{where}: '{field}' must be a non-negative number")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    if len(hash_ids) > MAX_ITEMS:
        raise TraceError(
            f"{where}: {len(hash_ids):,} hash ids, more than the {MAX_ITEMS:,} kvcache's "
            "manager takes in one call"
        )
    for hid in hash_ids:
        if not isinstance(hid, int) or isinstance(hid, bool) or not 0 <= hid < _MAX_HASH_ID:
            raise TraceError(
                f"{where}: 'hash_ids' holds {hid!r}, not a non-negative integer of 64 bits"
            )
    if len(set(hash_ids)) != len(hash_ids):
        raise TraceError(f"{where}: 'hash_ids' repeats an id within one request")
    hint = record.get("hint")
    if hint is not None and hint not in RETENTION_VALUES:
        raise TraceError(
            f"{where}: 'hint' must be one of {', '.join(map(repr, RETENTION_VALUES))} (or absent), "
            f"got {hint!r}"
        )
    return hash_ids, hint


def _open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading if it is a regular file. The open does not block, so a
    FIFO without a writer is refused rather than waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise TraceError(f"{path}: is a directory, not a trace file")
        if not stat.S_ISREG(mode):
            raise TraceError(
                f"{path}: not a regular file (a device, FIFO or socket); save the trace to a "
                "file first"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def load_mooncake_trace(
    path: str | os.PathLike[str],
    *,
    block_tokens: int = DEFAULT_TRACE_BLOCK_TOKENS,
    max_requests: int | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Workload:
    """Read ``path`` into a :class:`Workload` (blank lines are skipped).

    ``max_requests`` keeps only the first N requests (for quick looks at big traces). A line
    longer than ``max_line_bytes`` (newline included) is refused.
    """
    path = Path(path)
    if not 1 <= max_line_bytes <= MAX_LINE_BYTES:
        raise TraceError(f"max_line_bytes must be from 1 to {MAX_LINE_BYTES:,}")
    keys: dict[int, bytes] = {}  # interned: one bytes object per hash id
    requests: list[list[bytes]] = []
    hints: list[str | None] = []
    lineno = 0
    try:
        with _open_regular(path) as fh:
            while max_requests is None or len(requests) < max_requests:
                raw = fh.readline(max_line_bytes + 1)
                if not raw:
                    break
                lineno += 1
                where = f"{path}:{lineno}"
                if len(raw) > max_line_bytes:
                    raise TraceError(
                        f"{where}: line longer than {max_line_bytes:,} bytes (the limit; "
                        "raise it with --max-line-bytes)"
                    )
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise TraceError(f"{where}: not UTF-8 text ({exc.reason})") from None
                if not line.strip():
                    continue
                hash_ids, hint = _parse_line(line, where)
                hints.append(hint)
                request = []
                for hid in hash_ids:
                    key = keys.get(hid)
                    if key is None:
                        key = keys[hid] = make_key(hid.to_bytes(KEY_HASH_BYTES, "big"), 0)
                    request.append(key)
                requests.append(request)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except MemoryError:
        raise TraceError(
            f"{path}:{lineno}: not enough memory for the trace; replay its first requests "
            "with --requests N"
        ) from None
    if not requests:
        raise TraceError(f"{path}: no requests in the trace")
    workload = Workload.from_requests(f"mooncake:{path.name}", requests, block_tokens=block_tokens)
    if any(h is not None for h in hints):
        workload = workload.with_hints(tuple(hints), "from the trace")
    return workload
