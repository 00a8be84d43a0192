"""Speculative decoding at its two ends and under load (one engine, one model; prints a markdown table).

Rows:
  c1 off                 one sequence, `--context` prompt tokens, greedy decode of `--c1-tokens` tokens
  c1 off, 1 step/launch  the same with one decode step per launch (when the engine runs several by default,
                         EngineArgs.decode_steps_per_launch)
  c1 K=4 all accepted    the same with an oracle drafter proposing the target's own greedy continuation
  c1 K=4 own continuation  an oracle proposing the speculative engine's own greedy continuation: where
                         verification rounds differently from decode (bf16 on a GPU: verification's rows
                         run other step programs than decode's), the off run's tokens get rejected, so the
                         oracle is re-run on the tokens the last run produced until a run accepts them all
                         (each run agrees on at least one more token: causal rows, deterministic steps;
                         at most --fixed-point-runs runs). Its row is speculation's speed when every draft
                         is accepted, whatever the rounding
  c1 K=4 forced acceptance  the all-accepted oracle with verification's verdict overridden: every draft is
                         accepted and the token after them is the verification step's own greedy one. The
                         step programs and the work per token are speculation's; the row is its speed when
                         every draft is accepted, however verification rounds
  c1 K=4 all rejected    a drafter proposing wrong tokens, adaptive speculation on
  c16 off / c16 ngram    16 sequences of 1024 prompt + 1024 output tokens, n-gram drafter on vs off

Random weights make real acceptance meaningless, so the two c1 drafters bound what real acceptance can give.
"off" runs the same engine with its speculator removed (no verification variant is used).

  python -m benchmarks.bench_spec --model kimi-linear-48b-a3b --seed 0
  python -m benchmarks.bench_spec --model tiny-random --dtype float32 --context 256 --c1-tokens 32 \
      --cN 4 --cN-prompt 64 --cN-tokens 32      # a CPU smoke run
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime
import os
import platform
import pstats
import shlex
import subprocess
import sys
import time

import numpy as np

from benchmarks.harness import CompileCount, log

COMPILES = None


class Oracle:
    """Proposes the target's greedy continuation (known from the off run): everything is accepted."""

    def __init__(self, ref: dict, wrong: bool = False, vocab: int = 0):
        self.ref, self.wrong, self.vocab = ref, wrong, vocab

    def propose(self, reqs, ks):
        out = []
        for r, k in zip(reqs, ks):
            d = self.ref.get(r.request_id, [])[len(r.output_ids):len(r.output_ids) + k]
            out.append([(t + 1) % self.vocab for t in d] if self.wrong else list(d))
        return out


def forced_tokens(logits, drafts, num_drafts):
    """Verification's outputs when every draft is accepted: (tokens [N, W]: the drafts, then the greedy token
    after the last of them; accepted [N] = num_drafts). logits [N, W, V] or, as a verification step returns them,
    [N * W, V]; drafts [N, K]; num_drafts [N]."""
    import jax.numpy as jnp
    n = num_drafts.shape[0]
    greedy = jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32).reshape(n, -1)
    nd = num_drafts.astype(jnp.int32)
    bonus = jnp.take_along_axis(greedy, nd[:, None], axis=1)
    drafted = jnp.pad(drafts.astype(jnp.int32), ((0, 0), (0, 1)))
    return jnp.where(jnp.arange(greedy.shape[1])[None] < nd[:, None], drafted, bonus), nd


