#!/usr/bin/env bash
# GPU check of kvcache.transfer on a CUDA machine that has torch + Triton + numpy but no Rust.
#
# Build the abi3 wheel where Rust is available:   maturin build --release -o dist
# then, on the GPU machine, from the repository root:
#   bash bench/gpu_transfer_check.sh [dist/kvcache-*.whl] [extra bench options]
# The wheel is installed into a private directory (nothing else is touched) and
# `python -m kvcache.transfer bench` runs from it: correctness round trips, then the bandwidth
# sweep. The JSON report goes to $OUT/transfer_bench.json when OUT is set, else ./.
set -euo pipefail

wheel="${1:-}"
if [[ -z "$wheel" ]]; then
    wheel="$(ls dist/kvcache-*.whl 2>/dev/null | head -n 1 || true)"
fi
[[ -f "$wheel" ]] || { echo "no kvcache wheel found (build one with maturin build -o dist)" >&2; exit 2; }
shift || true

python="${PYTHON:-python3}"
json="${OUT:-$PWD}/transfer_bench.json"
target="$(mktemp -d)"
trap 'rm -rf "$target"' EXIT

"$python" -m pip install --quiet --no-deps --no-index --target "$target" "$wheel"
cd "$target"  # so a checkout's python/ directory cannot shadow the installed wheel
PYTHONPATH="$target" timeout 175 "$python" -m kvcache.transfer bench --json "$json" "$@"
