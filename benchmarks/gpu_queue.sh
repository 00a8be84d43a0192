#!/usr/bin/env bash
# The GPU queue: the commands of docs/performance.md's figures, run from the repository root on one
# H200, each under its own timeout, 8 minutes in all. Tables go to stdout; with $OUT set, CSV / JSON
# files go there too.
#   bash benchmarks/gpu_queue.sh                 # the kernel table and the end to end run (8 minutes)
#   bash benchmarks/gpu_queue.sh gpu-tests       # others by name (gpu-tests: the pytest gpu tier)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-$(mktemp -d)}
want=" ${*:-kernels e2e} "
run() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  [[ $want == *" $name "* ]] || return 0
  echo "=== $name: timeout $secs $*"
  timeout "$secs" "$@"; local rc=$?
  [[ $rc == 0 ]] || echo "=== $name: exit $rc"
}
# kernel table, every section (anchors: copy bandwidth, bf16 matmul, FLA when it imports): ~150 s
run kernels 200 python -m benchmarks.bench_kernels --budget 120 --csv "$out/kernels.csv" --json "$out/kernels.json"
# full-depth Kimi-Linear-48B-A3B, random bf16, engine defaults: prefill, c16, c64: ~4 min
run e2e 280 python -m benchmarks.bench_e2e full --csv "$out/e2e.csv"
# not in the default list (run by name): the gpu test tier, kernels and the trained tiny vs the reference ops
run gpu-tests 300 env JAX_PLATFORMS=cuda python -m pytest -m gpu -n 0 -q tests/test_gpu_kernels.py tests/test_gpu_tiny.py
