"""End-to-end engine benchmark on one device (prints tables).

  python -m benchmarks.bench_e2e                           # full-depth Kimi-Linear-48B, default memory settings:
                                                        # prefill, TTFT, decode vs floor, output tok/s (one table)
  python -m benchmarks.bench_e2e check                     # tiny model: Pallas kernels vs reference, through the engine
  python -m benchmarks.bench_e2e serve --model kimi-linear-48b-a3b --layers 8 --concurrency 16 --input 1024 --output 128

The default (`full`) run: one engine (max_num_seqs 64, max_num_batched_tokens 4096, every other engine
setting at its default, prefix caching off), compiled for its buckets before anything is timed, then
  prefill   64 prompts x 2048 tokens and 256 x 64 (max_tokens 1): prompt tok/s, and its ratio to the
            FLOP roofline = (matmul FLOP/s measured in this run) / (active matmul FLOPs per token);
  c16       16 x 1024 in / 1024 out: mean TTFT, median decode step vs its floor, output tok/s;
  c64       64 x 1024 in / 256 out: the same.

`serve` uses random bf16 weights (preset + seed), prefill with chunked batches, then decode with
`concurrency` sequences; it reports output tok/s, TTFT and the median decode step time next to the
physical floor of that step: the expert bytes the step must read (expected number of distinct
experts touched by concurrency x top-k random routes) plus every other weight, the KDA states and
the MLA cache, at the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.harness import Table, add_csv_argument, copy_bandwidth, header, matmul_peak


def check(args):
    """Same prompts, greedy, through the engine with reference ops and with the Pallas kernels."""
    from k3jax.api import load_model
    from k3jax.offline import LLM, SamplingParams
    from pallas_kernels.backend import detect
    model = load_model("tiny-random", dtype="bfloat16")
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 1000, n).tolist() for n in (5, 40, 130, 300)]
    outs = {}
    for mode in ("reference", "pallas"):
        model.backend = detect(mode)          # the engine's runner closes over the model's backend
        llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, token_buckets=(16, 256),
                  seq_buckets=(4,))
        llm.engine.wait_for_compiles()        # every step program compiled before timing (background_compile)
        t = time.perf_counter()
        res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        outs[mode] = [r.outputs[0].token_ids for r in res]
        print(f"{mode}: {time.perf_counter() - t:.1f}s")
    same = sum(a == b for ra, rb in zip(outs["reference"], outs["pallas"]) for a, b in zip(ra, rb))
    first = [next((i for i, (a, b) in enumerate(zip(ra, rb)) if a != b), len(ra)) for ra, rb in zip(outs["reference"], outs["pallas"])]
    print(f"| engine check (tiny, bf16) | tokens equal {same}/{sum(map(len, outs['reference']))} | first divergence per prompt {first} |")


def floor_bytes(c, concurrency: int, context: int) -> dict:
    """Bytes one decode step must read: touched experts + other weights + KDA states + MLA cache."""
    from k3jax.info import model_info
    info = model_info(c)
    n_moe = sum(t == "moe" for t in c.mlp_types)
    bytes_per_param = 2 if c.expert_format == "bf16" else 0.5 + 1 / 32          # MXFP4: nibble + scale share
    per_expert = info["routed_expert_params"] * bytes_per_param / (c.num_experts * n_moe)
    touched = c.num_experts * (1 - (1 - c.num_experts_per_token / c.num_experts) ** concurrency)
    experts = touched * per_expert * n_moe
    other = (info["total_params"] - info["routed_expert_params"] - c.vocab_size * c.hidden_size) * 2
    states = concurrency * info["kda_state_bytes_per_sequence"] * 2                 # read + write
    cache = concurrency * context * info["mla_cache_bytes_per_token"]
    return {"experts": experts, "other": other, "states": states, "cache": cache, "touched": touched}


PARTS = ("KDA", "MLA", "routed experts", "shared experts", "MoE router/latent", "dense MLP", "other")


def part_of(op_name: str) -> str:
    """The decode-step part a JAX op belongs to, from the named scopes in k3jax/layers."""
    for key, part in (("kda_", "KDA"), ("mla_", "MLA"), ("moe_experts", "routed experts"),
                      ("moe_shared", "shared experts"), ("moe_route", "MoE router/latent"), ("dense_mlp", "dense MLP")):
        if key in op_name:
            return part
    return "other"


def floor_parts(model, concurrency: int, context: int) -> dict:
    """floor_bytes split by part: each part's weights (routed experts: the expected touched share), the
    KDA states (read + write) under KDA, the MLA cache under MLA; "other" holds the LM head, norms and
    the rest."""
    c = model.config
    fb = floor_bytes(c, concurrency, context)
    out = dict.fromkeys(PARTS, 0.0)

    def nbytes(tree) -> float:
        if isinstance(tree, dict):
            return sum(nbytes(v) for v in tree.values())
        if isinstance(tree, (list, tuple)):
            return sum(nbytes(v) for v in tree)
        return float(tree.size * tree.dtype.itemsize)

    def walk(tree):
        if isinstance(tree, (list, tuple)):
            for v in tree:
                walk(v)
            return
        for key, v in tree.items():
            if key == "attn":
                out["KDA" if "A_log" in v else "MLA"] += nbytes(v)
            elif key == "mlp" and "router" in v:
                for k, w in v.items():
                    part = {"experts": "routed experts", "shared": "shared experts"}.get(k, "MoE router/latent")
                    out[part] += nbytes(w) * (fb["touched"] / c.num_experts if k == "experts" else 1)
            elif key == "mlp":
                out["dense MLP"] += nbytes(v)
            elif isinstance(v, (dict, list, tuple)):
                walk(v)
            elif key == "embed" and "lm_head" in tree:
                continue                  # untied: a lookup of `concurrency` rows (tied: it is the LM head)
            else:
                out["other"] += nbytes(v)
    walk(model.params)
    out["KDA"] += fb["states"]
    out["MLA"] += fb["cache"]
    return out


def serve(args):
    import jax
    from k3jax.api import load_model
    from k3jax.offline import LLM, SamplingParams
    if args.layers:
        args.model = truncated_preset(args.model, args.layers)
    bw = copy_bandwidth()[0]      # JAX x + 1: what XLA's loops reach
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    t0 = time.perf_counter()
    model = load_model(args.model, dtype="bfloat16", seed=0)
    jax.block_until_ready(model.params)
    t_load = time.perf_counter() - t0
    print(f"load {t_load:.1f}s", flush=True)
    c = model.config
    llm = LLM(model, max_num_seqs=args.concurrency, max_num_batched_tokens=args.budget,
              max_model_len=args.input + args.output + 16, page_size=64, prefix_match_unit=64,
              enable_prefix_caching=False, token_buckets=(args.concurrency, args.budget), seq_buckets=(args.concurrency,))
    llm.engine.wait_for_compiles()            # warm-up includes the background compile (comparable figures)
    t_warm = time.perf_counter() - t0 - t_load
    print(f"warm-up {t_warm:.1f}s", flush=True)
    eng = llm.engine
    rng = np.random.RandomState(0)
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    for i in range(args.concurrency):
        eng.add_request(rng.randint(0, c.vocab_size, args.input).tolist(), params, request_id=f"b{i}")
    steps, first_tok, start = [], {}, time.perf_counter()
    while eng.has_unfinished():
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        all_decoding = len(first_tok) == args.concurrency
        for o in outs:
            first_tok.setdefault(o.request_id, time.perf_counter() - start)
        steps.append((dt, len(outs), all_decoding))
        if len(steps) % 16 == 0:
            print(f"  step {len(steps)}: {dt * 1e3:.2f} ms ({len(outs)} outputs)", flush=True)
    total = time.perf_counter() - start
    decode = [dt for dt, n, dec in steps if dec and n == args.concurrency]
    gen = args.concurrency * args.output
    fb = floor_bytes(c, args.concurrency, args.input + args.output // 2)
    floor_s = sum(v for k, v in fb.items() if k != "touched") / bw
    med = statistics.median(decode) if decode else float("nan")
    print("\n" + header(f"bench_e2e serve: {args.model} (random bf16)",
                        setup=f"load {t_load:.1f}s, warm-up {t_warm:.1f}s, copy bandwidth {bw / 1e12:.2f} TB/s"))
    table = Table(("concurrency", "concurrency"), ("input", "in"), ("output", "out"),
                  ("output_tok_s", "output tok/s", ".1f"), ("mean_ttft_s", "mean TTFT s", ".2f"),
                  ("decode_step_ms", "median decode step ms", ".2f"), ("floor_ms", "floor ms", ".2f"),
                  ("step_over_floor", "step/floor", ".2f"), ("experts_touched", "experts touched/layer", ".0f"))
    print(table.header())
    print(table.add(concurrency=args.concurrency, input=args.input, output=args.output, output_tok_s=gen / total,
                    mean_ttft_s=statistics.mean(first_tok.values()), decode_step_ms=med * 1e3,
                    floor_ms=floor_s * 1e3, step_over_floor=med / floor_s, experts_touched=fb["touched"]))
    if args.csv:
        table.write_csv(args.csv)
    print(f"decode-only output tok/s: {args.concurrency / med:.1f}")


def prefill_flops_per_token(model) -> float:
    """2 x the active matmul parameters of one prompt token: the embedding is a lookup and the LM head
    runs for one token per sequence, so neither counts (attention's own FLOPs are left out too)."""
    from k3jax.info import model_info
    c = model.config
    vd = c.vocab_size * c.hidden_size
    return 2 * (model_info(c)["active_params"] - vd * (2 if "lm_head" in model.params else 1))


def _drive(eng, prompts, params):
    """Run prompts to completion. Returns (seconds, {request: time to first token}, [(step s, outputs)])."""
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"r{time.monotonic_ns()}-{i}")
    first, steps, start = {}, [], time.perf_counter()
    while eng.has_unfinished():
        t = time.perf_counter()
        outs = eng.step()
        steps.append((time.perf_counter() - t, len(outs)))
        for o in outs:
            first.setdefault(o.request_id, time.perf_counter() - start)
    return time.perf_counter() - start, first, steps


