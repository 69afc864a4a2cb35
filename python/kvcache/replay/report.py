"""Present replay results: a text table, JSON (rows and run metadata), CSV, a hit-ratio plot.

The table is plain fixed-width text rather than a rich table: it is meant to be pasted and
diffed, and must not reflow with the terminal's width; and rich would be the wheel's third
runtime dependency (rich, pygments, markdown-it-py, mdurl: 1.7 MB of wheels, 13 MB installed)
and would add 48-61 ms of imports (``python -X importtime -c "import rich.console,
rich.table"``, 2-core VM) to a CLI whose own imports take 64-90 ms and whose 200-request
replay takes 0.35 s in all.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcache.replay.backends import BOUND_POLICY
from kvcache.replay.capacity import format_bytes
from kvcache.replay.errors import ConfigError
from kvcache.replay.runner import Row
from kvcache.replay.workload import Workload

__all__ = [
    "JSON_SCHEMA",
    "check_plot_path",
    "check_plotting",
    "format_table",
    "hit_ratio_figure",
    "plot_hit_ratio",
    "to_csv",
    "to_json",
]

#: Version of the ``--json`` document's layout; bumped when a field changes meaning or goes.
JSON_SCHEMA = 1


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _fmt_ns(value: float) -> str:
    return f"{value:,.0f}"


def format_table(
    rows: Sequence[Row], workload: Workload, *, block_source: str | None = None
) -> str:
    """A fixed-width table, one line per policy x capacity, with a header naming the workload.

    ``block_source`` (how the bytes per block were obtained) adds a ``memory`` column and a
    header line.
    """
    compared = any(row.reference is not None for row in rows)
    sized = any(row.capacity.bytes is not None for row in rows)
    bounded = any(row.bound_hit_ratio is not None for row in rows)
    header = [
        f"workload: {workload.name}: {_count(len(workload.requests), 'request')}, "
        f"{_count(workload.key_visits, 'key visit')}, "
        f"{_count(workload.unique_blocks, 'unique block')} "
        f"({_count(workload.block_tokens, 'token')} each)"
        + (f"; hints: {workload.hint_source}" if workload.hint_source else ""),
    ]
    if block_source is not None:
        header.append(f"block: {block_source}")
    if rows:
        first = rows[0]
        opts = first.options
        setting = [f"lag {opts.lag}"]
        if opts.store_threshold >= 2:
            setting.append(f"store_threshold {opts.store_threshold}")
        if opts.preempt_every:
            setting.append(f"preempt every {opts.preempt_every}")
        if opts.fail_store_every:
            setting.append(f"fail every {opts.fail_store_every}th store")
        header.append(
            f"backend: {first.run.backend} (vLLM {first.run.semantics} semantics), "
            f"{', '.join(setting)}, best of {first.timing.repeat}; "
            "ns/visit = (replay - null replay) / lookups"
        )
    columns = [("policy", "<"), ("capacity", ">")]
    if sized:
        columns.append(("memory", ">"))
    columns.append(("hit ratio", ">"))
    if bounded:
        columns.append(("of bound", ">"))
    columns += [
        ("stored", ">"),
        ("evicted", ">"),
        ("failed prep", ">"),
        ("ns/visit", ">"),
    ]
    if compared:
        columns += [("vllm ns/visit", ">"), ("speedup", ">"), ("decisions", "<")]
    lines: list[list[str]] = []
    for row in rows:
        run = row.run
        capacity = f"{run.num_chunks:,}"
        if row.capacity.clamped:
            capacity += f" ({row.capacity.spec}, clamped)"
        elif not row.capacity.spec.isdigit():
            capacity += f" ({row.capacity.spec})"
        cells = [run.policy, capacity]
        if sized:
            size = row.capacity.bytes
            cells.append("-" if size is None else format_bytes(size))
        cells.append(f"{run.hit_ratio:.4f}")
        if bounded:
            of_bound = row.of_bound
            cells.append("-" if of_bound is None else f"{of_bound:.3f}")
        offline = run.policy == BOUND_POLICY
        cells += [
            f"{run.stored:,}",
            f"{run.evicted:,}",
            f"{run.failed_prepares:,}",
            "offline" if offline else _fmt_ns(row.timing.ns_per_visit),
        ]
        if compared:
            speedup = row.speedup
            matched = row.comparison.matched if row.comparison is not None else None
            cells += [
                _fmt_ns(row.reference.ns_per_visit) if row.reference is not None else "-",
                f"{speedup:.1f}x" if speedup is not None else "n/a",
                {True: "identical", False: "DIVERGED", None: "-"}[matched],
            ]
        lines.append(cells)
    widths = [
        max(len(title), *(len(cells[i]) for cells in lines)) if lines else len(title)
        for i, (title, _) in enumerate(columns)
    ]

    def render(cells: Sequence[str]) -> str:
        parts = [
            f"{cell:{align}{width}}"
            for cell, (_, align), width in zip(cells, columns, widths, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [*header, "", render([title for title, _ in columns])]
    out += [render(cells) for cells in lines]
    for row in rows:
        if row.comparison is not None and not row.comparison.matched:
            out.append(
                f"divergence ({row.run.policy}, {row.run.num_chunks:,}): "
                f"{row.comparison.divergence}"
            )
    return "\n".join(out)


def to_json(rows: Sequence[Row], meta: Mapping[str, Any]) -> str:
    """The ``--json`` document: ``{"schema", "meta", "rows"}`` (rows: :meth:`Row.as_dict`)."""
    document = {"schema": JSON_SCHEMA, "meta": dict(meta), "rows": [r.as_dict() for r in rows]}
    return json.dumps(document, indent=2)


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, Mapping):  # lookup_stops: {"MISS": 3, ...} -> "MISS=3;..."
        return ";".join(f"{k}={v}" for k, v in value.items())
    return value


def to_csv(rows: Sequence[Row]) -> str:
    """The ``--csv`` output: a header line and one line per row, the ``--json`` row fields."""
    dicts = [row.as_dict() for row in rows]
    fields = list(dict.fromkeys(name for d in dicts for name in d))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for d in dicts:
        writer.writerow({k: _csv_cell(v) for k, v in d.items()})
    return out.getvalue()


def check_plotting() -> None:
    """Fail early, before a long replay, if matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install 'kvcache-offload[plot]')") from None


