"""The model's routed-experts layer on the GPU kernels vs a dense reference, at model shapes (one table).

  python scripts/check_moe_layer_gpu.py [--json PATH]     # H200: ~40 s
  python scripts/check_moe_layer_gpu.py --tiny            # CPU script check (kernels interpreted)

Per case (K3: MXFP4 experts, 112 of them as on one of 8 EP devices, top-16, SiTU; Kimi-Linear: bf16,
256 experts, top-8, SiTU here too), prefill (8192 tokens) and decode (64 tokens): `RoutedExperts`
(k3jax/layers/moe.py) through pallas_kernels.ops.expert_mlp in the merged layout load_model holds on
one device (k3jax/expert_layout.py) and, at prefill, in the checkpoint layout (w1 / w3). Reference: the
layer's formula on the first REF_TOKENS tokens with every expert applied densely (einsums, fp32
accumulation, MXFP4 dequantized exactly; XLA's ragged_dot would materialize a dense operand of
>16 GB at prefill): rel err max|out - ref| / max|ref| over those tokens, and the layer's time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax.expert_layout import merge_experts  # noqa: E402
from k3jax.layers.common import glu_act  # noqa: E402
from k3jax.layers.moe import RoutedExperts, expert_weights  # noqa: E402
from k3jax.params import experts_spec  # noqa: E402
from k3jax.presets import preset_config  # noqa: E402
from pallas_kernels import moe  # noqa: E402
from pallas_kernels.backend import detect  # noqa: E402

CASES = [("K3 (112 local experts of 896, top-16)", "kimi-k3", 112),
         ("Kimi-Linear (256 experts, top-8)", "kimi-linear-48b-a3b", 256)]
TOKENS = [("prefill", 8192), ("decode", 64)]
REF_TOKENS = 256


def dense_reference(pe, z, w, ids, c):
    """sum_j w[t, j] * expert_{ids[t, j]}(z[t]) for the first REF_TOKENS tokens, all experts dense."""
    f32 = jnp.float32
    w1, w3, w2 = expert_weights(pe, jnp.bfloat16, c.expert_format == "mxfp4")     # [E, in, out]
    zs = z[:REF_TOKENS]
    g = jnp.einsum("sd,edi->esi", zs, w1, preferred_element_type=f32)
    u = jnp.einsum("sd,edi->esi", zs, w3, preferred_element_type=f32)
    h = glu_act(g, u, c).astype(z.dtype)                     # the kernels round h to bf16 too
    y = jnp.einsum("esi,eid->esd", h, w2, preferred_element_type=f32)         # [E, s, D]
    s = jnp.arange(zs.shape[0])[:, None]
    return (y[ids[:REF_TOKENS], s] * w[:REF_TOKENS, :, None]).sum(1)


def experts(c, key):
    """Random experts in the checkpoint layout (MXFP4: quantized from normal weights)."""
    E, D, I = c.num_experts, c.expert_hidden, c.moe_intermediate_size
    w = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) / np.sqrt(shape[-1])
    if c.expert_format != "mxfp4":
        return {n: w(i, s).astype(jnp.bfloat16) for i, (n, s) in
                enumerate((("w1", (E, D, I)), ("w3", (E, D, I)), ("w2", (E, I, D))))}
    out = {}
    for i, (n, shape) in enumerate((("w1", (E, I, D)), ("w3", (E, I, D)), ("w2", (E, D, I)))):
        out[f"{n}_packed"], out[f"{n}_scale"] = moe.quantize_mxfp4(w(i, shape))
    return out


def timed(fn, *args):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def case_config(preset, num_experts, shrink, **overrides):
    """The preset with num_experts on this device (K3: one EP device's share, its tokens' top-k
    all local: the rows such a device gets under balanced routing). shrink: 8 experts, top-2, width
    128 (the latent width where the model has one), intermediate 64 (CPU interpret mode)."""
    c = dataclasses.replace(preset_config(preset), num_experts=num_experts, **overrides)
    if shrink:
        width = dict(hidden_size=256, routed_expert_hidden_size=128) if c.routed_expert_hidden_size else \
            dict(hidden_size=128)
        c = dataclasses.replace(c, num_experts=8, num_experts_per_token=2, moe_intermediate_size=64, **width)
    return c


def run_case(label, preset, num_experts, kind, tokens, kernels, shrink):
    c = case_config(preset, num_experts, shrink, hidden_act="situ")
    key = jax.random.key(0)
    pe = experts(c, key)
    z = jax.random.normal(jax.random.fold_in(key, 10), (tokens, c.expert_hidden), jnp.bfloat16)
    scores = jax.random.uniform(jax.random.fold_in(key, 11), (tokens, c.num_experts))
    w, ids = jax.lax.top_k(scores, c.num_experts_per_token)
    ref = jax.jit(lambda pe, z, w, ids: dense_reference(pe, z, w, ids, c))(pe, z, w, ids)
    rows = []
    layouts = [("merged (w13)", merge_experts(pe))]
    if kind == "prefill":  # the checkpoint layout's kernels too (the layout of the EP path)
        layouts.append(("checkpoint (w1, w3)", pe))
    for layout, values in layouts:
        spec = experts_spec(c, merged=layout.startswith("merged"))
        fn = jax.jit(lambda v, z, w, ids: RoutedExperts(spec, v, c)(z, w, ids, c, backend=kernels))
        out = fn(values, z, w, ids)[:REF_TOKENS].astype(jnp.float32)
        err = float(jnp.abs(out - ref).max() / jnp.abs(ref).max())
        rows.append(dict(case=label, kind=kind, tokens=tokens, format=c.expert_format, layout=layout, rel_err=err,
                         us=timed(fn, values, z, w, ids) * 1e6))
        print(f"| {label} | {tokens} | {c.expert_format} | {layout} | {err:.1e} | {rows[-1]['us']:.1f} |",
              flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU script check: small experts, interpret mode")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    kernels = detect("pallas")
    print(f"# routed experts layer, kernels vs reference, {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| case | tokens | experts | layout | rel err | time us |\n|---|---|---|---|---|---|")
    rows = []
    for label, preset, e in CASES:
        for kind, tokens in TOKENS:
            rows += run_case(label, preset, e, kind, tokens // 64 if a.tiny else tokens, kernels, a.tiny)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
