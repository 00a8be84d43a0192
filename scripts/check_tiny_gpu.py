#!/usr/bin/env python3
"""The trained tiny model as an end-to-end check of the kernels (one table, --json for a file).

1. Greedy decoding through the engine in bf16, kernels `auto` vs `reference`: the share of positions
   where the two token sequences agree (position by position; after a divergence the rest usually
   differ too), over --prompts prompts x --max-tokens tokens (EOS ignored, so every row is full);
   and the argmax agreement over the decode positions whose context was still the same in both runs
   (up to each row's first divergence). Then teacher-forced: the full forward's argmax, kernels auto
   vs reference, at every position of held-out windows.
2. Held-out perplexity (k3jax.eval) with MXFP4 experts (as shipped) and with the unquantized bf16
   experts (--bf16-experts, written by scripts/train_tiny.py beside its export), with the kernels,
   and MXFP4 with the reference ops.

    python scripts/check_tiny_gpu.py --bf16-experts tiny-trained-bf16-experts.safetensors --json out.json
    python scripts/check_tiny_gpu.py --prompts 2 --max-tokens 8 --seq-len 32      # CPU smoke run
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from k3jax import api  # noqa: E402
from k3jax.eval import perplexity  # noqa: E402
from k3jax.text_data import piece_offsets, read_piece, text_files  # noqa: E402
from pallas_kernels.backend import detect  # noqa: E402


def prompts_from(tok, data, count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `count` paragraphs (>= 80 characters) under `data`."""
    out = []
    for f in text_files(data):
        a, b = piece_offsets(f)[0]
        for para in read_piece(f, a, b).split("\n\n"):
            ids = tok.encode(para.strip())
            if len(para) >= 80 and len(ids) >= length:
                out.append(ids[:length])
                if len(out) == count:
                    return out
    if not out:
        raise SystemExit(f"no paragraph of {length} tokens under {data}")
    return out


def backend_for(model, mode: str):
    """The model's backend (its MXFP4 decoder) with kernels as `mode` asks."""
    return detect(mode).replace(mxfp4_decoder=model.backend.mxfp4_decoder)


