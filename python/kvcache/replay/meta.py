"""What describes a replay run, for ``--json``: versions, workload, options, host and date.

Enough to tell two result files apart and to rerun one: the kvcache and vLLM versions, the
workload (with the trace's path and SHA-256), the options, the command line, and the machine.
Collecting it imports neither vLLM nor torch (versions come from package metadata).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kvcache
from kvcache._semantics import installed_vllm_version
from kvcache.replay.capacity import BlockSize
from kvcache.replay.driver import ReplayOptions
from kvcache.replay.workload import Workload

__all__ = ["cpu_model", "file_sha256", "run_metadata"]


def cpu_model() -> str | None:
    """The CPU's model name on Linux (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or None


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_metadata(
    *,
    workload: Workload,
    backend: str,
    reference: str | None,
    options: ReplayOptions,
    repeat: int,
    trace: str | os.PathLike[str] | None = None,
    block: BlockSize | None = None,
    argv: Sequence[str] = (),
) -> dict[str, Any]:
    """The ``meta`` object of ``--json`` output."""
    return {
        "kvcache": kvcache.__version__,
        "vllm": installed_vllm_version(),
        "python": platform.python_version(),
        "command": shlex.join(["kvcache", *argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "workload": {
            "name": workload.name,
            "requests": len(workload.requests),
            "key_visits": workload.key_visits,
            "unique_blocks": workload.unique_blocks,
            "block_tokens": workload.block_tokens,
            "hints": workload.hint_source,
            "trace": None if trace is None else str(Path(trace).resolve()),
            "trace_sha256": None if trace is None else file_sha256(trace),
        },
        "backend": backend,
        "reference": reference,
        "lag": options.lag,
        "fail_store_every": options.fail_store_every,
        "preempt_every": options.preempt_every,
        "store_threshold": options.store_threshold,
        "events": options.drain_events,
        "repeat": repeat,
        "bytes_per_block": None if block is None else block.bytes,
        "chunk_bytes": None if block is None else block.chunk_bytes,
        "block_size_source": None if block is None else block.source,
    }
