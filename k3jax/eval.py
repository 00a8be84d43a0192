"""`python -m k3jax.eval`: perplexity of a model over plain text (a file, or the *.txt under a folder).

Documents are read in pieces and cut into windows by a grain pipeline (k3jax.text_data), so memory
stays bounded; every window is one row of a fixed-shape batch (one compile), in file order, so the
result is deterministic. Each document is scored as `[EOS] + tokens`, every token once, with at
most --seq-len tokens of context.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from functools import partial

from k3jax.cli_help import DefaultsHelpFormatter, add_model_source_args
from serving.engine_args import add_advanced_args, advanced_kwargs, claim_device_memory


def _window_nll(params, tokens, length, *, config, backend=None):
    """Summed next-token NLL (fp32) and the number of targets of [B, T+1] windows of `length` tokens."""
    import jax
    import jax.numpy as jnp
    from k3jax.model import K3Model
    logits = K3Model(config, params)(tokens[:, :-1], backend=backend)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    valid = jnp.arange(tokens.shape[1] - 1)[None, :] + 1 < length[:, None]
    return jnp.sum(jnp.where(valid, nll, 0.0)), jnp.sum(valid)


_NLL_FNS: dict = {}


def nll_function(config, backend=None):
    """jit(params, tokens [B, T+1] int32, length [B] int32) -> (summed NLL, target count); one per
    (config, backend) (the config keyed by its repr: configs holding dicts are unhashable), so repeated
    runs compile once. backend: pallas_kernels.backend.Backend (None: detected)."""
    import jax
    from pallas_kernels.backend import resolve
    backend = resolve(backend)
    key = (repr(config), backend)
    if key not in _NLL_FNS:
        _NLL_FNS[key] = jax.jit(partial(_window_nll, config=config, backend=backend))
    return _NLL_FNS[key]


def perplexity(params, config, tokenizer, path, *, seq_len: int = 512, batch_size: int = 8,
               progress: bool = False, nll_fn=None, backend=None) -> dict:
    """{"perplexity", "nll_per_token", "tokens", "windows", "seconds"} over every document under `path`."""
    import numpy as np
    from k3jax.text_data import eval_batches
    nll_fn = nll_fn or nll_function(config, backend)
    total, count, windows = 0.0, 0, 0
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(desc="scoring", unit="tok", file=sys.stderr, leave=False)
    for batch in eval_batches(tokenizer, path, seq_len, batch_size):
        tokens, length = batch["tokens"], batch["length"]
        n = len(length)
        if n < batch_size:   # keep one shape: pad rows score nothing
            tokens = np.concatenate([tokens, np.zeros((batch_size - n, seq_len + 1), np.int32)])
            length = np.concatenate([length, np.zeros(batch_size - n, np.int32)])
        s, c = nll_fn(params, tokens, length)
        total += float(s)
        count += int(c)
        windows += n
        if bar is not None:
            bar.update(int(c))
    if bar is not None:
        bar.close()
    if count == 0:
        raise ValueError(f"{path}: no tokens to score")
    return {"perplexity": math.exp(total / count), "nll_per_token": total / count, "tokens": count,
            "windows": windows, "seconds": round(time.perf_counter() - t0, 3)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m k3jax.eval", description=__doc__.splitlines()[0],
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset name checkpoint directory or Hugging Face model id (ORG/NAME)")
    add_model_source_args(ap)
    ap.add_argument("--data", required=True, help="a text file, or a folder of *.txt files")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens of context per window")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per step")
    ap.add_argument("--dtype", default=None, help="bfloat16 or float32 (default: bfloat16)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    add_advanced_args(ap, engine=False)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    claim_device_memory()
    try:
        if args.seq_len < 1 or args.batch_size < 1:
            raise ValueError("--seq-len and --batch-size must be positive")
        from k3jax.text_data import text_files
        text_files(args.data)        # a missing or empty --data is one line before the model loads
        from k3jax.api import load_model
        model = load_model(args.model, dtype=args.dtype, revision=args.revision, download_dir=args.download_dir,
                           **advanced_kwargs(args))
        if model.tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer")
        res = perplexity(model.params, model.config, model.tokenizer, args.data, seq_len=args.seq_len,
                         batch_size=args.batch_size, progress=not args.json, backend=model.backend)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = {"model": args.model, "data": args.data, **res}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{args.model} on {args.data}: perplexity {res['perplexity']:.3f} "
              f"({res['tokens']} tokens, {res['windows']} windows, {res['seconds']:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
