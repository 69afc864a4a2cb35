"""Command line: ``kvcache replay``, ``kvcache check-config``, ``kvcache transfer bench`` (also
``python -m kvcache ...``).

Errors the user can fix (bad options, a missing or malformed trace, a backend or a dependency
that is not installed, a full disk, an output encoding that cannot hold the text) end in one
line on stderr and exit status 2; a replay whose decisions diverged from vLLM's under
``--compare-vllm`` exits 1; a closed output pipe ends quietly with 141, as ``head``'s writers
do (see :func:`main`). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

import kvcache
from kvcache._argparse import OneLineParser as _Parser
from kvcache._check_config import ModelShape
from kvcache._core import MAX_ITEMS
from kvcache._semantics import VLLM_SEMANTICS
from kvcache.replay.backends import (
    BACKENDS,
    BOUND_POLICY,
    POLICIES,
    POLICY_CLASSES,
    Backend,
    get_backend,
    parse_policies,
    vllm_backend,
)
from kvcache.replay.capacity import (
    DTYPE_BYTES,
    BlockSize,
    Capacity,
    CapacitySpec,
    format_bytes,
    kv_bytes_per_block,
    parse_capacities,
    parse_size,
    resolve_capacities,
)
from kvcache.replay.driver import MAX_STORE_THRESHOLD, ReplayOptions
from kvcache.replay.errors import ConfigError, ReplayError, quoted
from kvcache.replay.hints import HintMode, apply_hints, parse_hint_mode
from kvcache.replay.progress import GridProgress, RunLines
from kvcache.replay.report import (
    check_plot_path,
    format_table,
    plot_hit_ratio,
    to_csv,
    to_json,
)
from kvcache.replay.runner import ProgressFactory, Row, grid_runs, run_grid
from kvcache.replay.trace import (
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_TRACE_BLOCK_TOKENS,
    MAX_JSON_DEPTH,
    MAX_LINE_BYTES,
    load_mooncake_trace,
)
from kvcache.replay.workload import SyntheticChat, Workload, synthetic_chat

__all__ = ["build_parser", "main"]

DEFAULT_POLICIES = "lru,arc,turn"
DEFAULT_CAPACITIES = "10%,25%,50%,100%"
DEFAULT_KV_DTYPE = "bfloat16"
#: The name pip knows kvcache by (for install hints; the import package is ``kvcache``).
DISTRIBUTION = "kvcache-offload"
#: The built-in workload is generated in memory: 100,000 requests are ~22 M key visits, ~1 GB.
MAX_SYNTHETIC_REQUESTS = 100_000
#: Tokens per key: far above any KV block size, and keeps every token position within int64.
MAX_BLOCK_TOKENS = 1 << 20
#: What a count without a tighter bound may be: the largest signed 64-bit integer.
MAX_COUNT = (1 << 63) - 1
#: Each repeat replays every policy and capacity once more.
MAX_REPEAT = 1_000
#: Layers, KV heads, head size: far above any model's.
MAX_MODEL_DIM = 1 << 20
#: The model shape check-config assumes when none is given.
_CHECK_SHAPE = ModelShape()
#: The largest host size a capacity or block may name (1 EiB).
MAX_BYTES = 1 << 60


def _int_option(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high``, the range named when refused."""

    def parse(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:  # not an integer, or more digits than Python converts
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected an integer from {low:,} to {high:,}, not {quoted(text)}"
            )
        return value

    return parse


def _size_option(high: int, shown: str) -> Callable[[str], int]:
    """An argparse type: a byte count from 1 to ``high`` (``shown`` in words), as plain digits
    or a number with a unit (``2MiB``)."""

    def parse(text: str) -> int:
        refused = f"expected a size from 1 byte to {shown}, not {quoted(text)}"
        if text.strip().isdigit():
            try:
                value = int(text)
            except ValueError:  # more digits than Python converts
                raise argparse.ArgumentTypeError(refused) from None
        else:
            try:
                value = parse_size(text)
            except ConfigError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        if not 1 <= value <= high:
            raise argparse.ArgumentTypeError(refused)
        return value

    return parse


