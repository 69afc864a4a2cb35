"""Command line: ``kvcache replay`` (also ``python -m kvcache replay``).

Errors the user can fix (bad options, a missing or malformed trace, a backend that is not built)
end in one line on stderr and exit status 2; a replay whose decisions diverged from vLLM's under
``--compare-vllm`` exits 1. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, TextIO

from kvcache.replay.backends import BACKENDS, Backend, get_backend, vllm_backend
from kvcache.replay.errors import ReplayError
from kvcache.replay.report import check_plotting, format_table, plot_hit_ratio, to_json
from kvcache.replay.runner import Row, parse_capacities, parse_policies, run_grid
from kvcache.replay.trace import DEFAULT_TRACE_BLOCK_TOKENS, load_mooncake_trace
from kvcache.replay.workload import SyntheticChat, Workload, synthetic_chat

__all__ = ["build_parser", "main"]

DEFAULT_POLICIES = "lru,arc"
DEFAULT_CAPACITIES = "10%,25%,50%,100%"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump), like every other error here."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, not {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvcache",
        description="Fast CPU KV-cache offloading for vLLM: tools.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    rp = commands.add_parser(
        "replay",
        help="replay a workload through an offloading manager; hit ratios and CPU time",
        description=(
            "Replay the built-in multi-turn chat workload (default) or a Mooncake trace through "
            "an OffloadingManager for each policy x capacity, and report hit ratio, stores, "
            "evictions, failed prepares and the time spent inside the manager per key visit "
            "(replay time minus the same replay against a do-nothing manager)."
        ),
    )
    wl = rp.add_argument_group("workload")
    wl.add_argument("--trace", metavar="FILE", help="Mooncake JSONL trace (one request a line)")
    wl.add_argument(
        "--requests",
        type=_positive_int,
        metavar="N",
        help=f"synthetic: number of requests (default {SyntheticChat().requests}); "
        "trace: replay only the first N",
    )
    wl.add_argument("--seed", type=int, default=0, help="synthetic workload seed (default 0)")
    wl.add_argument(
        "--block-tokens",
        type=_positive_int,
        metavar="N",
        help=f"tokens per key (default {SyntheticChat().block_tokens} synthetic, "
        f"{DEFAULT_TRACE_BLOCK_TOKENS} for traces)",
    )
    ex = rp.add_argument_group("experiment")
    ex.add_argument(
        "--policy",
        default=DEFAULT_POLICIES,
        metavar="LIST",
        help=f"comma-separated policies (default {DEFAULT_POLICIES})",
    )
    ex.add_argument(
        "--capacity",
        default=DEFAULT_CAPACITIES,
        metavar="LIST",
        # argparse %-formats help strings: a literal percent sign must be doubled.
        help="comma-separated capacities: chunk counts or percentages of the workload's unique "
        f"blocks (default {DEFAULT_CAPACITIES.replace('%', '%%')})",
    )
    ex.add_argument(
        "--backend",
        default="kvcache",
        choices=BACKENDS,
        help="manager to measure (default kvcache: the Rust manager; vllm-rust-policies: "
        "vLLM's manager with our Rust policies loaded by name)",
    )
    ex.add_argument(
        "--compare-vllm",
        action="store_true",
        help="also run vLLM's manager: speedup, and whether every decision matched",
    )
    ex.add_argument(
        "--lag",
        type=_non_negative_int,
        default=8,
        metavar="N",
        help="a request's loads and stores complete after N later requests (default 8)",
    )
    ex.add_argument(
        "--fail-store-every",
        type=_non_negative_int,
        default=0,
        metavar="K",
        help="complete every K-th store job with success=False (default 0: never)",
    )
    ex.add_argument(
        "--repeat",
        type=_positive_int,
        default=1,
        metavar="N",
        help="time each replay N times and keep the fastest (default 1)",
    )
    ex.add_argument(
        "--events",
        action="store_true",
        help="enable the manager's events and take them after every request (timed runs)",
    )
    out = rp.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print a JSON list of rows, no table")
    out.add_argument("--plot", metavar="FILE.png", help="draw hit ratio vs capacity per policy")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


class _ProgressBar:
    """A one-line progress bar on a terminal; cheap enough to call inside timed replays."""

    def __init__(self, stream: TextIO, width: int = 28) -> None:
        self._stream = stream
        self._width = width

    def __call__(self, label: str) -> Callable[[int, int], None]:
        stream, width = self._stream, self._width
        label = f"{label[:44]:<44}"

        def update(done: int, total: int) -> None:
            frac = done / total if total else 1.0
            filled = int(frac * width)
            line = f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {frac:4.0%}"
            if done >= total:
                line = "\r" + " " * (len(line) - 1) + "\r"
            stream.write(line)
            stream.flush()

        return update


def _load_workload(args: argparse.Namespace) -> Workload:
    if args.trace is not None:
        return load_mooncake_trace(
            args.trace,
            block_tokens=args.block_tokens or DEFAULT_TRACE_BLOCK_TOKENS,
            max_requests=args.requests,
        )
    defaults = SyntheticChat()
    spec = SyntheticChat(
        requests=args.requests or defaults.requests,
        seed=args.seed,
        block_tokens=args.block_tokens or defaults.block_tokens,
    )
    return synthetic_chat(spec)


def _replay(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    # Validate everything cheap before anything slow (generating, importing vLLM, replaying).
    policies = parse_policies(args.policy)
    capacities = parse_capacities(args.capacity)
    if args.plot:
        check_plotting()
    workload = _load_workload(args)
    for spec in capacities:
        spec.resolve(workload.unique_blocks)
    backend: Backend = get_backend(args.backend)
    reference = vllm_backend() if args.compare_vllm else None

    progress = None
    if not args.quiet and stderr.isatty():
        progress = _ProgressBar(stderr)
    rows: list[Row] = run_grid(
        workload,
        backend,
        policies=policies,
        capacities=capacities,
        lag=args.lag,
        fail_store_every=args.fail_store_every,
        drain_events=args.events,
        repeat=args.repeat,
        reference=reference,
        progress_for=progress,
    )
    if args.json:
        print(to_json(rows), file=stdout)
    else:
        print(format_table(rows, workload), file=stdout)
    if args.plot:
        plot_hit_ratio(rows, args.plot, title=f"{workload.name} ({backend.name})")
        if not args.quiet:
            print(f"plot written to {args.plot}", file=stderr)
    diverged = any(row.comparison is not None and not row.comparison.matched for row in rows)
    return 1 if diverged else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (the console script passes it to ``sys.exit``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    try:
        return _replay(args, sys.stdout, sys.stderr)
    except ReplayError as exc:
        print(f"kvcache replay: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvcache replay: interrupted", file=sys.stderr)
        return 130