def check_plot_path(path: str | os.PathLike[str]) -> None:
    """Fail early, before a long replay, if the plot could not be written to ``path``: a
    format matplotlib cannot write, a missing directory, a directory, or no permission.

    Opens the file for appending (and removes it again if it did not exist), which is the only
    check that answers for every file system and permission scheme.
    """
    check_plotting()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    target = Path(path)
    formats = FigureCanvasAgg.get_supported_filetypes()
    suffix = target.suffix.lower().lstrip(".")
    if suffix not in formats:
        raise ConfigError(
            f"cannot write plot {os.fspath(path)!r}: unknown format {suffix or '(none)'!r} "
            f"(use one of .{', .'.join(sorted(formats))})"
        )
    existed = target.exists()
    try:
        with target.open("ab"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write plot {os.fspath(path)!r}: {exc.strerror or exc}") from None
    if not existed:
        target.unlink(missing_ok=True)


def hit_ratio_figure(rows: Sequence[Row], *, title: str) -> Any:
    """A matplotlib figure of hit ratio against capacity, one line per policy.

    The capacity axis is in GiB of host memory when every row knows its bytes (a block size was
    given), else in chunks. The caller closes the figure.
    """
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    in_bytes = bool(rows) and all(row.capacity.bytes is not None for row in rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(row.run.policy for row in rows):
        points = sorted(
            (
                (row.capacity.bytes or 0) / 2**30 if in_bytes else row.run.num_chunks,
                row.run.hit_ratio,
            )
            for row in rows
            if row.run.policy == policy
        )
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy.upper())
    ax.set_xlabel("capacity (GiB of host memory)" if in_bytes else "capacity (chunks)")
    ax.set_ylabel("hit ratio (hits / key visits)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_hit_ratio(rows: Sequence[Row], path: str | os.PathLike[str], *, title: str) -> None:
    """Draw :func:`hit_ratio_figure` into ``path`` (the format follows the suffix)."""
    fig = hit_ratio_figure(rows, title=title)
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise ConfigError(f"cannot write plot {os.fspath(path)!r}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