#: The replay's --help epilog (argparse fills it to the terminal's width).
_LIMITS = (
    "limits: every number is checked as it is parsed, and a refusal names the accepted range "
    "(a count without a tighter bound is at most 2**63 - 1). A trace is read only from a "
    f"regular file; a line may be {format_bytes(DEFAULT_MAX_LINE_BYTES)} long (raise it with "
    f"--max-line-bytes, up to {format_bytes(MAX_LINE_BYTES)}), nest JSON {MAX_JSON_DEPTH} "
    f"levels deep, and hold integers of up to 64 bits and at most {MAX_ITEMS:,} hash ids. "
    "See docs/replay.md."
)


def _add_replay_parser(commands: argparse._SubParsersAction[_Parser]) -> None:
    rp = commands.add_parser(
        "replay",
        help="replay a workload through an offloading manager; hit ratios and CPU time",
        description=(
            "Replay the built-in multi-turn chat workload (default) or a Mooncake trace through "
            "an OffloadingManager for each policy x capacity, and report hit ratio, stores, "
            "evictions, failed prepares and the time spent inside the manager per key visit "
            "(replay time minus the same replay against a do-nothing manager)."
        ),
        epilog=_LIMITS,
    )
    wl = rp.add_argument_group("workload")
    wl.add_argument("--trace", metavar="FILE", help="Mooncake JSONL trace (one request a line)")
    wl.add_argument(
        "--requests",
        type=_int_option(1, MAX_COUNT),
        metavar="N",
        help=f"synthetic: number of requests (default {SyntheticChat().requests}, at most "
        f"{MAX_SYNTHETIC_REQUESTS:,}); trace: replay only the first N",
    )
    wl.add_argument(
        "--seed",
        type=_int_option(-(1 << 63), (1 << 63) - 1),
        metavar="N",
        help="seed of the built-in workload and of drawn hints (--hints future:R or random), a "
        "64-bit integer (default 0); with a trace, only for drawn hints",
    )
    wl.add_argument(
        "--block-tokens",
        type=_int_option(1, MAX_BLOCK_TOKENS),
        metavar="N",
        help=f"tokens per key (default {SyntheticChat().block_tokens} synthetic, "
        f"{DEFAULT_TRACE_BLOCK_TOKENS} for traces)",
    )
    wl.add_argument(
        "--max-line-bytes",
        type=_size_option(MAX_LINE_BYTES, format_bytes(MAX_LINE_BYTES)),
        metavar="SIZE",
        help=f"longest trace line read (default {format_bytes(DEFAULT_MAX_LINE_BYTES)}, at most "
        f"{format_bytes(MAX_LINE_BYTES)}); a longer line is refused",
    )
    ex = rp.add_argument_group("experiment")
    ex.add_argument(
        "--policy",
        default=DEFAULT_POLICIES,
        metavar="LIST",
        help=f"comma-separated policies: {', '.join(POLICIES)}, or vLLM's class names "
        f"({', '.join(POLICY_CLASSES.values())}); {BOUND_POLICY}, the offline bound (it knows "
        "the whole workload; kvcache's manager only); all: every policy, then the bound "
        f"(default {DEFAULT_POLICIES})",
    )
    ex.add_argument(
        "--hints",
        default="trace",
        metavar="MODE",
        help="retention hints the requests carry (only turn reads them): trace (default: a "
        'trace line\'s "hint" field, if any), off, future (the truth, read from the '
        "workload's future: does a later request extend this one), future:R (each answer "
        "wrong with probability R, e.g. future:0.1) or random (a fair coin); synthetic hints "
        "are labelled as such in the table and the JSON",
    )
    ex.add_argument(
        "--capacity",
        default=DEFAULT_CAPACITIES,
        metavar="LIST",
        # argparse %-formats help strings: a literal percent sign must be doubled.
        help="comma-separated capacities: chunk counts (4096), percentages of the workload's "
        "unique blocks (10%%) or host memory (64GiB, needs the block size below); above the "
        f"unique blocks a capacity is clamped to them (default "
        f"{DEFAULT_CAPACITIES.replace('%', '%%')})",
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
        type=_int_option(0, MAX_COUNT),
        default=8,
        metavar="N",
        help="a request's loads and stores complete after N later requests (default 8)",
    )
    ex.add_argument(
        "--fail-store-every",
        type=_int_option(0, MAX_COUNT),
        default=0,
        metavar="K",
        help="complete every K-th store job with success=False (default 0: never)",
    )
    ex.add_argument(
        "--preempt-every",
        type=_int_option(0, MAX_COUNT),
        default=0,
        metavar="K",
        help="preempt every K-th request once: rescheduled at the next step, it offers its keys "
        "again (default 0: never)",
    )
    ex.add_argument(
        "--store-threshold",
        type=_int_option(0, MAX_STORE_THRESHOLD),
        default=1,
        metavar="N",
        help="offers a key needs before it is stored (vLLM's store_threshold; default 1: at once)",
    )
    ex.add_argument(
        "--vllm-semantics",
        choices=VLLM_SEMANTICS,
        default=None,
        help="decide as this vLLM release (default: the installed vLLM's, else the newest, "
        f"{VLLM_SEMANTICS[-1]}); they differ when a request offers a key again under "
        "--store-threshold >= 2",
    )
    ex.add_argument(
        "--repeat",
        type=_int_option(1, MAX_REPEAT),
        default=1,
        metavar="N",
        help="time each replay N times and keep the fastest (default 1)",
    )
    ex.add_argument(
        "--events",
        action="store_true",
        help="enable the manager's events and take them after every request (timed runs)",
    )
    bs = rp.add_argument_group(
        "block size",
        "Host memory of one offloaded block (one key), for capacities in bytes: given directly, "
        "or derived from the model as 2 (K and V) x layers x KV heads x head size x dtype bytes "
        "x block tokens. Chunks are page-aligned as vLLM's CPU offloading does.",
    )
    bs.add_argument(
        "--bytes-per-block",
        type=_size_option(MAX_BYTES, "1 EiB"),
        metavar="SIZE",
        help="bytes of one offloaded block, all workers together (e.g. 2MiB or 2097152)",
    )
    model_dim = _int_option(1, MAX_MODEL_DIM)
    bs.add_argument("--num-layers", type=model_dim, metavar="N", help="attention layers")
    bs.add_argument(
        "--num-kv-heads",
        type=model_dim,
        metavar="N",
        help="KV heads of the model (all tensor-parallel ranks together)",
    )
    bs.add_argument("--head-size", type=model_dim, metavar="N", help="head dimension")
    bs.add_argument(
        "--kv-dtype",
        default=DEFAULT_KV_DTYPE,
        choices=sorted(DTYPE_BYTES),
        metavar="DTYPE",
        help=f"KV cache dtype (default {DEFAULT_KV_DTYPE}; fp8, float16, float32, ...)",
    )
    out = rp.add_argument_group("output")
    fmt = out.add_mutually_exclusive_group()
    fmt.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (run metadata and rows) instead of the table",
    )
    fmt.add_argument("--csv", action="store_true", help="print CSV rows instead of the table")
    out.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw hit ratio vs capacity per policy (GiB when the block size is known)",
    )
    out.add_argument(
        "--quiet",
        action="store_true",
        help="no progress (a bar on a terminal, else a line per finished run)",
    )