def force_acceptance(runner):
    """Make the runner's verification programs accept every draft (forced_tokens after each; the greedy sampler's
    only). Returns a function that undoes it. The verification step and its sampler still run as they are."""
    import jax
    fix = jax.jit(forced_tokens)
    saved = runner._compiled, runner._verify

    def wrap(verify):
        def call(logits, sarr, key_data, counters, drafts, num_drafts):
            _, _, logprobs, tops = verify(logits, sarr, key_data, counters, drafts, num_drafts)
            return (*fix(logits, drafts, num_drafts), logprobs, tops)
        return call
    runner._compiled = {k: wrap(v) if k[0] == "verify" else v for k, v in runner._compiled.items()}
    runner._verify = wrap(runner._verify)

    def undo():
        runner._compiled, runner._verify = saved
    return undo


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _run(engine, prompts, max_tokens, what=""):
    from serving.sampling_params import SamplingParams
    log(f"{what}: {len(prompts)} x {len(prompts[0])} prompt tokens, {max_tokens} output tokens")
    COMPILES.start()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"r{i}")
    before = dict(engine.counters, **(engine.spec.stats if engine.spec is not None else {}))
    t0 = time.perf_counter()
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    wall = time.perf_counter() - t0
    after = dict(engine.counters, **(engine.spec.stats if engine.spec is not None else {}))
    launches = {k: after[k] - before.get(k, 0) for k in ("steps", "multi_step_launches", "spec_steps") if k in after}
    log(f"{what}: {wall:.2f} s ({COMPILES}); launches {launches}")
    outs = {k: o.outputs[0].token_ids for k, o in done.items()}
    decode = [(len(outs[k]) - 1) / (o.metrics["last_token"] - o.metrics["first_token"])
              for k, o in done.items() if len(outs[k]) > 1 and o.metrics["last_token"] > o.metrics["first_token"]]
    return outs, sum(len(v) for v in outs.values()) / wall, float(np.mean(decode)) if decode else 0.0


def _agreed(a: list, b: list) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def own_continuation_row(args, eargs, model, engine, c1, first, base, row):
    """The oracle re-run on the speculative engine's own output until it proposes only accepted tokens."""
    from serving.spec import make_speculator
    tokens = first
    for run in range(1, args.fixed_point_runs + 1):
        engine.spec = make_speculator(eargs, model, engine.max_model_len)
        engine.spec.drafter = Oracle({"r0": tokens["r0"]})
        out, tput, dec = _run(engine, c1, args.c1_tokens, f"own continuation, run {run}")
        m = engine.spec.metrics()
        agreed = _agreed(out["r0"], tokens["r0"])
        log(f"run {run}: {agreed} of {len(out['r0'])} tokens as proposed, acceptance {m['spec_acceptance_rate']:.2f}")
        if out == tokens or run == args.fixed_point_runs:
            break
        tokens = out
    row(f"c1 K={args.k} own continuation", tput, dec,
        f"({dec / base:.2f}x of off; acceptance {m['spec_acceptance_rate']:.2f}; run {run}: "
        f"{'every token as proposed' if out == tokens else f'{agreed} tokens as proposed'})")


def forced_row(args, eargs, model, engine, c1, ref, base, row, first_use=None):
    """The all-accepted oracle with every draft accepted whatever verification computes (force_acceptance).
    first_use: (prompts, tokens) of the untimed run before it (default: a short one, which compiles
    forced_tokens)."""
    from serving.spec import make_speculator
    prompts, tokens = first_use or ([c1[0][:64]], 2 * (args.k + 1))
    undo = force_acceptance(engine.runner)
    try:
        for what, p, n in (("forced acceptance, first use", prompts, tokens),
                           ("forced acceptance", c1, args.c1_tokens)):
            engine.spec = make_speculator(eargs, model, engine.max_model_len)
            engine.spec.drafter = Oracle(ref)
            out, tput, dec = _run(engine, p, n, what)
        m = engine.spec.metrics()
    finally:
        undo()
    agreed = _agreed(out["r0"], ref["r0"])
    row(f"c1 K={args.k} forced acceptance", tput, dec,
        f"({dec / base:.2f}x of off; acceptance {m['spec_acceptance_rate']:.2f}; "
        f"{'same tokens' if out == ref else f'first {agreed} tokens as off'})")


