#!/usr/bin/env bash
# The GPU acceptance check of kvcache on a CUDA machine that has torch + Triton + numpy but
# neither vLLM nor Rust (gpu/README.md). Carry the repository checkout and the abi3 wheel (built
# where Rust is available: `make wheel`), then, from the repository root:
#   bash gpu/run.sh [dist/kvcache_offload-*.whl] [check|worker|transfer|all] [options]
# The wheel is installed into a private directory (nothing else is touched) and run from there:
#   check    (default, < 5 min on an H200) gpu/check.py: every copy path, every byte,
#            kvcache's worker under both vLLM contracts, bandwidth next to the large copy;
#            JSON to $OUT/gpu_check.json (OUT set) or ./gpu_check.json.
#   worker   gpu/worker_check.py: the A/B against vLLM's own worker (needs vLLM with its
#            compiled ops); JSON to $OUT/gpu_worker_check.json.
#   transfer python -m kvcache.transfer bench: engine round trips and the bandwidth sweep;
#            JSON to $OUT/transfer_bench.json.
#   all      check, then transfer.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
if [[ "${1:-}" == *.whl ]]; then
    wheel="$1"
    shift
else
    wheel="$(ls dist/kvcache_offload-*.whl 2>/dev/null | head -n 1 || true)"
fi
if [[ ! -f "$wheel" ]]; then
    echo "no kvcache_offload wheel found in dist/ (build one: make wheel)" >&2
    exit 2
fi
mode=check
case "${1:-}" in
    check|worker|transfer|all) mode="$1"; shift ;;
esac

python="${PYTHON:-python3}"
out="${OUT:-$PWD}"
target="$(mktemp -d)"
trap 'rm -rf "$target"' EXIT

"$python" -m pip install --quiet --no-deps --no-index --target "$target" "$wheel"
cd "$target"  # so a checkout's python/ directory cannot shadow the installed wheel
status=0
if [[ "$mode" == check || "$mode" == all ]]; then
    PYTHONPATH="$target" timeout 290 "$python" "$here/check.py" \
        --json "$out/gpu_check.json" "$@" || status=$?
fi
if [[ "$mode" == worker ]]; then
    PYTHONPATH="$target" timeout 290 "$python" "$here/worker_check.py" \
        --json "$out/gpu_worker_check.json" "$@" || status=$?
fi
if [[ "$mode" == transfer || "$mode" == all ]]; then
    PYTHONPATH="$target" timeout 175 "$python" -m kvcache.transfer bench \
        --json "$out/transfer_bench.json" "$@" || status=$?
fi
exit "$status"
