"""Bit-identity check of the tiny models' outputs: a fixture of what the code computes now, and a
comparison of the code against such a fixture (for refactors that must not change a single bit).

    python tools/check_outputs.py --write tests/fixtures/outputs_tiny.npz   # record
    python tools/check_outputs.py --check tests/fixtures/outputs_tiny*.npz  # exactly, one per machine kind

For the `tiny` (trained) and `tiny-random` presets, on CPU, in float32 and in the preset's default
dtype (bfloat16), it records:
  full/*:  the no-cache forward's logits (`Model.logits`) of fixed prompts: a slice of the last
           positions' rows and float64 checksums (sum, sum of |x|) of the whole array;
  step/*:  the engine's path (k3jax.LLM, greedy, a small token budget so that prompts prefill in
           chunks, then decode steps): the generated token ids and their top logprobs.
--check takes one fixture per machine kind: XLA:CPU's code (vector width, cache blocking) differs between CPU
kinds, so the same program's bits do too; the outputs must equal one of the fixtures exactly.
--check exits 1 on any difference from every fixture (the largest absolute difference per entry is printed);
--rtol compares floats within a relative tolerance instead of exactly (token ids stay exact).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

PRESETS = ("tiny", "tiny-random")
DTYPES = ("float32", "bfloat16")
LAST = 2              # logits rows kept per prompt (the last positions)
WIDTH = 256           # of their first WIDTH vocabulary entries (the checksums cover the rest)
NEW_TOKENS = 4        # decode steps


def _prompts(vocab: int, rng) -> list[list[int]]:
    # lengths straddle the chunk size below, so that prefill runs in several chunks of ragged steps
    return [rng.integers(0, vocab - 256, n).tolist() for n in (37, 12, 21)]


def compute(presets=PRESETS, dtypes=DTYPES, step: bool = True) -> dict[str, np.ndarray]:
    """{name: array} for every (preset, dtype): see the module docstring."""
    import jax
    jax.config.update("jax_platforms", "cpu")
    from k3jax import LLM, SamplingParams
    from k3jax.api import load_model

    out = {}
    for preset in presets:
        for dtype in dtypes:
            tag = f"{preset}/{dtype}"
            model = load_model(preset, dtype=dtype)
            prompts = _prompts(model.config.vocab_size, np.random.default_rng(1234))
            width = min(len(p) for p in prompts)
            toks = np.asarray([p[:width] for p in prompts], np.int32)
            logits = np.asarray(model.logits(toks), np.float32)
            out[f"full/{tag}/last"] = logits[:, -LAST:, :WIDTH]
            out[f"full/{tag}/sum"] = np.asarray([logits.astype(np.float64).sum(),
                                                 np.abs(logits.astype(np.float64)).sum()])
            if not step:
                continue
            llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=16, warmup=False, async_scheduling=False,
                      enable_prefix_caching=False, compilation_cache_dir=None)
            res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=3, ignore_eos=True))
            ids, lps = [], []
            for r in res:
                c = r.outputs[0]
                ids.append(c.token_ids)
                lps.append([[lp] + [v for _, v in sorted(top.items())] for lp, top in c.logprobs])
            out[f"step/{tag}/ids"] = np.asarray(ids, np.int64)
            out[f"step/{tag}/logprobs"] = np.asarray(lps, np.float64)
    return out


def compare(ref: dict, got: dict, rtol: float = 0.0) -> list[str]:
    """Lines describing every difference (empty: identical, or within rtol for floats)."""
    bad = []
    for k in sorted(set(ref) | set(got)):
        if k not in got or k not in ref:
            bad.append(f"{k}: only in the {'fixture' if k in ref else 'computation'}")
            continue
        a, b = np.asarray(ref[k]), np.asarray(got[k])
        if a.shape != b.shape:
            bad.append(f"{k}: shape {b.shape} != fixture's {a.shape}")
            continue
        exact = rtol == 0.0 or not np.issubdtype(a.dtype, np.floating)
        same = np.array_equal(a, b) if exact else np.allclose(b, a, rtol=rtol, atol=0.0)
        diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
        print(f"{'ok  ' if same else 'DIFF'} {k}: max |diff| {diff:.3g}")
        if not same:
            bad.append(f"{k}: max |diff| {diff:.6g}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="PATH")
    g.add_argument("--check", metavar="PATH", nargs="+", help="fixtures (one per machine kind): identical to one")
    ap.add_argument("--rtol", type=float, default=0.0, help="float tolerance for --check (default: exact)")
    ap.add_argument("--preset", action="append", choices=PRESETS, help="only this preset (repeatable; --check)")
    ap.add_argument("--dtype", action="append", choices=DTYPES, help="only this dtype (repeatable; --check)")
    a = ap.parse_args(argv)
    if a.write and (a.preset or a.dtype):
        ap.error("--write records every preset and dtype")
    presets, dtypes = tuple(a.preset or PRESETS), tuple(a.dtype or DTYPES)
    got = compute(presets, dtypes)
    if a.write:
        os.makedirs(os.path.dirname(os.path.abspath(a.write)), exist_ok=True)
        np.savez_compressed(a.write, **got)
        print(f"wrote {len(got)} arrays to {a.write}")
        return 0
    for path in a.check:
        with np.load(path) as f:
            ref = {k: f[k] for k in f.files if k.split("/")[1] in presets and k.split("/")[2] in dtypes}
        print(f"against {path}:")
        bad = compare(ref, got, a.rtol)
        if not bad:
            print(f"identical to {path}")
            return 0
        print(f"{len(bad)} differences")
    return 1


if __name__ == "__main__":
    sys.exit(main())
