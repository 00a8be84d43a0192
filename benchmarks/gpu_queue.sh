#!/usr/bin/env bash
# The GPU queue: the commands of docs/performance.md's figures, run from the repository root on one
# H200, each under its own timeout, 8 minutes in all. Tables go to stdout; with $OUT set, CSV / JSON
# files go there too.
#   bash benchmarks/gpu_queue.sh                 # everything below
#   bash benchmarks/gpu_queue.sh e2e kernels     # a subset, by name
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
