"""Present replay results: a text table, JSON rows, a hit-ratio plot."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from kvcache.replay.errors import ConfigError
from kvcache.replay.runner import Row
from kvcache.replay.workload import Workload

__all__ = ["check_plotting", "format_table", "plot_hit_ratio", "to_json"]


def _fmt_ns(value: float) -> str:
    return f"{value:,.0f}"


def format_table(rows: Sequence[Row], workload: Workload) -> str:
    """A fixed-width table, one line per policy x capacity, with a header naming the workload."""
    compared = any(row.reference is not None for row in rows)
    header = [
        f"workload: {workload.name}: {len(workload.requests):,} requests, "
        f"{workload.key_visits:,} key visits, {workload.unique_blocks:,} unique blocks "
        f"({workload.block_tokens} tokens each)",
    ]
    if rows:
        first = rows[0]
        header.append(
            f"backend: {first.run.backend}, lag {first.lag}, best of {first.timing.repeat}; "
            "ns/visit = (replay - null replay) / lookups"
        )
    columns = [
        ("policy", "<"),
        ("capacity", ">"),
        ("hit ratio", ">"),
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
        if row.capacity_spec.endswith("%"):
            capacity += f" ({row.capacity_spec})"
        cells = [
            run.policy,
            capacity,
            f"{run.hit_ratio:.4f}",
            f"{run.stored:,}",
            f"{run.evicted:,}",
            f"{run.failed_prepares:,}",
            _fmt_ns(row.timing.ns_per_visit),
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


def to_json(rows: Sequence[Row]) -> str:
    """The ``--json`` output: a list of row objects (see :meth:`Row.as_dict`)."""
    return json.dumps([row.as_dict() for row in rows], indent=2)


def check_plotting() -> None:
    """Fail early, before a long replay, if matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib (pip install matplotlib, or the 'plot' extra)"
        ) from None


def plot_hit_ratio(rows: Sequence[Row], path: str | os.PathLike[str], *, title: str) -> None:
    """Draw hit ratio against capacity (in chunks), one line per policy, into ``path``."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(row.run.policy for row in rows):
        points = sorted(
            (row.run.num_chunks, row.run.hit_ratio) for row in rows if row.run.policy == policy
        )
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy.upper())
    ax.set_xlabel("capacity (chunks)")
    ax.set_ylabel("hit ratio (hits / key visits)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise ConfigError(f"cannot write plot {os.fspath(path)!r}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
