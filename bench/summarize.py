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
        per_key_ns = bench["stats"]["median"] * 1e9 / info["keys_per_call"]
        rows[info["kind"], info["op"]][info["impl"]] = per_key_ns
    print("| policy | operation | vLLM 0.33.0 ns/key | kvcache ns/key | speedup |")
    print("|---|---|---:|---:|---:|")
    for (kind, op), impls in sorted(rows.items()):
        ref, ours = impls.get("vllm"), impls.get("kvcache")
        speedup = f"{ref / ours:.1f}x" if ref and ours else "-"
        print(f"| {kind.upper()} | {op} | {ref:,.0f} | {ours:,.0f} | {speedup} |")
    machine = data.get("machine_info", {})
    print(
        f"\n_{machine.get('cpu', {}).get('brand_raw', '?')}, "
        f"Python {machine.get('python_version', '?')}, median of rounds._"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".benchmarks/policies.json")
