"""Write a replay workload in the binary form ``examples/replay_core.rs`` reads.

The Rust example replays it with the CLI's semantics through the core manager alone (no Python),
which separates the core's cost from the bindings' when profiling:

    python bench/dump_workload.py /tmp/syn.wl                       # built-in synthetic workload
    python bench/dump_workload.py /tmp/mc.wl --trace TRACE.jsonl    # a Mooncake trace
    cargo run --release --example replay_core -- /tmp/syn.wl arc 8858

Format (little-endian): u32 request count, u32 tokens per block, then per request a u32 key
count and its keys, each 36 bytes.
"""

from __future__ import annotations

import argparse
import struct

from kvcache.replay.trace import load_mooncake_trace
from kvcache.replay.workload import synthetic_chat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="file to write")
    parser.add_argument("--trace", help="Mooncake JSONL trace (default: the synthetic workload)")
    args = parser.parse_args()
    workload = load_mooncake_trace(args.trace) if args.trace else synthetic_chat()
    with open(args.out, "wb") as f:
        f.write(struct.pack("<II", len(workload.requests), workload.block_tokens))
        for keys in workload.requests:
            f.write(struct.pack("<I", len(keys)))
            for key in keys:
                if len(key) != 36:
                    raise SystemExit(f"keys must be 36 bytes, got {len(key)}")
                f.write(key)


if __name__ == "__main__":
    main()