def timeline_rows(args, eargs, model, engine, c1, ref):
    """Where a c1 step's time goes, speculation off (one decode step a launch, and the engine's default) and
    with forced acceptance (benchmarks/step_timeline.py)."""
    import jax
    from benchmarks import step_timeline
    from serving.spec import make_speculator
    n = min(args.c1_tokens, 96)
    print("\n## where a c1 step's time goes (host parts timed around the engine's calls; GPU from a trace)")
    runs = [("off, 1 step/launch", None, 1), ("off", None, engine.decode_steps), ("forced acceptance", True, 1)]
    for name, forced, steps in runs:
        saved = engine.decode_steps
        engine.decode_steps = steps
        undo = force_acceptance(engine.runner) if forced else None
        engine.spec = None
        if forced:
            engine.spec = make_speculator(eargs, model, engine.max_model_len)
            engine.spec.drafter = Oracle({"t0": ref["r0"]})
        trace = (os.path.join(args.timeline, name.replace(" ", "_").replace(",", "").replace("/", "_"))
                 if args.timeline else None)
        prof = cProfile.Profile() if args.host_profile else None
        try:
            if prof:
                prof.enable()
            walls, parts, traced, tokens = step_timeline.run_timed(engine, c1, n, trace_dir=trace)
            if prof:
                prof.disable()
            programs, gpu, top = step_timeline.device_programs(trace, traced) if traced else ({}, (0.0, 0.0), {})
        finally:
            engine.decode_steps = saved
            if undo:
                undo()
        print(step_timeline.report(name, walls, parts, tokens, programs, gpu, top), flush=True)
        if prof:    # the host's Python functions over the run, by own time (C++ calls show as builtins)
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.host_profile)
        if traced and jax.default_backend() != "cpu":
            from benchmarks.profile_step import summarize
            summarize(trace, os.path.join(args.timeline, "hlo"), steps=traced,
                      events_csv=os.path.join(args.timeline, os.path.basename(trace) + ".csv"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--context", type=int, default=2048, help="c1 prompt tokens")
    ap.add_argument("--c1-tokens", type=int, default=256, help="c1 output tokens")
    ap.add_argument("--cN", type=int, default=16, help="sequences of the loaded rows (0: the c1 rows only)")
    ap.add_argument("--cN-prompt", type=int, default=1024)
    ap.add_argument("--cN-tokens", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="EngineArgs.max_num_seqs (default: the engine's); 4 with --cN 0 compiles the c1 programs only")
    ap.add_argument("--fixed-point-runs", type=int, default=12,
                    help="runs of the own-continuation oracle at most (0: skip that row)")
    ap.add_argument("--decode-steps-per-launch", type=int, default=None,
                    help="EngineArgs.decode_steps_per_launch (default: the engine's)")
    ap.add_argument("--quick", action="store_true",
                    help="no warm-up: only c1 off and forced acceptance, each run once untimed first (it compiles the "
                         "programs it uses), then timed")
    ap.add_argument("--host-parts", action="store_true",
                    help="after the rows: the host's parts of a c1 step (drafting, scheduling, building the inputs, "
                         "dispatch, the wait) for off and forced acceptance, with the step's own compiler options "
                         "(command buffers on; --timeline turns them off to trace)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="with --host-parts: profile the host (cProfile) over each of those runs, print its N "
                         "functions of most own time")
    ap.add_argument("--timeline", default=None, metavar="DIR",
                    help="after the rows: where a c1 step's time goes (host parts, and a profiler trace in DIR of a "
                         "few steps: the GPU's busy time, its programs, the step's kernels by scope) for off and "
                         "forced acceptance; every row then runs without command buffers (so the trace names "
                         "each kernel)")
    args = ap.parse_args(argv)
    if args.timeline:   # the trace names each kernel's op: no command buffers, the step programs' HLO dumped
        from benchmarks.profile_step import STEP_MODULES
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.timeline}/hlo"
                                   " --xla_dump_hlo_module_re=" + "|".join(STEP_MODULES)
                                   + " --xla_gpu_enable_command_buffer=").strip()

    import jax  # noqa: F401  (first imported here, after XLA_FLAGS is final)

    global COMPILES
    COMPILES = CompileCount()
    from k3jax import load_model
    from serving.engine import LLMEngine
    from serving.engine_args import EngineArgs
    from serving.spec import make_speculator

    log(f"loading {args.model}")
    model = load_model(args.model, dtype=args.dtype, seed=args.seed)
    log("engine (warm-up)")
    sized = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    eargs = EngineArgs(max_model_len=args.max_model_len, speculative="ngram", num_speculative_tokens=args.k, **sized,
                       enable_prefix_caching=False, decode_steps_per_launch=args.decode_steps_per_launch,
                       speculative_on_gpu=True)   # measured where refused by default: its rows say if tokens match
    if args.quick:
        eargs = dataclasses.replace(eargs, warmup=False)
    engine = LLMEngine(model, eargs)
    engine.wait_for_compiles()                # every step and verification program compiled before timing
    spec = engine.spec
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    rows = []

    def row(name, tok_s, decode, note=""):
        rows.append((name, tok_s, decode, note))
        print(f"{name}: {tok_s:.1f} output tok/s, {decode:.1f} decode tok/s per sequence {note}", flush=True)

    c1 = [rng.integers(0, vocab, args.context).tolist()]
    if args.quick:
        quick_rows(args, eargs, model, engine, c1, row)
        _table(args, model, rows)
        return
    engine.spec = None
    _run(engine, [c1[0][:64]], 8, "first use")      # first-use costs out of the timed runs
    ref, tput, dec = _run(engine, c1, args.c1_tokens, "c1 off")
    row("c1 off", tput, dec, f"({engine.decode_steps} decode steps per launch)")
    base = dec
    if engine.decode_steps > 1:
        steps, engine.decode_steps = engine.decode_steps, 1
        out, tput, dec = _run(engine, c1, args.c1_tokens, "c1 off, 1 step/launch")
        row("c1 off, 1 step/launch", tput, dec, f"({dec / base:.2f}x of c1 off; "
            f"{'same tokens' if out == ref else 'TOKENS DIFFER'})")
        engine.decode_steps = steps
    for name, drafter in (("c1 K=%d all accepted" % args.k, Oracle(ref)),
                          ("c1 K=%d all rejected (adaptive)" % args.k, Oracle(ref, wrong=True, vocab=vocab))):
        engine.spec = make_speculator(eargs, model, engine.max_model_len)
        engine.spec.drafter = drafter
        out, tput, dec = _run(engine, c1, args.c1_tokens, name)
        m = engine.spec.metrics()
        same = "same tokens" if out == ref else "TOKENS DIFFER"
        row(name, tput, dec, f"({dec / base:.2f}x of off; acceptance {m['spec_acceptance_rate']:.2f}; {same})")
        if "accepted" in name and out != ref and args.fixed_point_runs:
            own_continuation_row(args, eargs, model, engine, c1, out, base, row)
        if "accepted" in name:
            forced_row(args, eargs, model, engine, c1, ref, base, row)

    if args.cN:
        cn = [rng.integers(0, vocab, args.cN_prompt).tolist() for _ in range(args.cN)]
        engine.spec = None
        ref_n, base_n, dec_n = _run(engine, cn, args.cN_tokens, "cN off")
        row(f"c{args.cN} {args.cN_prompt}/{args.cN_tokens} off", base_n, dec_n)
        engine.spec = make_speculator(eargs, model, engine.max_model_len)
        out, tput, dec = _run(engine, cn, args.cN_tokens, "cN ngram")
        m = engine.spec.metrics()
        row(f"c{args.cN} {args.cN_prompt}/{args.cN_tokens} ngram", tput, dec,
            f"({tput / base_n:.3f}x of off; drafted {m['spec_drafted_tokens']}, acceptance "
            f"{m['spec_acceptance_rate']:.2f}; {'same tokens' if out == ref_n else 'TOKENS DIFFER'})")
    if args.timeline or args.host_parts:
        timeline_rows(args, eargs, model, engine, c1, ref)
    del spec
    _table(args, model, rows)


def quick_rows(args, eargs, model, engine, c1, row):
    """c1 off and forced acceptance on an engine without warm-up: each run once untimed (its compiles), then timed."""
    engine.spec = None
    _run(engine, c1, args.c1_tokens, "c1 off, first use")
    ref, tput, base = _run(engine, c1, args.c1_tokens, "c1 off")
    row("c1 off", tput, base, f"({engine.decode_steps} decode steps per launch)")
    forced_row(args, eargs, model, engine, c1, ref, base, row, first_use=(c1, args.c1_tokens))


def _table(args, model, rows):
    import jax
    dev = jax.devices()[0]
    print()
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    print(f"machine: {getattr(dev, 'device_kind', dev.platform)} x{jax.device_count()}, {platform.node()}")
    print(f"commit: {_commit()}; model {args.model} ({model.params['embed'].dtype}), K={args.k}")
    print()
    print("| run | output tok/s | decode tok/s per sequence | notes |")
    print("|---|---|---|---|")
    for name, tput, dec, note in rows:
        print(f"| {name} | {tput:.1f} | {dec:.1f} | {note} |")


if __name__ == "__main__":
    main()