def _add_transfer_parser(commands: argparse._SubParsersAction[_Parser]) -> None:
    tp = commands.add_parser(
        "transfer",
        help="GPU <-> host transfers: correctness check and bandwidth sweep (needs torch)",
        description="Tools for kvcache.transfer (they need torch; on a GPU machine, CUDA).",
    )
    tp.set_defaults(transfer_help=tp.format_help)
    sub = tp.add_subparsers(dest="transfer_command", metavar="COMMAND", parser_class=_Parser)
    # Its options belong to kvcache.transfer's bench, which parses them (and answers --help).
    sub.add_parser(
        "bench",
        add_help=False,
        help="byte-exact round trips, then a bandwidth sweep (--device cpu: a CPU smoke test; "
        "--help for its options)",
    )


def _add_check_config_parser(commands: argparse._SubParsersAction[_Parser]) -> None:
    cp = commands.add_parser(
        "check-config",
        help="what vLLM will build from a --kv-transfer-config (no GPU needed)",
        description="Builds what vLLM's OffloadingConnector builds from CONFIG (the spec through "
        "vLLM's own factory, a CPU spec's manager) on this machine's CPU, and prints what will "
        "run: the spec, manager, policy, worker, host memory, tiers and every key nobody reads. "
        "A mistake is one line on stderr, exit status 2. Run it in the Python environment vLLM "
        "serves from.",
    )
    cp.add_argument(
        "config",
        metavar="CONFIG",
        help="the JSON given to vllm serve --kv-transfer-config, or @FILE.json",
    )
    cp.add_argument(
        "--kv-offloading-size",
        type=float,
        metavar="GIB",
        help="as vllm serve --kv-offloading-size (sets the connector and cpu_bytes_to_use)",
    )
    shape = cp.add_argument_group(
        "model shape",
        "The KV cache the chunk size and count are computed for (standard attention). Default: "
        f"{_CHECK_SHAPE.layers} layers, {_CHECK_SHAPE.kv_heads} KV heads, head size "
        f"{_CHECK_SHAPE.head_size}, {_CHECK_SHAPE.dtype}, vLLM's default block size.",
    )
    model_dim = _int_option(1, 1 << 16)
    shape.add_argument("--num-layers", type=model_dim, metavar="N", help="attention layers")
    shape.add_argument(
        "--num-kv-heads", type=model_dim, metavar="N", help="KV heads (all ranks together)"
    )
    shape.add_argument("--head-size", type=model_dim, metavar="N", help="head dimension")
    shape.add_argument(
        "--kv-dtype", choices=sorted(DTYPE_BYTES), metavar="DTYPE", help="KV cache dtype"
    )
    shape.add_argument(
        "--block-size", type=model_dim, metavar="TOKENS", help="tokens per GPU KV block"
    )


