"""Maintained benchmarks. Each prints markdown tables headed by the command, date, machine and commit
(`harness.header`), and most take `--csv PATH` / `--json PATH`. Run every one as a module from the
repository root, e.g. `python -m benchmarks.bench_e2e full`; `benchmarks/gpu_queue.sh` is the H200 queue.

  harness              timers, anchors (copy bandwidth, bf16 matmul), relative error, tables, charts
  bench_kernels        the kernel table: KDA decode / prefill, MLA decode (Triton, Mosaic GPU, FP8 pages), MoE,
                       isolated and as the model calls them, anchors in the same run; its sections' rows are
                       kernels_kda, kernels_mla, kernels_mla_mosaic and kernels_moe (inputs: kernel_inputs)
  bench_e2e            the engine end to end: prefill tok/s, c16 / c64 decode step vs its floor
  profile_step         one engine step's device time by part (KDA, MLA, experts, ...) from a trace (--events: CSV)
  sweep_decode_tiles   a one-sequence decode step's few-row kernels (dense in place, routed experts) by tiling
  bench_long_context   long prompts through the engine (prefill steps, compiles) and decode at long context
  bench_spec           speculative decoding at c1 and under load, and several decode steps per launch
  step_timeline        where a c1 step's wall time goes (host parts, the GPU's programs): bench_spec --timeline,
                       --host-parts (host parts alone, the step's own compiler options), --host-profile N
  bench_serve_start    `serve` cold and restarted over the compilation cache: ready time, first tokens
  bench_offline        the offline engine on shared-prefix and multi-turn workloads, caching off / on
  bench_disagg         prefill/decode disaggregation through two servers (TTFT, transfer rate)
  bench_disagg_engines the same between two engine processes, without HTTP
  bench_compile        trace + compile time of every warm-up shape (abstract weights)
  bench_host_step      host time of one decode step (dispatch, its host copies, launch, step)
  sweep_mla_fp8        the FP8 MLA decode kernel under tuning variants vs the bf16 pool
  bench_health_under_load  /health latency while large bodies and slow clients hit the server
  probe_cudnn_mla      cuDNN fused attention at MLA's expanded prefill shapes, beside the Triton kernel

Performance lives here, never in tests; the figures of record are in docs/performance.md.
"""