def full(args):
    import jax
    from k3jax.api import load_model
    from k3jax.offline import LLM, SamplingParams
    name = args.model
    if args.layers:
        name = truncated_preset(args.model, args.layers)
    bw = copy_bandwidth()[0]      # JAX x + 1: what XLA's loops reach
    rate = matmul_peak()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    t0 = time.perf_counter()
    model = load_model(name, dtype="bfloat16", seed=0)
    jax.block_until_ready(model.params)
    t_load = time.perf_counter() - t0
    print(f"load {t_load:.1f}s", flush=True)
    c = model.config
    t0 = time.perf_counter()
    sized = {"page_size": args.page_size} if args.page_size else {}
    llm = LLM(model, max_num_seqs=64, max_num_batched_tokens=4096,
              max_model_len=(args.max_model_len or None) if args.max_model_len is not None else 2048 + 64,
              enable_prefix_caching=False, token_buckets=(16, 64, 4096), seq_buckets=(16, 64),
              decode_steps_per_launch=args.decode_steps_per_launch, **sized)
    eng = llm.engine
    eng.wait_for_compiles()                   # ready includes the background compile (comparable figures)
    t_warm = time.perf_counter() - t0
    pools = eng.runner.pools
    print(f"engine ready in {t_warm:.1f}s (cache: {pools.num_pages} pages of {eng.args.page_size} tokens, "
          f"{pools.num_slots} slots; max_model_len {eng.max_model_len})", flush=True)
    rng = np.random.RandomState(0)
    rand = lambda n, L: [rng.randint(0, c.vocab_size, L).tolist() for _ in range(n)]   # noqa: E731
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    table = Table(("workload", "workload"), ("prompt_tok_s", "prompt tok/s", ",.0f"),
                  ("of_roofline", "of roofline", ".2f"), ("output_tok_s", "output tok/s", ",.1f"),
                  ("mean_ttft_s", "mean TTFT s", ".2f"), ("decode_step_ms", "decode step ms", ".2f"),
                  ("floor_ms", "floor ms", ".2f"), ("step_over_floor", "step/floor", ".2f"))
    roof = rate / prefill_flops_per_token(model)
    print(table.header(), flush=True)
    for n, L in ((64, 2048), (256, 64)):
        secs, _, _ = _drive(eng, rand(n, L), one)
        tps = n * L / secs
        print(table.add(workload=f"prefill {n} x {L}", prompt_tok_s=tps, of_roofline=tps / roof), flush=True)
    runs = [(16, 1024, True), (64, 256, True)] + [(16, 1024, False)] * args.compare_sync
    for conc, out, overlap in runs:
        eng.args.async_scheduling = overlap
        secs, first, steps = _drive(eng, rand(conc, 1024), SamplingParams(temperature=0, max_tokens=out,
                                                                          ignore_eos=True))
        decode = [dt for dt, k in steps if k == conc][conc:] or [float("nan")]
        med = statistics.median(decode)
        fb = floor_bytes(c, conc, 1024 + out // 2)
        floor_s = sum(v for k, v in fb.items() if k != "touched") / bw
        print(table.add(workload=f"c{conc}, 1024 in / {out} out{'' if overlap else ', synchronous steps'}",
                        output_tok_s=conc * out / secs, mean_ttft_s=statistics.mean(first.values()),
                        decode_step_ms=med * 1e3, floor_ms=floor_s * 1e3, step_over_floor=med / floor_s), flush=True)
    print("\n" + header(f"bench_e2e full: {name} (random bf16), default memory settings",
                        setup=f"load {t_load:.0f}s, engine ready (pool sizing + warm-up) {t_warm:.0f}s",
                        anchors=f"copy {bw / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s, "
                                f"prefill roofline {roof:,.0f} tok/s"))
    print(table.markdown())
    if args.csv:
        table.write_csv(args.csv)


def truncated_preset(model: str, layers: int) -> str:
    """A preset cut to its first `layers` layers (same layer pattern), registered under a new name."""
    from k3jax.presets import preset_config_dict
    import k3jax.presets as presets
    d = preset_config_dict(model)
    t = d.get("text_config", d)
    t["num_hidden_layers"] = layers
    lac = t["linear_attn_config"]
    lac["full_attn_layers"] = [i for i in lac["full_attn_layers"] if i <= layers]
    lac["kda_layers"] = [i for i in lac["kda_layers"] if i <= layers]
    name = f"{model}-{layers}l"
    presets._PRESETS[name] = lambda d=d: d
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default="full", choices=["full", "check", "serve"])
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (same pattern)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input", type=int, default=1024)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--compare-sync", action="store_true",
                    help="full: also run c16 with synchronous steps (async scheduling off)")
    ap.add_argument("--decode-steps-per-launch", type=int, default=None,
                    help="full: EngineArgs.decode_steps_per_launch (default: the engine's)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="full: EngineArgs.max_model_len (default 2112, the rows' longest; 0: the engine's own, the "
                         "longest sequence the cache holds, whose block tables every step carries)")
    ap.add_argument("--page-size", type=int, default=None, help="full: EngineArgs.page_size (default: the engine's; a multiple of its prefix_match_unit, 16)")
    add_csv_argument(ap)
    args = ap.parse_args()
    {"full": full, "check": check, "serve": serve}[args.what](args)


if __name__ == "__main__":
    main()