def _check_config(args: argparse.Namespace) -> int:
    from kvcache._check_config import run

    given = {
        name: getattr(args, name)
        for name in ("num_layers", "num_kv_heads", "head_size", "kv_dtype", "block_size")
        if getattr(args, name) is not None
    }
    shape = ModelShape(
        layers=given.get("num_layers", _CHECK_SHAPE.layers),
        kv_heads=given.get("num_kv_heads", _CHECK_SHAPE.kv_heads),
        head_size=given.get("head_size", _CHECK_SHAPE.head_size),
        dtype=given.get("kv_dtype", _CHECK_SHAPE.dtype),
        block_size=given.get("block_size"),
        given={"num_layers", "num_kv_heads", "head_size"} <= given.keys(),
    )
    return run(
        args.config,
        shape,
        offloading_size=args.kv_offloading_size,
        stdout=sys.stdout,
        stderr=sys.stderr,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvcache",
        description="Fast CPU KV-cache offloading for vLLM: tools.",
    )
    parser.add_argument("--version", action="version", version=f"kvcache {kvcache.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_replay_parser(commands)
    _add_check_config_parser(commands)
    _add_transfer_parser(commands)
    return parser


def _check_workload_flags(args: argparse.Namespace, hints: HintMode) -> None:
    if args.trace is not None:
        if args.seed is not None and not hints.draws:
            raise ConfigError(
                "--seed sets the built-in workload and drawn hints (--hints future:R or random); "
                "a trace replays as recorded"
            )
    elif args.max_line_bytes is not None:
        raise ConfigError("--max-line-bytes limits trace lines; give it with --trace")
    elif args.requests is not None and args.requests > MAX_SYNTHETIC_REQUESTS:
        raise ConfigError(
            f"--requests {args.requests:,}: the built-in workload is generated in memory; "
            f"at most {MAX_SYNTHETIC_REQUESTS:,} requests"
        )


def _load_workload(args: argparse.Namespace) -> Workload:
    if args.trace is not None:
        return load_mooncake_trace(
            args.trace,
            block_tokens=args.block_tokens or DEFAULT_TRACE_BLOCK_TOKENS,
            max_requests=args.requests,
            max_line_bytes=args.max_line_bytes or DEFAULT_MAX_LINE_BYTES,
        )
    defaults = SyntheticChat()
    spec = SyntheticChat(
        requests=args.requests or defaults.requests,
        seed=0 if args.seed is None else args.seed,
        block_tokens=args.block_tokens or defaults.block_tokens,
    )
    return synthetic_chat(spec)


_MODEL_FLAGS = ("num_layers", "num_kv_heads", "head_size")


def _check_block_flags(args: argparse.Namespace, specs: Sequence[CapacitySpec]) -> None:
    given = [name for name in _MODEL_FLAGS if getattr(args, name) is not None]
    if args.bytes_per_block is not None and given:
        raise ConfigError("give either --bytes-per-block or the model's shape, not both")
    if given and len(given) != len(_MODEL_FLAGS):
        missing = [f"--{n.replace('_', '-')}" for n in _MODEL_FLAGS if n not in given]
        raise ConfigError(f"the model's shape also needs {' and '.join(missing)}")
    if args.bytes_per_block is None and not given:
        # Known from the flags alone: refuse before the workload is generated or read.
        for spec in specs:
            if spec.bytes is not None:
                raise spec.needs_block_size()


def _block_size(args: argparse.Namespace, block_tokens: int) -> BlockSize | None:
    if args.bytes_per_block is not None:
        size = args.bytes_per_block
        return BlockSize(bytes=size, source=f"{format_bytes(size)} ({size:,} B) per block, given")
    if args.num_layers is None:
        return None
    size = kv_bytes_per_block(
        layers=args.num_layers,
        kv_heads=args.num_kv_heads,
        head_size=args.head_size,
        dtype=args.kv_dtype,
        block_tokens=block_tokens,
    )
    width = DTYPE_BYTES[args.kv_dtype]
    return BlockSize(
        bytes=size,
        source=(
            f"2 x {args.num_layers} layers x {args.num_kv_heads} KV heads x head size "
            f"{args.head_size} x {width} B ({args.kv_dtype}) x {block_tokens} tokens = "
            f"{format_bytes(size)} ({size:,} B) per block"
        ),
    )


def _chunks(n: int) -> str:
    return f"{n:,} chunk" + ("" if n == 1 else "s")


def _clamp_note(capacity: Capacity, workload: Workload) -> str:
    return (
        f"kvcache replay: note: capacity {capacity.spec} is {_chunks(capacity.requested)}, more "
        f"than the workload's {workload.unique_blocks:,} unique blocks; replaying with "
        f"{capacity.chunks:,} (a larger cache would decide the same: it never evicts)"
    )


def _dedupe(capacities: list[Capacity], workload: Workload, stderr: TextIO) -> list[Capacity]:
    """One run per chunk count, with a note for each capacity clamped or left out: capacities
    that resolve (or clamp) to the same number of chunks would replay the same decisions."""
    first: dict[int, Capacity] = {}
    for capacity in capacities:
        kept = first.setdefault(capacity.chunks, capacity)
        if kept is capacity:
            if capacity.clamped:
                print(_clamp_note(capacity, workload), file=stderr)
            continue
        if capacity.spec == kept.spec:
            note = f"capacity {capacity.spec} is given twice"
        else:
            verb = "clamps to" if capacity.clamped else "is"
            same = _chunks(capacity.chunks)
            note = f"capacity {capacity.spec} {verb} the same {same} as {kept.spec}"
        print(f"kvcache replay: note: {note}; replayed once", file=stderr)
    return list(first.values())


def _replay(args: argparse.Namespace, argv: Sequence[str], stdout: TextIO, stderr: TextIO) -> int:
    # Everything cheap is checked before anything slow (generating, importing vLLM, replaying).
    policies = parse_policies(args.policy)
    specs = parse_capacities(args.capacity)
    _check_block_flags(args, specs)
    hints = parse_hint_mode(args.hints)
    _check_workload_flags(args, hints)
    if args.plot:
        check_plot_path(args.plot)
    options = ReplayOptions(
        lag=args.lag,
        fail_store_every=args.fail_store_every,
        preempt_every=args.preempt_every,
        store_threshold=args.store_threshold,
        drain_events=args.events,
    )
    seed = 0 if args.seed is None else args.seed
    workload = apply_hints(_load_workload(args), hints, seed=seed)
    block = _block_size(args, workload.block_tokens)
    capacities = resolve_capacities(specs, unique_blocks=workload.unique_blocks, block=block)
    capacities = _dedupe(capacities, workload, stderr)
    backend: Backend = get_backend(args.backend, args.vllm_semantics)
    reference = vllm_backend(args.vllm_semantics) if args.compare_vllm else None

    progress: GridProgress | RunLines | None = None
    if not args.quiet:
        runs = grid_runs(
            policies=len(policies),
            capacities=len(capacities),
            repeat=args.repeat,
            reference=reference is not None,
            bounds=policies.count(BOUND_POLICY),
        )
        if stderr.isatty():
            progress = GridProgress(runs=runs, requests=len(workload.requests), stream=stderr)
        else:  # a log or a pipe: a line per finished run instead of a bar
            progress = RunLines(runs=runs, stream=stderr)
    progress_for: ProgressFactory | None = progress
    try:
        rows: list[Row] = run_grid(
            workload,
            backend,
            policies=policies,
            capacities=capacities,
            options=options,
            repeat=args.repeat,
            reference=reference,
            progress_for=progress_for,
        )
    finally:
        if progress is not None:
            progress.close()
    if args.json:
        from kvcache.replay.meta import run_metadata

        meta = run_metadata(
            workload=workload,
            backend=backend.name,
            reference=None if reference is None else reference.name,
            options=options,
            repeat=args.repeat,
            trace=args.trace,
            block=block,
            argv=argv,
        )
        print(to_json(rows, meta), file=stdout)
    elif args.csv:
        stdout.write(to_csv(rows))
    else:
        print(
            format_table(rows, workload, block_source=None if block is None else block.source),
            file=stdout,
        )
    if args.plot:
        hinted = f", hints: {workload.hint_source}" if workload.hint_source else ""
        plot_hit_ratio(rows, args.plot, title=f"{workload.name} ({backend.name}{hinted})")
        if not args.quiet:
            print(f"plot written to {args.plot}", file=stderr)
    diverged = any(row.comparison is not None and not row.comparison.matched for row in rows)
    return 1 if diverged else 0


def _transfer_bench(argv: list[str]) -> int:
    # The bench parses its own options, answers --help and checks its paths without torch,
    # and reports a missing torch (up front or on a later import) in one line itself.
    from kvcache.transfer import _bench

    return _bench.main(argv)


#: A writer whose reader has gone ends as a C tool killed by SIGPIPE does in the shell.
EXIT_READER_GONE = 128 + signal.SIGPIPE
#: Writes that fail for want of room: a full disk or quota, a file past its size limit.
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (the console script passes it to ``sys.exit``).

    Output fails like a Unix tool's, without a traceback: a reader that went away (``| head``)
    ends the run quietly with status 141, what the shell reports for a writer killed by
    SIGPIPE (``yes | head -1``), since 1 already means a diverged ``--compare-vllm``; a full
    disk and text the output's encoding cannot hold (a non-ASCII trace name on an ASCII
    terminal) end in one line on stderr and status 2, as other errors the user can fix do.
    """
    if sys.stderr is None:  # started with it closed (`2>&-`): notes and progress go nowhere
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
    if sys.stdout is None:  # started with it closed (`>&-`)
        _say("kvcache: error: cannot write the output: standard output is closed")
        return 2
    try:
        try:
            return _run(argv)
        finally:
            # Buffered output fails here rather than when the interpreter exits, where it
            # would print "Exception ignored" and end with status 120.
            sys.stdout.flush()
    except (BrokenPipeError, ConnectionResetError):  # a pipe's or a socket's reader left
        _discard(sys.stdout)
        return EXIT_READER_GONE
    except OSError as exc:
        if exc.errno not in _NO_ROOM:
            raise
        _discard(sys.stdout)
        _say(f"kvcache: error: cannot write the output: {exc.strerror or exc}")
        return 2
    except UnicodeEncodeError as exc:
        text = exc.object[exc.start : exc.end] if isinstance(exc.object, str) else "?"
        _say(
            f"kvcache: error: the output holds {text!a}, which its encoding "
            f"({exc.encoding}) cannot write; set PYTHONIOENCODING=utf-8 or use a UTF-8 locale"
        )
        return 2


def _discard(stream: TextIO | None) -> None:
    """Points ``stream``'s descriptor at /dev/null: what is still buffered for a reader that
    left or a full disk would fail again when the interpreter flushes it at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())  # type: ignore[union-attr]
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's StringIO): nothing
        pass


def _say(line: str) -> None:
    """``line`` on stderr, if stderr can still take it (it may be the pipe or disk that failed)."""
    if sys.stderr is None:  # closed at start: nowhere to say it
        return
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        _discard(sys.stderr)


def _run(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "transfer":
        if args.transfer_command is None:
            print(args.transfer_help(), file=sys.stderr, end="")
            return 2
        return _transfer_bench(extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "check-config":
        return _check_config(args)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    try:
        return _replay(args, argv, sys.stdout, sys.stderr)
    except ReplayError as exc:
        print(f"kvcache replay: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvcache replay: interrupted", file=sys.stderr)
        return 130
