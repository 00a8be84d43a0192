#!/usr/bin/env bash
# The GPU queue: the commands of docs/performance.md's figures, run from the repository root on one
# H200, each under its own timeout, 8 minutes in all. Tables go to stdout; with $OUT set, CSV / JSON
# files go there too.
#   bash benchmarks/gpu_queue.sh                 # the MLA kernels' gpu tests, then one user's decode at 2k / 128k (7 minutes)
#   bash benchmarks/gpu_queue.sh gpu-tests       # others by name (gpu-tests: the pytest gpu tier)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-$(mktemp -d)}
want=" ${*:-gpu-tests-mla long-decode} "
run() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  [[ $want == *" $name "* ]] || return 0
  echo "=== $name: timeout $secs $*"
  timeout "$secs" "$@"; local rc=$?
  [[ $rc == 0 ]] || echo "=== $name: exit $rc"
}
# full-depth Kimi-Linear-48B-A3B, random bf16, engine defaults: prefill, c16, c64: ~4 min
run e2e 200 python -m benchmarks.bench_e2e full --csv "$out/e2e.csv"
# the same rows at the engine's own max_model_len (the longest sequence the cache holds, ~600k tokens: every step's
# block tables that wide) and at 64-token pages (the MLA decode kernel's faster page size): ~4 min each
run e2e-default-len 200 python -m benchmarks.bench_e2e full --max-model-len 0 --csv "$out/e2e_default_len.csv"
run e2e-p64 200 python -m benchmarks.bench_e2e full --page-size 64 --csv "$out/e2e_p64.csv"
# serve cold (ready after a covering set of programs, the rest compiled in the background; its c16 rows wait for
# them), then restarted over its compilation and executable caches: ~4 min
run serve-start 270 python -m benchmarks.bench_serve_start --model kimi-linear-48b-a3b --seed 0 --csv "$out/serve_start.csv"
# ---- by name --------------------------------------------------------------------------------------------------
# kernel table, every section (anchors: copy bandwidth, bf16 matmul, FLA when it imports): ~150 s
run kernels 200 python -m benchmarks.bench_kernels --budget 120 --csv "$out/kernels.csv" --json "$out/kernels.json"
# K3 MXFP4 routed experts (isolated, as the model, one-layer stack, 4-layer stack) and the decode tile sweep
run kernels-moe 200 python -m benchmarks.bench_kernels --only moe --no-fla --budget 150
# MLA decode as the model calls it (Triton at 32 heads, Mosaic at 96), one user at 128k in the 4-sequence bucket
# included: the key splits its live sequence gets vs the bucket's fixed plan: ~2 min
run kernels-mla-model 170 python -m benchmarks.bench_kernels --only mla_model --no-fla --budget 110
# MLA decode at K3's 96 heads: the Mosaic tiling sweep as the model calls it
run kernels-mla 150 python -m benchmarks.bench_kernels --only mla_mosaic --no-fla --budget 110
# FP8 vs bf16 MLA decode kernel, bytes read per second (target 0.9x), and the FP8 cache's quality on the trained tiny
run kernels-fp8 200 python -m benchmarks.bench_kernels --only mla_fp8 --no-fla --budget 150
# the FP8 decode kernel under its tuning variants vs bf16 at its default (bytes/s ratio, error vs jnp)
run kernels-fp8-sweep 300 bash -c 'python -m benchmarks.sweep_mla_fp8 --shapes 64x8192x32,16x131072x32 && python -m benchmarks.sweep_mla_fp8 --shapes 64x8192x96,16x131072x96'
# the same at the engine's default 16-token pages: the default FP8 tuning (row form, codes) vs the keys-on-M form
run kernels-fp8-p16 200 python -m benchmarks.sweep_mla_fp8 --shapes 64x8192x32,16x131072x32 --page-size 16 --variants default,T-w4,R-w8,R-w8-C
run fp8-quality 300 python -m tools.kv_cache_quality --seqs 16 --tokens 256 --json
# speculative decoding at its two ends (oracle drafter all accepted, also on its own continuation / wrong drafter all rejected), c1 with one
# decode step a launch vs several, and c16 ngram; the engine's cold warm-up compiles ~75 programs: ~5.5 min
run spec 420 python -m benchmarks.bench_spec --model kimi-linear-48b-a3b --seed 0 --c1-tokens 256 --cN 16 --cN-prompt 1024 --cN-tokens 64 --fixed-point-runs 0
# speculation's c1 rows alone (off, 1 step a launch, all accepted, forced acceptance, all rejected), an engine of 4
# sequences (its few programs compile in ~1.5 min), then the host parts of a c1 step (command buffers on): ~3 min
run spec-c1 270 python -m benchmarks.bench_spec --model kimi-linear-48b-a3b --seed 0 --c1-tokens 256 --cN 0 --max-num-seqs 4 --fixed-point-runs 0 --host-parts
# the same rows without command buffers, then where a c1 decode and a verification step's time goes (host parts, the
# GPU's kernels by program, scope and part): ~3.5 min
run spec-timeline 300 python -m benchmarks.bench_spec --model kimi-linear-48b-a3b --seed 0 --c1-tokens 256 --cN 0 --max-num-seqs 4 --fixed-point-runs 0 --timeline "$(mktemp -d)"
# the c1 rows with every XLA matmul on cuBLAS at its default algorithm (no Triton GEMM fusions, no autotuning): does
# the oracle's acceptance reach 1.00 when XLA cannot pick other GEMM kernels for the decode and verification programs?
run spec-xla-gemm 270 env XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0" python -m benchmarks.bench_spec --model kimi-linear-48b-a3b --seed 0 --c1-tokens 256 --cN 0 --max-num-seqs 4 --fixed-point-runs 0
# speculation's verification step vs decode on the GPU kernels: the kernels (the tiny presets' lowering on the GPU
# included), one MLA layer's stages bitwise, verify vs decode at Kimi-Linear's widths (fp32; bf16 with a report of
# where rows differ), the engine's oracle rows on a 5-layer slice; full log in $OUT/spec_gpu_tests.txt
run spec-gpu-tests 420 bash -c "JAX_PLATFORMS=cuda python -m pytest -m gpu -n 0 -q -s -rA tests/serving/test_spec_gpu.py -k 'mla_verify or kda_position or verify_step or fp32 or oracle_kimi or mla_layer' > $out/spec_gpu_tests.txt 2>&1; grep -E '^(PASSED|FAILED|XFAIL|XPASS|ERROR)|max\\|' $out/spec_gpu_tests.txt | cut -c1-400"
# long context: 2k-128k prompts, the MLA kernel row at 128k, decode at 128k vs 2k, 16 streams during a 128k prefill
run long 330 python -m benchmarks.bench_long_context --rows prefill,kernel,decode,streams --prefill 2048,32768,131072 --no-warmup --max-model-len 140000 --json "$out/long.json"
# one sequence's decode step at 2k and at 128k context (the 128k prompt's prefill compiles its steps first): ~2.5 min
run long-decode 240 python -m benchmarks.bench_long_context --rows decode --no-warmup --max-model-len 140000
run long-decode-p64 240 python -m benchmarks.bench_long_context --rows decode --no-warmup --max-model-len 140000 --page-size 64
# a 1M-token prompt (66 steps), then decodes: with 48B of bf16 weights the H200 keeps ~10 GiB of cache, so 16
# sequences (a KDA state slot each) and 8% of the cache for slots leave the pages room for 1M tokens
run long-1m 480 python -m benchmarks.bench_long_context --rows prefill --prefill 2048,1048320 --no-warmup --max-model-len 1048576 --max-num-seqs 16 --state-fraction 0.08 --json "$out/long_1m.json"
# the same at every default but max_model_len: the pages take the 1M sequence first, max_num_seqs drops to the slots left
run long-1m-defaults 480 python -m benchmarks.bench_long_context --rows prefill --prefill 2048,1048320 --no-warmup --max-model-len 1048576 --json "$out/long_1m_defaults.json"
# the MLA prefix kernel at 128k as the model calls it, and the 128k prompt, with the Triton window kernel vs the
# cuDNN split (prefix unmasked + chunk causal); the 32k row compiles the 16k-token step the 128k row reuses
run long-kernel-split 300 bash -c 'for k in triton cudnn-split; do python -m benchmarks.bench_long_context --rows kernel --mla-prefix-kernel $k; done'
run long-128k-triton 330 python -m benchmarks.bench_long_context --rows prefill --prefill 32768,131072 --no-warmup --max-model-len 140000 --mla-prefix-kernel triton
run long-128k-split 330 python -m benchmarks.bench_long_context --rows prefill --prefill 32768,131072 --no-warmup --max-model-len 140000 --mla-prefix-kernel cudnn-split
# where a 128k prompt's time goes, op by op
run profile-128k 300 python -m benchmarks.profile_step --scenario prefill:1x131072 --max-model-len 140000
# where one sequence's decode step goes, by part, at 2k and at 128k context
run profile-c1 300 python -m benchmarks.profile_step --scenario decode:1x2048
run profile-c1-128k 300 python -m benchmarks.profile_step --scenario decode:1x131072 --max-model-len 140000
# the few-row kernels of that step (dense weights read in place, routed experts at 1 and 4 tokens) under tile variants
run decode-tiles 300 python -m benchmarks.sweep_decode_tiles --tokens 1,4
# the MLA kernels of the gpu tier alone (Triton, Mosaic, FP8 pages, short contexts in wide tables): ~1.5 min
run gpu-tests-mla 170 env JAX_PLATFORMS=cuda python -m pytest -m gpu -n 0 -q tests/kernels/test_gpu_kernels.py -k mla
# the gpu test tier: kernels and the trained tiny vs the reference ops
run gpu-tests 300 env JAX_PLATFORMS=cuda python -m pytest -m gpu -n 0 -q tests/kernels/test_gpu_kernels.py tests/model/test_gpu_tiny.py tests/kernels/test_mla_long_prefix_gpu.py tests/kernels/test_mla_long_prefix_split_gpu.py
