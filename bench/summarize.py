"""Turns pytest-benchmark JSON from bench/ into a markdown table: ns per key and speedups.

Usage: python bench/summarize.py .benchmarks/policies.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    rows: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        # Replays subtract the same replay against a do-nothing manager (the driver's work).
        seconds = bench["stats"]["median"] - info.get("baseline_s", 0.0)
        rows[info["kind"], info["op"]][info["impl"]] = seconds * 1e9 / info["keys_per_call"]
    impls = ["vllm", "vllm-rust-policies", "kvcache"]
    print("| policy | operation | vLLM 0.33.0 | vLLM + kvcache policies | kvcache | speedup |")
    print("|---|---|---:|---:|---:|---:|")
    for (kind, op), found in sorted(rows.items()):
        cells = [f"{found[i]:,.0f}" if i in found else "-" for i in impls]
        ref, ours = found.get("vllm"), found.get("kvcache")
        speedup = f"{ref / ours:.1f}x" if ref and ours else "-"
        print(f"| {kind.upper()} | {op} | {' | '.join(cells)} | {speedup} |")
    print("\nns per key (per key visit for replays); speedup = vLLM / kvcache.")
    machine = data.get("machine_info", {})
    print(
        f"\n_{machine.get('cpu', {}).get('brand_raw', '?')}, "
        f"Python {machine.get('python_version', '?')}, median of rounds._"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".benchmarks/policies.json")
