"""Long-context benchmark: one table (prints markdown; --json writes the rows and the run's header).

  python -m benchmarks.bench_long_context                       # full Kimi-Linear-48B, random bf16, one device
  python -m benchmarks.bench_long_context --rows prefill,kernel  # a subset (prefill, kernel, decode, streams)
  python -m benchmarks.bench_long_context --tiny                 # tiny-random on CPU, scaled-down rows, seconds

Rows (the engine with every default except max_model_len, one prompt at a time, max_tokens 1):
  prefill N       TTFT and prompt tok/s of an N-token prompt (2k, 8k, 32k, 128k, 1M); of roofline = the
                  time at the matmul rate measured in this run for the active matmul FLOPs of N tokens plus
                  the MLA layers' causal attention FLOPs, over the measured time; the engine steps it took and
                  the step shapes it compiled;
                  the 1M prompt then decodes;
  mla kernel      the MLA layer's attention as the model calls it (MLA.step, one layer, the last chunk of a
                  128k prompt alone in the engine, long_prefill_tokens (or max_num_batched_tokens when that
                  is off) tokens, over its paged context): TFLOP/s with causal
                  FLOPs (query-key pairs x heads x 2 x (qk 192 + v 128)) over the whole layer step and over the
                  attention op alone (ops.mla_prefix_attention);
  decode          the median engine step of one sequence decoding at 128k context vs at 2k (ratio);
  streams         16 streams decoding while a 128k prompt prefills: the largest gap between two tokens of a
                  stream vs the streams' median gap (ratio), over the prefill.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from benchmarks.harness import commit

FULL = dict(model="kimi-linear-48b-a3b", dtype="bfloat16", prefill=(2048, 8192, 32768, 131072, 1048576 - 256),
            long=131072, short=2048, streams=16, stream_prompt=1024, decode_steps=64, max_model_len=None)
TINY = dict(model="tiny-random", dtype="float32", prefill=(256, 512, 1024), long=1024, short=256, streams=4,
            stream_prompt=64, decode_steps=8, max_model_len=4096, mla_prefill="expanded",
            engine=dict(max_num_seqs=8, max_num_batched_tokens=256, warmup=False, compilation_cache_dir=None,
                        interactive_prefill_pairs=1 << 16))


class Table:
    """Rows of named cells printed as a fixed-width header line per row and a markdown table at the end."""

    def __init__(self, *columns):
        self.columns = columns            # (key, title, format)
        self.rows = []

    def add(self, **cells) -> str:
        self.rows.append(cells)
        return " | ".join(self._cell(c, cells.get(c[0])) for c in self.columns)

    @staticmethod
    def _cell(col, v):
        if v is None:
            return ""
        return format(v, col[2]) if col[2] and isinstance(v, (int, float)) else str(v)

    def markdown(self) -> str:
        head = "| " + " | ".join(c[1] for c in self.columns) + " |"
        rule = "|" + "|".join("---" for _ in self.columns) + "|"
        body = ["| " + " | ".join(self._cell(c, r.get(c[0])) for c in self.columns) + " |" for r in self.rows]
        return "\n".join([head, rule] + body)


def matmul_rate(n: int) -> float:
    """FLOP/s of one n^3 matmul in the run's dtype (the roofline's rate, measured in the same run)."""
    import jax
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        f(a).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(ts)


def matmul_flops_per_token(model) -> float:
    """2 x the active matmul parameters of a prompt token (no embedding lookup, no LM head, no attention)."""
    from k3jax.info import model_info
    c = model.config
    vd = c.vocab_size * c.hidden_size
    return 2 * (model_info(c)["active_params"] - vd * (2 if "lm_head" in model.params else 1))


def mla_pair_flops(c) -> float:
    """FLOPs of one (query, key) pair over all MLA layers in the expanded form: heads x 2 x (qk + v)."""
    return len(c.mla_layers) * c.mla_num_heads * 2 * (c.qk_head_dim + c.v_head_dim)


def causal_pairs(n: int, ctx: int = 0) -> int:
    """(query, visible key) pairs of n queries after ctx cached keys."""
    return n * ctx + n * (n + 1) // 2


def _drive(eng, params_for, prompts, on_step=None):
    """Add prompts, step until done. Returns {request id: first-token seconds}, total seconds."""
    first, start = {}, time.perf_counter()
    ids = [eng.add_request(p, params_for(i), request_id=f"r{time.monotonic_ns()}-{i}") for i, p in enumerate(prompts)]
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter() - start
        for o in outs:
            first.setdefault(o.request_id, now)
        if on_step:
            on_step(outs, now)
    return {r: first.get(r) for r in ids}, time.perf_counter() - start


def prefill_rows(eng, model, cfg, table, rate, log):
    from serving.sampling_params import SamplingParams
    c = model.config
    rng = np.random.RandomState(0)
    per_tok = matmul_flops_per_token(model)
    # compiles, untimed: a prompt that also fills a lone long step (when the rows reach one) and then, as the rows'
    # prompts do, a few tokens to its end checkpoint and the last token
    warm = max(cfg["prefill"][0], min(max(cfg["prefill"]), eng.args.long_prefill_tokens + eng.args.prefix_match_unit + 1,
                                      eng.max_model_len - 4))
    _drive(eng, lambda i: SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
           [rng.randint(0, c.vocab_size, warm).tolist()])
    for n in cfg["prefill"]:
        if n >= eng.max_model_len:
            log(f"prefill {n}: over max_model_len {eng.max_model_len}, skipped")
            continue
        then = 4 if n > 2 * cfg["long"] else 1     # the 1M row decodes a few tokens after its prefill
        prompt = rng.randint(0, c.vocab_size, n).tolist()
        sp = SamplingParams(temperature=0.0, max_tokens=then, ignore_eos=True)
        steps, compiles = eng.counters["steps"], eng.runner.num_compiles
        first, total = _drive(eng, lambda i: sp, [prompt])
        steps, compiles = eng.counters["steps"] - steps, eng.runner.num_compiles - compiles
        ttft = next(iter(first.values()))
        roof = (n * per_tok + causal_pairs(n) * mla_pair_flops(c)) / rate
        log(table.add(row=f"prefill {n:,}", ttft_s=ttft, tok_s=n / ttft, of_roofline=roof / ttft,
                      note=f"{steps} steps, {compiles} new compiled shapes" + (f"; then decoded {then - 1} tokens in {total - ttft:.2f}s"
                                                if then > 1 else "")))


def mla_layer_params(c, dtype, seed=0):
    """Random parameters of one MLA layer of config c (shapes from the model's own parameter tree)."""
    import jax
    import jax.numpy as jnp
    from k3jax.params import param_shapes
    shapes = param_shapes(c, dtype)["layers"][c.mla_layers[0]]["attn"]
    rng = np.random.default_rng(seed)

    def leaf(s):
        if len(s.shape) == 1:      # norm weights
            return jnp.asarray(1 + 0.1 * rng.standard_normal(s.shape), s.dtype)
        return jnp.asarray(rng.standard_normal(s.shape, np.float32) * s.shape[-2] ** -0.5, s.dtype)
    return jax.tree_util.tree_map(leaf, shapes)


def kernel_rows(model, cfg, eng_args, table, log):
    """One MLA layer's step on the last chunk of a `long`-token prompt, as the engine calls it."""
    import jax
    import jax.numpy as jnp
    from k3jax.cache import SeqChunk, make_step_batch
    from k3jax.layers import mla
    from k3jax.layers.module import value
    from pallas_kernels import ops
    c = model.config
    dtype = jnp.dtype(cfg["dtype"])
    backend = model.backend
    T = max(eng_args.max_num_batched_tokens, eng_args.long_prefill_tokens)     # a lone prompt's step
    ctx = cfg["long"] - T
    page_size = eng_args.page_size
    rng = np.random.default_rng(1)
    per_seq = -(-cfg["long"] // page_size)
    pages = rng.permutation(np.arange(1, per_seq + 1))
    b = make_step_batch([SeqChunk(np.zeros(T, np.int32), ctx, pages, -1, 0)], page_size, num_tokens=T, num_seqs=1,
                        max_pages=per_seq)
    kv = jnp.asarray(rng.standard_normal((per_seq + 1, page_size, c.mla_cache_dim), np.float32), dtype)
    x = jnp.asarray(rng.standard_normal((T, c.hidden_size), np.float32) * 0.1, dtype)
    meta = dict(cu_seqlens=jnp.asarray(b.cu_seqlens), slot_mapping=jnp.asarray(b.slot_mapping),
                block_tables=jnp.asarray(b.block_tables), kv_lens=jnp.asarray(b.kv_lens))
    params = mla_layer_params(c, dtype)
    module = mla.MLA.of(c, params)
    pairs = causal_pairs(T, ctx)
    flops = pairs * c.mla_num_heads * 2 * (c.qk_head_dim + c.v_head_dim)
    num_keys = mla.expanded_key_budget(T, meta["block_tables"].shape, page_size, False, backend)
    step = jax.jit(lambda p, x_, kv_, m: mla.MLA.of(c, p).step(x_, c, kv_, {**m, "decode_only": False}, backend),
                   donate_argnums=2)
    q = jnp.asarray(rng.standard_normal((T, c.mla_num_heads, c.qk_head_dim), np.float32), dtype)
    attn = jax.jit(lambda q_, kv_, m: ops.mla_prefix_attention(
        q_, kv_, m["block_tables"], m["cu_seqlens"], m["kv_lens"], value(module.kv_b_proj), nope_dim=c.qk_nope_head_dim,
        scale=mla.scale(c), block_keys=num_keys or 2 * T, backend=backend))

    def timeit(f, *a, donate=False):
        out = jax.block_until_ready(f(*a))
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            out = f(*a[:2], out[1], *a[3:]) if donate else f(*a)
            jax.block_until_ready(out)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    t_step = timeit(step, params, x, kv, meta, donate=True)
    kv = jnp.asarray(rng.standard_normal((per_seq + 1, page_size, c.mla_cache_dim), np.float32), dtype)
    t_attn = timeit(attn, q, kv, meta)
    form = f"expanded, {num_keys}-key windows" if num_keys else "absorbed"
    label = f"{T:,} tokens after {ctx:,}"
    log(table.add(row=f"mla layer step, {label}", ttft_s=None, ms=t_step * 1e3, tflops=flops / t_step / 1e12,
                  note=f"{form}; causal FLOPs {flops / 1e12:.2f} T"))
    log(table.add(row=f"mla attention op, {label}", ms=t_attn * 1e3, tflops=flops / t_attn / 1e12, note=form))


def decode_rows(eng, model, cfg, table, log):
    from serving.sampling_params import SamplingParams
    c = model.config
    rng = np.random.RandomState(2)
    med = {}
    for n in (cfg["short"], cfg["long"]):
        if n + cfg["decode_steps"] >= eng.max_model_len:
            log(f"decode at {n}: over max_model_len, skipped")
            continue
        steps = []
        sp = SamplingParams(temperature=0.0, max_tokens=cfg["decode_steps"], ignore_eos=True)
        last = [None]

        def on_step(outs, now):
            if outs and any(not o.finished or len(o.outputs[0].token_ids) > 1 for o in outs):
                if last[0] is not None:       # per token: a launch may run several decode steps
                    steps.append((now - last[0]) / max(len(o.metrics["new_token_ids"]) for o in outs))
                last[0] = now
        _drive(eng, lambda i: sp, [rng.randint(0, c.vocab_size, n).tolist()], on_step)
        med[n] = statistics.median(steps[2:] or steps)
        log(table.add(row=f"decode, 1 sequence at {n:,}", ms=med[n] * 1e3,
                      note=f"x{med[n] / med[cfg['short']]:.2f} of {cfg['short']:,}" if n != cfg["short"] and
                      cfg["short"] in med else ""))


def streams_rows(eng, model, cfg, table, log):
    from serving.sampling_params import SamplingParams
    c = model.config
    rng = np.random.RandomState(3)
    k, n_long = cfg["streams"], cfg["long"]
    if n_long + 8 >= eng.max_model_len:
        log("streams: over max_model_len, skipped")
        return
    stamps = {}
    sp = SamplingParams(temperature=0.0, max_tokens=eng.max_model_len - cfg["stream_prompt"] - 1, ignore_eos=True)
    ids = [eng.add_request(rng.randint(0, c.vocab_size, cfg["stream_prompt"]).tolist(), sp, request_id=f"s{i}")
           for i in range(k)]
    start = time.perf_counter()
    while not all(eng.requests[i].output_ids for i in ids if i in eng.requests):   # all decoding
        eng.step()
    long_id = eng.add_request(rng.randint(0, c.vocab_size, n_long).tolist(),
                              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), request_id="long")
    done = False
    while not done:
        outs = eng.step()
        now = time.perf_counter() - start
        for o in outs:
            if o.request_id == long_id and o.finished:
                done = True
            elif o.request_id in ids:
                stamps.setdefault(o.request_id, []).append(now)
    for i in ids:
        eng.abort(i)
    while eng.has_unfinished():
        eng.step()
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:])]
    if not gaps:
        log("streams: no tokens during the prefill")
        return
    worst, median = max(gaps), statistics.median(gaps)
    log(table.add(row=f"{k} streams while a {n_long:,} prompt prefills", ms=median * 1e3,
                  note=f"largest gap {worst * 1e3:.1f} ms = x{worst / median:.2f} the median gap"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny-random on CPU, scaled-down rows (seconds)")
    ap.add_argument("--rows", default="prefill,kernel,decode,streams")
    ap.add_argument("--prefill", default=None, metavar="N,N,...",
                    help="prompt lengths of the prefill rows (default: 2k, 8k, 32k, 128k, 1M; tiny: 256, 512, 1024)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the engine's (the model's window "
                    "when the cache holds it)")
    ap.add_argument("--mla-prefix-kernel", choices=("triton", "cudnn", "cudnn-split"), default=None,
                    help="GPU attention of the expanded MLA key windows (default: the backend's)")
    ap.add_argument("--state-block-size", type=int, default=None,
                    help="the prefix cache's periodic KDA checkpoints (default: the engine's; taken where a long "
                         "prompt's chunks end)")
    ap.add_argument("--long-prefill-tokens", type=int, default=None,
                    help="a lone long prompt's step tokens (default: the engine's; 0: max_num_batched_tokens)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the engine's max_num_seqs (default: its own); each one holds a KDA state slot, so a 1M "
                         "context on one H200 with bf16 weights needs fewer than the default 64")
    ap.add_argument("--state-fraction", type=float, default=None,
                    help="the cache budget's share for KDA state slots (default: the engine's; lower leaves pages for "
                         "a longer context, e.g. 0.2 for a 1M-token prompt of Kimi-Linear-48B on one H200)")
    ap.add_argument("--decode-steps-per-launch", type=int, default=None,
                    help="EngineArgs.decode_steps_per_launch (default: the engine's)")
    ap.add_argument("--page-size", type=int, default=None, help="EngineArgs.page_size (default: the engine's; a multiple of its prefix_match_unit, 16)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the engine's warm-up (the first prefill row then pays the compiles; later rows are clean)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows and the header as JSON ('-': stdout)")
    args = ap.parse_args(argv)
    import jax
    from k3jax.api import load_model
    from serving.engine import LLMEngine
    from serving.engine_args import EngineArgs
    cfg = dict(TINY if args.tiny else FULL)
    if args.prefill:
        cfg["prefill"] = tuple(int(n) for n in args.prefill.split(","))
    rows = set(args.rows.split(","))
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json == "-" else (lambda s: print(s, flush=True))
    rate = matmul_rate(1024 if args.tiny else 8192)
    t0 = time.perf_counter()
    if rows & {"prefill", "decode", "streams"}:
        model = load_model(cfg["model"], dtype=cfg["dtype"], seed=0)
    else:                             # the kernel rows need the config and the backend alone
        from types import SimpleNamespace

        from k3jax.presets import preset_config
        from pallas_kernels.backend import detect
        model = SimpleNamespace(config=preset_config(cfg["model"]), backend=detect())
    if args.mla_prefix_kernel:        # the engine's runner closes over the model's backend
        model.backend = model.backend.replace(mla_prefix_kernel=args.mla_prefix_kernel)
    if cfg.get("mla_prefill"):        # tiny: the expanded form on CPU too (its jnp path), as a GPU runs it
        model.backend = model.backend.replace(mla_prefill=cfg["mla_prefill"])
    log(f"load {time.perf_counter() - t0:.1f}s; matmul {rate / 1e9:,.0f} GFLOP/s")
    eng_args = EngineArgs(max_model_len=args.max_model_len or cfg["max_model_len"],
                          **{**cfg.get("engine", {}), **({"warmup": False} if args.no_warmup else {}),
                             **({} if args.state_block_size is None else {"state_block_size": args.state_block_size}),
                             **({} if args.decode_steps_per_launch is None
                                else {"decode_steps_per_launch": args.decode_steps_per_launch}),
                             **({} if args.long_prefill_tokens is None else
                                {"long_prefill_tokens": args.long_prefill_tokens}),
                             **({} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}),
                             **({} if args.page_size is None else {"page_size": args.page_size}),
                             **({} if args.state_fraction is None else {"state_fraction": args.state_fraction})})
    table = Table(("row", "row", ""), ("ttft_s", "TTFT s", ".2f"), ("tok_s", "prompt tok/s", ",.0f"),
                  ("of_roofline", "of FLOP roofline", ".2f"), ("ms", "ms", ".2f"), ("tflops", "TFLOP/s", ".3g"),
                  ("note", "note", ""))
    eng = None
    if rows & {"prefill", "decode", "streams"}:
        t0 = time.perf_counter()
        eng = LLMEngine(model, eng_args)
        eng.wait_for_compiles()               # every step program compiled before the timed rows
        log(f"engine ready in {time.perf_counter() - t0:.1f}s: max_model_len {eng.max_model_len}, "
            f"{eng.runner.pools.num_pages} pages, long_prefill_tokens {eng.args.long_prefill_tokens}")
    if "prefill" in rows:
        prefill_rows(eng, model, cfg, table, rate, log)
    if "kernel" in rows:
        kernel_rows(model, cfg, eng.args if eng else eng_args, table, log)
    if "decode" in rows:
        decode_rows(eng, model, cfg, table, log)
    if "streams" in rows:
        streams_rows(eng, model, cfg, table, log)
    header = dict(bench="bench_long_context", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  machine=f"{jax.devices()[0].device_kind} ({platform.node()})", commit=commit(), model=cfg["model"],
                  dtype=cfg["dtype"], command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
                  max_model_len=eng.max_model_len if eng else None, matmul_tflops=rate / 1e12,
                  mla_prefix_kernel=model.backend.mla_prefix_kernel,
                  long_prefill_tokens=eng.args.long_prefill_tokens if eng else eng_args.long_prefill_tokens)
    text = (f"\n# {header['bench']}  {header['date']}  {header['machine']}  commit {header['commit']}  "
            f"{header['model']} ({header['dtype']}, random)  max_model_len {header['max_model_len']}\n"
            f"# {header['command']}\n" + table.markdown())
    log(text)
    if args.json:
        doc = json.dumps(dict(header, rows=table.rows), indent=1, default=float)
        if args.json == "-":
            print(doc)
        else:
            with open(args.json, "w") as f:
                f.write(doc + "\n")
    return header, table.rows


if __name__ == "__main__":
    main()
