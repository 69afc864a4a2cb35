#!/usr/bin/env bash
# GPU checks of kvcache on a CUDA machine that has torch + Triton + numpy but no Rust.
#
# Build the abi3 wheel where Rust is available:   maturin build --release -o dist
# then, on the GPU machine, from the repository root:
#   bash bench/gpu_transfer_check.sh [dist/kvcache_offload-*.whl] [worker|transfer|all] [extra options]
# The wheel is installed into a private directory (nothing else is touched) and run from there:
#   worker   (default, < 5 min on an H200) bench/gpu_worker_check.py: kvcache's vLLM worker vs
#            vLLM 0.33.0's (when vLLM is installed) on identical layouts, with byte checks;
#            JSON to $OUT/gpu_worker_check.json when OUT is set, else ./.
#   transfer python -m kvcache.transfer bench: engine round trips and the bandwidth sweep;
#            JSON to $OUT/transfer_bench.json.
#   all      both (about 8 minutes).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
wheel="${1:-}"
if [[ -z "$wheel" || "$wheel" == worker || "$wheel" == transfer || "$wheel" == all ]]; then
    wheel="$(ls dist/kvcache_offload-*.whl 2>/dev/null | head -n 1 || true)"
else
    shift
fi
if [[ ! -f "$wheel" ]]; then
    echo "no kvcache_offload wheel found in dist/ (build one: maturin build --release -o dist)" >&2
    exit 2
fi
mode="${1:-worker}"
[[ $# -gt 0 ]] && shift

python="${PYTHON:-python3}"
out="${OUT:-$PWD}"
target="$(mktemp -d)"
trap 'rm -rf "$target"' EXIT

"$python" -m pip install --quiet --no-deps --no-index --target "$target" "$wheel"
cd "$target"  # so a checkout's python/ directory cannot shadow the installed wheel
status=0
if [[ "$mode" == worker || "$mode" == all ]]; then
    PYTHONPATH="$target" timeout 290 "$python" "$here/gpu_worker_check.py" \
        --json "$out/gpu_worker_check.json" "$@" || status=$?
fi
if [[ "$mode" == transfer || "$mode" == all ]]; then
    PYTHONPATH="$target" timeout 175 "$python" -m kvcache.transfer bench \
        --json "$out/transfer_bench.json" "$@" || status=$?
fi
exit "$status"
