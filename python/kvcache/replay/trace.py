"""Load a Mooncake (FAST'25) trace: JSON Lines, one request per line.

Each line is an object with ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``: the ids of the prompt's prefix blocks (512 tokens each in the published traces;
equal ids mean a reusable prefix). Each id becomes one offload key: the id as a 32-byte big-endian
"hash" followed by group index 0. Requests are replayed in file order; timestamps are checked but
otherwise unused (the replay is about decisions and CPU time, not arrival times).

Malformed input raises :class:`TraceError` naming the file and line, so the CLI can print it on
one line: the replay must never hand a manager something vLLM's scheduler could not produce
(a repeated id inside a request, for example, would trip the manager's own assertions).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvcache.replay.errors import TraceError
from kvcache.replay.workload import KEY_HASH_BYTES, Workload, make_key

__all__ = ["DEFAULT_TRACE_BLOCK_TOKENS", "load_mooncake_trace"]

#: Block size of the published Mooncake traces.
DEFAULT_TRACE_BLOCK_TOKENS = 512

_MAX_HASH_ID = 1 << (8 * KEY_HASH_BYTES)


def _is_count(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def _parse_line(line: str, where: str) -> list[int]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
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
    for hid in hash_ids:
        if not isinstance(hid, int) or isinstance(hid, bool) or not 0 <= hid < _MAX_HASH_ID:
            raise TraceError(f"{where}: 'hash_ids' holds {hid!r}, not a non-negative integer")
    if len(set(hash_ids)) != len(hash_ids):
        raise TraceError(f"{where}: 'hash_ids' repeats an id within one request")
    return hash_ids


def load_mooncake_trace(
    path: str | os.PathLike[str],
    *,
    block_tokens: int = DEFAULT_TRACE_BLOCK_TOKENS,
    max_requests: int | None = None,
) -> Workload:
    """Read ``path`` into a :class:`Workload` (blank lines are skipped).

    ``max_requests`` keeps only the first N requests (for quick looks at big traces).
    """
    path = Path(path)
    keys: dict[int, bytes] = {}  # interned: one bytes object per hash id
    requests: list[list[bytes]] = []
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if max_requests is not None and len(requests) >= max_requests:
                    break
                if not line.strip():
                    continue
                hash_ids = _parse_line(line, f"{path}:{lineno}")
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
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not requests:
        raise TraceError(f"{path}: no requests in the trace")
    return Workload.from_requests(f"mooncake:{path.name}", requests, block_tokens=block_tokens)
