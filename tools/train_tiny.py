#!/usr/bin/env python3
"""Train the embedded `tiny` preset on the English corpus and export its weights.

Every K3 feature of the preset is trained (KDA, MLA, Attention Residuals, latent MoE with SiTU,
shared expert) through the jnp reference ops (differentiable; the Pallas kernels are not), with
bf16 routed experts; the export quantizes them to MXFP4 as the preset keeps them.

  data:   data/tiny_corpus (tools/build_tiny_corpus.py), tokenized with k3jax/assets/tiny-en.tiktoken,
          cut into [T+1] windows by a grain pipeline: shuffled every epoch, sharded by process,
          its iterator state checkpointed with the weights.
  optim:  optax AdamW (fp32 master weights, bf16 compute), clipped, warmup then cosine decay over
          a wall-clock budget (--train-seconds; the step count follows from the machine's speed).
  ckpt:   orbax CheckpointManager under --ckpt-dir (params, optimizer state, grain iterator state);
          a rerun with the same --ckpt-dir resumes from the latest step.
  export: --export FILE (one safetensors file, MXFP4 experts; FILE-bf16-experts.safetensors beside it
          holds the unquantized experts for the quantization check) and held-out perplexity of the
          exported weights (MXFP4 experts) and, time permitting, of the bf16 experts, printed and
          in FILE.json with the loss history.

    python -m tools.train_tiny --export $OUT/tiny-trained.safetensors        # one H200, < 5 min
    python -m tools.train_tiny --smoke                                       # CPU, a few steps
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from k3jax.checkpoint.flat_file import quantize_experts, save_flat
from k3jax.config import ModelConfig
from k3jax.eval import perplexity
from k3jax.model import K3Model
from k3jax.params import FP32_KINDS, init_params_numpy, is_leaf, param_spec
from k3jax.presets import preset_config_dict
from k3jax.text_data import text_files, token_stream, train_windows
from k3jax.tokenizer import KimiTokenizer
from pallas_kernels.backend import detect

REFERENCE = detect("reference")   # the jnp ops: differentiable (the Pallas kernels are not)


EXPORT_SECONDS = 50.0   # quantize, evaluate, write: kept out of the training budget


def training_config(smoke: bool = False) -> tuple[ModelConfig, ModelConfig]:
    """(config trained: bf16 experts, config exported: the preset's MXFP4 experts)."""
    d = preset_config_dict("tiny")
    export = ModelConfig.from_dict(d)
    d["text_config"].pop("quantization_config")
    train = ModelConfig.from_dict(d)
    if smoke:   # same features, two layers: a CPU compile in seconds
        small = {"num_layers": 2, "layer_types": ("kda", "mla"), "mlp_types": ("dense", "moe")}
        train, export = (dataclasses.replace(c, **small) for c in (train, export))
    return train, export


def compute_cast(c: ModelConfig, dtype):
    """params (fp32 masters) -> the compute copy: `dtype` except the spec's fp32 kinds."""
    kinds = jax.tree.leaves(jax.tree.map(lambda l: l.kind, param_spec(c), is_leaf=is_leaf))
    def cast(params):
        leaves, tdef = jax.tree.flatten(params)
        return tdef.unflatten([x if k in FP32_KINDS else x.astype(dtype) for x, k in zip(leaves, kinds)])
    return cast


def decay_mask(params):
    """Weight decay on matrices only (not norms, gates' biases, A_log, router bias)."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(peak_lr: float, weight_decay: float):
    opt = optax.inject_hyperparams(optax.adamw)(learning_rate=peak_lr, b1=0.9, b2=0.95, eps=1e-8,
                                                weight_decay=weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(1.0), opt)


def lr_at(progress: float, step: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine from peak to floor*peak as progress (the
    fraction of the time budget spent) goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(max(progress, 0.0), 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def make_train_step(c: ModelConfig, optimizer, dtype):
    cast = compute_cast(c, dtype)

    def loss_fn(params, batch):
        logits = K3Model(c, cast(params))(batch[:, :-1], backend=REFERENCE)   # differentiable jnp ops
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch[:, 1:]).mean()

    def step(params, opt_state, batch, lr):
        opt_state[1].hyperparams["learning_rate"] = lr
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads)

    return jax.jit(step, donate_argnums=(0, 1))


def bf16_experts_path(export: Path) -> Path:
    return export.with_name(export.name.replace(".safetensors", "") + "-bf16-experts.safetensors")


def experts_only(params):
    """The routed experts' subtree (layers without experts keep an empty dict: same flat names)."""
    return {"layers": [{"mlp": {"experts": lp["mlp"]["experts"]}} if "experts" in lp["mlp"] else {}
                       for lp in params["layers"]]}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=ROOT / "data" / "tiny_corpus")
    ap.add_argument("--export", type=Path, default=None, help="write the weights here (safetensors)")
    ap.add_argument("--ckpt-dir", type=Path, default=None, help="orbax checkpoints (resumes from the latest)")
    ap.add_argument("--ckpt-every", type=int, default=500)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--train-seconds", type=float, default=170.0, help="wall-clock budget of the step loop")
    ap.add_argument("--wall-limit", type=float, default=280.0,
                    help="the whole run's limit: training stops early enough to export and evaluate")
    ap.add_argument("--max-steps", type=int, default=None, help="default: no limit (--smoke: 3)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="CPU check: 2 layers, tiny batches, 3 steps")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seq_len, args.batch_size, args.warmup, args.log_every, args.ckpt_every = 32, 2, 2, 1, 2
        args.max_steps = args.max_steps or 3
    args.max_steps = args.max_steps or 1 << 62
    return args


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    c, c_export = training_config(args.smoke)
    tok = KimiTokenizer.tiny_english()
    if tok.vocab_size != c.vocab_size:
        raise SystemExit(f"tokenizer vocab {tok.vocab_size} != preset vocab {c.vocab_size}")

    files = text_files(args.corpus / "train")
    if args.smoke:
        files = files[:3]
    stream = token_stream(tok, files)
    print(f"corpus: {len(files)} documents, {len(stream):,} tokens ({time.perf_counter() - t_start:.1f}s)", flush=True)
    data = train_windows(stream, args.seq_len, args.batch_size, args.seed,
                         jax.process_index(), jax.process_count())
    it = iter(data)

    params = jax.tree.map(jnp.asarray, init_params_numpy(c, args.seed, jnp.float32))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    optimizer = make_optimizer(args.lr, args.weight_decay)
    opt_state = optimizer.init(params)
    step_fn = make_train_step(c, optimizer, dtype)

    start_step = 0
    mngr = None
    if args.ckpt_dir is not None:
        import grain
        mngr = ocp.CheckpointManager(args.ckpt_dir.resolve(), options=ocp.CheckpointManagerOptions(max_to_keep=2))
        if mngr.latest_step() is not None:
            start_step = mngr.latest_step()
            restored = mngr.restore(start_step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}),
                data=grain.checkpoint.CheckpointRestore(it)))
            params, opt_state = restored["state"]["params"], restored["state"]["opt_state"]
            print(f"resumed from step {start_step}", flush=True)

    tokens_per_step = args.batch_size * args.seq_len
    print(f"model: {n_params / 1e6:.2f}M parameters, {c.num_layers} layers ({','.join(c.layer_types)}), "
          f"batch {args.batch_size}x{args.seq_len}, {args.dtype}, {jax.devices()[0].device_kind}", flush=True)
    step, loss, t_loop, t_end = start_step, float("nan"), None, None
    history = []
    while step < args.max_steps:
        batch = jnp.asarray(next(it))
        now = time.perf_counter()
        progress = 0.0 if t_loop is None else (now - t_loop) / max(t_end - t_loop, 1e-9)
        if progress >= 1.0:
            break
        lr = lr_at(progress, step, args.lr, args.warmup)
        params, opt_state, loss_d, gnorm = step_fn(params, opt_state, batch, jnp.float32(lr))
        step += 1
        if t_loop is None:   # the first step compiled: the budget starts now
            loss = float(loss_d)
            t_loop = time.perf_counter()
            t_end = min(t_loop + args.train_seconds, t_start + args.wall_limit - EXPORT_SECONDS)
            print(f"step {step}: loss {loss:.3f} (compiled in {t_loop - now:.1f}s; "
                  f"{t_end - t_loop:.0f}s of training left)", flush=True)
        if step % args.log_every == 0:
            loss = float(loss_d)
            el = time.perf_counter() - t_loop
            rate = (step - start_step - 1) * tokens_per_step / max(el, 1e-9)
            history.append({"step": step, "loss": round(loss, 4), "lr": lr, "seconds": round(el, 1)})
            print(f"step {step}: loss {loss:.3f}  grad norm {float(gnorm):.2f}  lr {lr:.2e}  "
                  f"{rate:,.0f} tok/s  {el:.0f}s", flush=True)
        if mngr is not None and step % args.ckpt_every == 0:
            import grain
            mngr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                data=grain.checkpoint.CheckpointSave(it)))
    loss = float(loss_d)
    train_s = time.perf_counter() - (t_loop or time.perf_counter())
    seen = (step - start_step) * tokens_per_step
    print(f"trained {step - start_step} steps ({seen:,} tokens, {seen / len(stream):.1f} epochs) "
          f"in {train_s:.0f}s; final loss {loss:.3f}", flush=True)
    if mngr is not None:
        import grain
        if mngr.latest_step() != step:
            mngr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                data=grain.checkpoint.CheckpointSave(it)), force=True)
        mngr.wait_until_finished()

    cast = compute_cast(c, jnp.bfloat16)
    weights_bf16 = cast(params)
    weights = quantize_experts(weights_bf16)
    report = {"steps": step, "tokens_seen": seen, "train_seconds": round(train_s, 1), "final_loss": loss,
              "parameters": n_params, "seq_len": args.seq_len, "batch_size": args.batch_size,
              "device": jax.devices()[0].device_kind, "history": history}
    if args.export is not None:   # written first: the evaluation below may not fit the budget
        args.export.parent.mkdir(parents=True, exist_ok=True)
        save_flat(args.export, weights, {"trained_steps": str(step)})
        # the unquantized experts, for the MXFP4-vs-bf16 check (MXFP4 vs bf16 perplexity); not shipped
        save_flat(bf16_experts_path(args.export), experts_only(weights_bf16), {"trained_steps": str(step)})
        print(f"wrote {args.export} ({args.export.stat().st_size / 2**20:.1f} MiB)", flush=True)
        Path(f"{args.export}.json").write_text(json.dumps(report, indent=1) + "\n")
    heldout = args.corpus / "heldout"
    if heldout.is_dir():   # reference ops (as trained): no kernel compiles inside the time budget
        kw = dict(seq_len=min(args.seq_len, 512), batch_size=8, backend=REFERENCE)
        report["heldout_ppl_mxfp4"] = perplexity(weights, c_export, tok, heldout, **kw)["perplexity"]
        print(f"held-out perplexity (MXFP4 experts): {report['heldout_ppl_mxfp4']:.3f}", flush=True)
        if time.perf_counter() - t_start < args.wall_limit - 30:
            report["heldout_ppl_bf16_experts"] = perplexity(weights_bf16, c, tok, heldout, **kw)["perplexity"]
            print(f"held-out perplexity (bf16 experts): {report['heldout_ppl_bf16_experts']:.3f}", flush=True)
    if args.export is not None:
        Path(f"{args.export}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"total {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
