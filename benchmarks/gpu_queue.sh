#!/usr/bin/env bash
# The GPU queue: the commands of docs/performance.md's figures, run from the repository root on one
# H200, each under its own timeout, 8 minutes in all. Tables go to stdout; with $OUT set, CSV / JSON
# files go there too.
#   bash benchmarks/gpu_queue.sh                 # end to end and speculative decoding (8 minutes)
#   bash benchmarks/gpu_queue.sh gpu-tests       # others by name (gpu-tests: the pytest gpu tier)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-$(mktemp -d)}
want=" ${*:-e2e spec} "
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
run e2e 250 python -m benchmarks.bench_e2e full --csv "$out/e2e.csv"
# speculative decoding at its two ends (oracle drafter all accepted / wrong drafter all rejected) and c16 ngram
run spec 230 python -m benchmarks.bench_spec --model kimi-linear-48b-a3b --seed 0 --c1-tokens 128 --cN-tokens 256
# long context: 2k-128k prompts, the MLA kernel row at 128k, decode at 128k vs 2k, 16 streams during a 128k prefill
run long 300 python -m benchmarks.bench_long_context --rows prefill,kernel,decode,streams --prefill 2048,8192,32768,131072 --json "$out/long.json"
# long prompts advance one prefix-cache checkpoint (state_block_size, 1024 tokens) a step: the same prompts with 4096
run long-sb 300 python -m benchmarks.bench_long_context --rows prefill --prefill 32768,131072 --no-warmup --max-model-len 140000 --state-block-size 4096
# a 1M-token prompt (the engine's default max_model_len; the row then decodes)
run long-1m 480 python -m benchmarks.bench_long_context --rows prefill --prefill 1048320 --no-warmup --json "$out/long_1m.json"
# where a 128k prompt's time goes, op by op
run profile-128k 300 python -m benchmarks.profile_step --scenario prefill:1x131072 --max-model-len 140000
# serve cold, then restarted over its compilation and executable caches
run serve-start 480 python -m benchmarks.bench_serve_start --model kimi-linear-48b-a3b --seed 0 --csv "$out/serve_start.csv"
# not in the default list (run by name): the gpu test tier, kernels and the trained tiny vs the reference ops
run gpu-tests 300 env JAX_PLATFORMS=cuda python -m pytest -m gpu -n 0 -q tests/kernels/test_gpu_kernels.py tests/model/test_gpu_tiny.py tests/kernels/test_mla_long_prefix_gpu.py
