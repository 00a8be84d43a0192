"""bench_kernels' MoE section: the routed experts of K3 (MXFP4, 112 experts as on one of 8 expert-parallel
devices, top-16, latent MoE) and Kimi-Linear-48B (bf16, 256 experts, top-8), at the engine's largest
default step (4096 tokens: prefill) and at 64 and 16 decode tokens, timed three ways side by side:

  isolated                      ops.expert_mlp (the function RoutedExperts calls) on one layer's experts
                                and random top-k routing: sort by expert, the grouped kernels, combine;
  as model: routed experts only the MoE module's moe_experts part (RoutedExperts on the router's choice),
                                the experts a stack over scanned layers read in place (layer traced);
  as model: MoE layer           MoE.__call__ on [T, D]: moe_route + moe_experts + moe_shared.

All through the Backend the runner builds (detect("pallas")), random weights of the real shapes in the
merged layout load_model holds. Prefill rows are judged in TFLOP/s against the bf16 matmul peak, decode
rows in TB/s of the weights touched (the experts routed to, plus the layer's other weights) against the
copy bandwidth. Each timed output is checked once on its first REF_TOKENS tokens: the experts against
check_moe_layer_gpu's dense reference, the layer against its own jnp path (the "reference" backend).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import bench_kda
import check_moe_layer_gpu as layer_check
from bench_moe_prefill import CHECK_TOL, rel_err
from k3jax.layers.module import value
from k3jax.layers.moe import MoE, RoutedExperts, routed_experts_reference
from k3jax.params import moe_spec, random_values
from pallas_kernels import ops
from pallas_kernels.backend import detect

STACK = 2           # scanned repeats in the experts' leading axis; the rows run the last one
REF_TOKENS = layer_check.REF_TOKENS


def steps(tiny):
    """(kind, tokens) in priority order."""
    return [("prefill", 64), ("decode", 8), ("decode", 2)] if tiny else \
        [("prefill", 4096), ("decode", 64), ("decode", 16)]


class MoEModel:
    """One model's MoE layer: config, random values (experts stacked over STACK layers) and its jitted
    calls (every weight an argument, never a program constant)."""

    def __init__(self, label, preset, num_experts, tiny, backend):
        self.label = label.split(" (")[0]     # the model; the case names the experts
        self.c = c = layer_check.case_config(preset, num_experts, tiny)
        self.spec = spec = moe_spec(c, merged_experts=True)
        key = jax.random.key(0)
        self.values = random_values({k: v for k, v in spec.items() if k != "experts"}, key)
        self.values["experts"] = random_values(spec["experts"], jax.random.fold_in(key, 1), lead=(STACK,))
        self.layer = jnp.int32(STACK - 1)
        self.experts = jax.tree_util.tree_map(lambda a: a[STACK - 1], self.values["experts"])  # isolated: one layer's
        self.expert_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(self.experts)) / c.num_experts
        others = [a for k, v in self.values.items() if k != "experts" for a in jax.tree_util.tree_leaves(v)]
        self.other_bytes = sum(a.nbytes for a in others)
        self.other_flop_per_token = sum(2 * a.shape[0] * a.shape[1] for a in others if a.ndim == 2)  # x @ w each
        mx = c.expert_format == "mxfp4"
        reference = detect("reference")

        def isolated(pe, z, w, ids):
            return ops.expert_mlp(z, ids, w, pe, mxfp4=mx, activation=c.hidden_act, situ_beta=c.situ_beta,
                                  situ_linear_beta=c.situ_linear_beta, num_experts_total=c.num_experts,
                                  backend=backend,
                                  reference=lambda: routed_experts_reference(pe, z, w, ids, c, backend))

        def routed_inputs(v, x):
            m = MoE(spec, v, c)
            w, ids = m.route(x, c)
            return (x @ value(m.latent_down) if m.latent else x), w, ids

        self.isolated = jax.jit(isolated)
        self.routed_inputs = jax.jit(routed_inputs)
        self.routed = jax.jit(lambda pe, z, w, ids, layer: RoutedExperts(spec["experts"], pe, c)(
            z, w, ids, c, layer, backend))
        self.moe = jax.jit(lambda v, x, layer: MoE(spec, v, c)(x, c, layer, backend))
        self.moe_reference = jax.jit(lambda v, x, layer: MoE(spec, v, c)(x, c, layer, reference))
        self.dense_reference = jax.jit(lambda pe, z, w, ids: layer_check.dense_reference(pe, z, w, ids, c))

    def routed_flop(self, tokens):
        c = self.c
        return 6.0 * tokens * c.num_experts_per_token * c.expert_hidden * c.moe_intermediate_size

    def case(self, tokens):
        c = self.c
        return (f"{self.label} T={tokens}: {c.num_experts} {c.expert_format} experts, top-{c.num_experts_per_token} "
                f"({tokens * c.num_experts_per_token} rows)")


def _touched(ids):
    return int(np.unique(np.asarray(ids)).size)


def _measure(run, kernel, case, call, variant, fn, args, want):
    """Time fn(*args) after checking its first REF_TOKENS rows against want() once: (seconds, rel err)."""
    def go():
        err = rel_err(fn(*args)[:REF_TOKENS], want())
        return bench_kda.time_jax(fn, *args, reps=run.reps), err
    return run.timed(kernel, case, call, variant, go)


def _row(run, kind, kernel, case, call, variant, t, err, flop, nbytes, anchor_t=None):
    tb_s, tflop_s = nbytes / t / 1e12, flop / t / 1e12
    roof = flop / t / run.peak if kind == "prefill" else nbytes / t / run.copy_bw
    verdict = f"rel err {err:.1e}" + (" WRONG" if not err <= CHECK_TOL else "")
    run.add(kernel=kernel, case=case, call=call, variant=variant, us=t * 1e6, tb_s=tb_s, tflop_s=tflop_s,
            roof=roof, anchor=None if anchor_t is None else f"isolated {anchor_t * 1e6:.0f} us",
            vs_anchor=None if anchor_t is None else anchor_t / t, target=verdict)


def moe_case(run, m, kind, tokens):
    c, kernel, case = m.c, f"MoE {kind}", m.case(tokens)
    key = jax.random.fold_in(jax.random.key(1), tokens)
    n_ref = min(tokens, REF_TOKENS)
    # isolated: random top-k routing, inputs already in the experts' width
    z = jax.random.normal(jax.random.fold_in(key, 0), (tokens, c.expert_hidden), jnp.bfloat16)
    w, ids = jax.lax.top_k(jax.random.uniform(jax.random.fold_in(key, 1), (tokens, c.num_experts)),
                           c.num_experts_per_token)
    res = _measure(run, kernel, case, "isolated", "ops.expert_mlp, random top-k", m.isolated,
                   (m.experts, z, w, ids), lambda: m.dense_reference(m.experts, z, w, ids))
    t_iso = None
    if res is not None:
        t_iso = res[0]
        _row(run, kind, kernel, case, "isolated", "ops.expert_mlp, random top-k", *res,
             m.routed_flop(tokens), _touched(ids) * m.expert_bytes)
    del z, w, ids
    # as the model calls it: the layer's own router on hidden states
    x = jax.random.normal(jax.random.fold_in(key, 2), (tokens, c.hidden_size), jnp.bfloat16)
    z, w, ids = m.routed_inputs(m.values, x)
    touched = _touched(ids) * m.expert_bytes
    call, pe = f"as model: {m.label}", m.values["experts"]
    res = _measure(run, kernel, case, call, "routed experts only (moe_experts)", m.routed,
                   (pe, z, w, ids, m.layer),
                   lambda: m.dense_reference(m.experts, z, w, ids))
    if res is not None:
        _row(run, kind, kernel, case, call, "routed experts only (moe_experts)", *res, m.routed_flop(tokens),
             touched, t_iso)
    res = _measure(run, kernel, case, call, "MoE layer (route + experts + shared)", m.moe, (m.values, x, m.layer),
                   lambda: m.moe_reference(m.values, x[:n_ref], m.layer))
    if res is not None:
        _row(run, kind, kernel, case, call, "MoE layer (route + experts + shared)", *res,
             m.routed_flop(tokens) + tokens * m.other_flop_per_token, touched + m.other_bytes, t_iso)
    del x, z, w, ids


def moe_section(run):
    models = []
    for label, preset, num_experts in layer_check.CASES:
        if run.over():
            break
        models.append(MoEModel(label, preset, num_experts, run.tiny, run.backend))
        c = models[-1].c
        print(f"# MoE {label}, as run: {c.expert_format} experts {c.num_experts} x (D' {c.expert_hidden}, I "
              f"{c.moe_intermediate_size}), top-{c.num_experts_per_token}, {c.hidden_act}, hidden {c.hidden_size}, "
              f"shared {c.num_shared_experts}, experts stacked over {STACK} layers", flush=True)
    for kind, tokens in steps(run.tiny):
        for m in models:
            moe_case(run, m, kind, tokens)