def greedy(model, prompts, max_tokens: int, mode: str):
    from k3jax.offline import LLM, SamplingParams
    model.backend = backend_for(model, mode)       # the engine's runner closes over the model's backend
    llm = LLM(model, max_num_seqs=len(prompts), max_num_batched_tokens=512,
              max_model_len=max(256, len(prompts[0]) + max_tokens), warmup=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - t0, outs[0].outputs[0].text


def teacher_forced(model, data, seq_len: int, max_batches: int) -> dict:
    """Argmax of the full forward (bf16) with kernels auto vs reference at every position of the
    first held-out windows: both read the same tokens, so every position is a like-for-like check."""
    from functools import partial
    from k3jax.model import forward_full
    from k3jax.text_data import eval_batches
    fns = {}
    for mode in ("reference", "auto"):
        fns[mode] = jax.jit(partial(forward_full, c=model.config, backend=backend_for(model, mode))).lower(
            model.params, tokens=jax.ShapeDtypeStruct((8, seq_len), np.int32)).compile()
    equal = total = 0
    for b, batch in enumerate(eval_batches(model.tokenizer, data, seq_len, 8)):
        if b == max_batches or len(batch["length"]) < 8:
            break
        toks = batch["tokens"][:, :-1]
        am = {m: np.asarray(f(model.params, tokens=toks)).argmax(-1) for m, f in fns.items()}
        valid = np.arange(seq_len)[None, :] + 1 < batch["length"][:, None]
        equal += int(((am["auto"] == am["reference"]) & valid).sum())
        total += int(valid.sum())
    return {"positions": total, "agree": equal / max(total, 1)}


def with_bf16_experts(model, path):
    """The model with its routed experts replaced by the unquantized ones (bf16) from `path`."""
    from safetensors.flax import load_file
    from k3jax.layer_stack import stack_layers
    flat = load_file(path)
    per_layer = model.checkpoint_params()
    layers = []
    for i, lp in enumerate(per_layer["layers"]):
        if "experts" in lp["mlp"]:
            lp = {**lp, "mlp": {**lp["mlp"], "experts": {n: flat[f"layers.{i}.mlp.experts.{n}"]
                                                         for n in ("w1", "w3", "w2")}}}
        layers.append(lp)
    config = dataclasses.replace(model.config, expert_format="bf16")
    params = stack_layers({**per_layer, "layers": layers}, config)
    return api.Model(config, params, model.tokenizer, name="tiny-bf16-experts", backend=model.backend)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default=None, help="the trained weights (default: the shipped ones)")
    ap.add_argument("--bf16-experts", default=None, help="unquantized experts from train_tiny.py")
    ap.add_argument("--data", default=str(ROOT / "data" / "tiny_corpus" / "heldout"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=512, help="perplexity window")
    ap.add_argument("--tf-batches", type=int, default=4, help="held-out batches (8 windows) teacher-forced")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.weights:
        api.TINY_WEIGHTS = args.weights
    if not os.path.exists(api.TINY_WEIGHTS):
        print(f"warning: {api.TINY_WEIGHTS} is missing: the numbers below are of random weights", file=sys.stderr)
    model = api.load_model("tiny", dtype="bfloat16")
    dev = jax.devices()[0].device_kind
    prompts = prompts_from(model.tokenizer, args.data, args.prompts, args.prompt_tokens)

    res = {"device": dev, "prompts": len(prompts), "max_tokens": args.max_tokens}
    ref, t_ref, text_ref = greedy(model, prompts, args.max_tokens, "reference")
    ker, t_ker, text_ker = greedy(model, prompts, args.max_tokens, "auto")
    eq = [np.asarray(a) == np.asarray(b) for a, b in zip(ref, ker)]
    first = [int(np.argmin(e)) if not e.all() else len(e) for e in eq]
    res.update(greedy_positions=int(sum(e.size for e in eq)), greedy_agree=float(np.mean(np.concatenate(eq))),
               greedy_identical_rows=sum(bool(e.all()) for e in eq), first_divergence=first,
               greedy_seconds={"reference": round(t_ref, 2), "auto": round(t_ker, 2)},
               sample_reference=text_ref[:300], sample_auto=text_ker[:300])

    print(f"trained tiny on {dev}: greedy, kernels auto vs reference (bf16, engine), "
          f"{len(prompts)} prompts x {args.max_tokens} tokens")
    print(f"| positions | equal | identical rows | first divergence (median) | s reference | s auto |")
    print(f"|---|---|---|---|---|---|")
    print(f"| {res['greedy_positions']} | {100 * res['greedy_agree']:.1f}% | {res['greedy_identical_rows']}/{len(prompts)} "
          f"| {int(np.median(first))} | {t_ref:.1f} | {t_ker:.1f} |")
    # Up to and including its first divergence a row had the same tokens in both runs: those decode
    # positions are like-for-like (teacher-forced) comparisons; the rest are not.
    same_ctx = sum(min(f + 1, args.max_tokens) for f in first)
    res["engine_same_context"] = {"positions": same_ctx,
                                  "agree": 1 - sum(f < args.max_tokens for f in first) / same_ctx}
    print(f"engine decode positions with the same context in both runs: {same_ctx}, argmax equal at "
          f"{100 * res['engine_same_context']['agree']:.2f}%")
    print(f"\nsample (auto): {text_ker[:200]!r}", flush=True)
    save(res, args.json)
    res["teacher_forced"] = teacher_forced(model, args.data, args.seq_len, args.tf_batches)
    print(f"teacher-forced full forward (bf16), kernels auto vs reference: argmax equal at "
          f"{100 * res['teacher_forced']['agree']:.2f}% of {res['teacher_forced']['positions']} positions", flush=True)
    save(res, args.json)

    kw = dict(seq_len=args.seq_len, batch_size=8)
    ppl = {}
    for name, m, mode in [("mxfp4/auto", model, "auto"), ("mxfp4/reference", model, "reference")] + (
            [("bf16/auto", with_bf16_experts(model, args.bf16_experts), "auto")] if args.bf16_experts else []):
        ppl[name] = perplexity(m.params, m.config, m.tokenizer, args.data, backend=backend_for(model, mode),
                               **kw)["perplexity"]
        print(f"perplexity {name}: {ppl[name]:.3f}", flush=True)
    res["perplexity"] = ppl
    if "bf16/auto" in ppl:
        res["mxfp4_vs_bf16"] = ppl["mxfp4/auto"] / ppl["bf16/auto"] - 1

    print(f"\nheld-out perplexity ({args.data}, windows of {args.seq_len})")
    print("| experts / ops | perplexity |\n|---|---|")
    for k, v in ppl.items():
        print(f"| {k} | {v:.3f} |")
    if "mxfp4_vs_bf16" in res:
        print(f"\nMXFP4 vs bf16 experts (kernels): {100 * res['mxfp4_vs_bf16']:+.2f}%")
    save(res, args.json)
    return 0


def save(res: dict, path) -> None:
    if path:
        Path(path).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
