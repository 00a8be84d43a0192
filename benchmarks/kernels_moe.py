"""bench_kernels' MoE section: the routed experts of K3 (MXFP4, 112 experts as on one of 8 expert-parallel
devices, top-16, latent MoE) and Kimi-Linear-48B (bf16, 256 experts, top-8), at the engine's largest
default step (4096 tokens: prefill) and at 64 and 16 decode tokens, timed three ways side by side:

  isolated                      ops.expert_mlp (the function RoutedExperts calls) on one layer's experts
                                and random top-k routing: sort by expert, the grouped kernels, combine;
  as model: routed experts only the MoE module's moe_experts part (RoutedExperts on the router's choice),
                                the experts a stack over scanned layers read in place (layer traced),
                                every stacked array over 2**32 bytes as in the models (64-bit kernel
                                offsets); at decode K3 adds the same call over a one-layer stack (32-bit
                                offsets: what the offsets cost) and over a stack of 2-4 GiB (the layer's
                                slice copied first: grouped.overflows_i32_offsets);
  as model: MoE layer           MoE.__call__ on [T, D]: moe_route + moe_experts + moe_shared.

All through the Backend the runner builds (detect("pallas")), random weights of the real shapes in the
merged layout load_model holds. Prefill rows are judged in TFLOP/s against the bf16 matmul peak, decode
rows in TB/s of the weights touched (the experts routed to, plus the layer's other weights) against the
copy bandwidth. Each timed output is checked once on its first REF_TOKENS tokens: the experts against
dense_reference, the layer against its own jnp path (the "reference" backend).
"""
from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import rel_err, time_jax
from k3jax.layers.common import glu_act
from k3jax.layers.module import value
from k3jax.layers.moe import MoE, RoutedExperts, expert_weights, routed_experts_reference
from k3jax.params import moe_spec, random_values
from k3jax.presets import preset_config
from pallas_kernels import ops
from pallas_kernels.backend import detect
from pallas_kernels import moe as moe_kernels
from pallas_kernels.moe.grouped import overflows_i32_offsets
from pallas_kernels.moe.schedule import Tiling

# (label, preset, experts on this device): K3 as on one of 8 expert-parallel devices, Kimi-Linear whole
CASES = [("K3 (112 local experts of 896, top-16)", "kimi-k3", 112),
         ("Kimi-Linear (256 experts, top-8)", "kimi-linear-48b-a3b", 256)]
REF_TOKENS = 256    # tokens of each output checked against the dense reference
CHECK_TOL = 3e-2    # rel err from which a row is wrong (a bf16 output's rounding: ~4e-3)
COMPILE_THREADS = 8  # XLA / Triton compiles run outside the GIL: compile the programs side by side
# scanned repeats in the experts' leading axis (the rows run the last one): at least STACK_MIN, and enough
# that every stacked array holds over 2**32 bytes, as the models' stacks do (K3: 23 repeats of 112 local
# experts). Between 2**31 and 2**32 bytes Pallas' 32-bit offsets would overflow and the kernels copy the
# layer's slice first (grouped.overflows_i32_offsets): K3's down projection stacked over 4 layers is such
# a stack (2.47 GB), which the models never hold; the STACK_WINDOW row times that case on purpose.
STACK_MIN = 4
STACK_WINDOW = 4


# MXFP4 decode tiles timed isolated at the smallest decode step beside the default
# (schedule.decode_mxfp4_tiles): (up: merged gate/up, bn = output columns, 2 bn weight rows; down). The x tile
# is re-read from L2 for every weight tile of bn rows x bk: 16 rows x bk bf16 against bn x bk/2 bytes, as
# many bytes as the weights at 64 rows; 128-row tiles halve that, 4 stages deepen the pipeline, 4 warps run
# wgmma. A faster pair goes into schedule.DECODE_MXFP4_BY_SHAPE.
_T = lambda bk, bn, w, st: Tiling(16, bk, bn, w, st, swap_ab=True)  # noqa: E731
DECODE_TILE_SWEEP = [
    (_T(256, 32, 2, 4), _T(256, 64, 2, 4)),
    (_T(128, 64, 2, 3), _T(128, 128, 2, 3)),
    (_T(128, 64, 2, 4), _T(128, 128, 2, 4)),
    (_T(128, 32, 2, 4), _T(128, 64, 2, 4)),
    (_T(256, 64, 4, 3), _T(256, 128, 4, 3)),
]


def tiles_label(t) -> str:
    return f"bk{t.bk} bn{t.bn} w{t.num_warps} s{t.num_stages}"


def stack_depth(spec_experts, tiny: bool) -> int:
    """Layers to stack the experts over: STACK_MIN, or (full sizes) the fewest from STACK_MIN on with no
    stacked array between 2**31 and 2**32 one-byte elements, which the kernels would copy a slice of
    (grouped.overflows_i32_offsets): the models' stacks (bigger ones over 2**32 bytes, 64-bit offsets)."""
    if tiny:
        return STACK_MIN
    leaves = jax.tree_util.tree_leaves(jax.eval_shape(lambda: random_values(spec_experts, jax.random.key(0))))
    depth = STACK_MIN
    while any(overflows_i32_offsets((depth * a.shape[0],) + a.shape[1:], a.dtype) for a in leaves):
        depth += 1
    return depth


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


def compile_all(jobs):
    """[(fn, args)] -> [(compiled or None, exception or None)], ahead of time on a thread pool; every
    array is an argument (a closed-over weight would be captured as a constant of the program: GBs, and
    minutes of compile)."""
    with ThreadPoolExecutor(COMPILE_THREADS) as pool:
        futs = [pool.submit(lambda fn, args: jax.jit(fn).lower(*args).compile(), fn, args) for fn, args in jobs]
    return [(None, f.exception()) if f.exception() else (f.result(), None) for f in futs]


def steps(tiny):
    """(kind, tokens) in priority order."""
    return [("prefill", 64), ("decode", 8), ("decode", 2)] if tiny else \
        [("prefill", 4096), ("decode", 64), ("decode", 16)]


class MoEModel:
    """One model's MoE layer: config, random values (experts stacked over `depth` layers: stack_depth) and
    its jitted calls (every weight an argument, never a program constant). extra_stacks: (variant, experts
    stack, layer) for the decode rows of the routed experts over other stacks of the same layer (MXFP4)."""

    def __init__(self, label, preset, num_experts, tiny, backend):
        self.label = label.split(" (")[0]     # the model; the case names the experts
        self.c = c = case_config(preset, num_experts, tiny)
        self.spec = spec = moe_spec(c, merged_experts=True)
        key = jax.random.key(0)
        self.values = random_values({k: v for k, v in spec.items() if k != "experts"}, key)
        self.depth = depth = stack_depth(spec["experts"], tiny)
        # one layer's random experts (isolated rows), repeated over the stack: the kernels read one layer of it,
        # and making every layer at once would need ~4 bytes of random bits a packed byte (K3: ~35 GB)
        self.experts = random_values(spec["experts"], jax.random.fold_in(key, 1))
        self.values["experts"] = jax.jit(lambda t: jax.tree_util.tree_map(
            lambda a: jnp.broadcast_to(a, (depth,) + a.shape), t))(self.experts)
        self.layer = jnp.int32(depth - 1)
        self.extra_stacks = []
        if c.expert_format == "mxfp4":
            self.extra_stacks.append(("routed experts, a one-layer stack (32-bit offsets)",
                                      jax.tree_util.tree_map(lambda a: a[None], self.experts), jnp.int32(0)))
            window = jax.tree_util.tree_map(lambda a: a[depth - STACK_WINDOW:], self.values["experts"])
            if any(overflows_i32_offsets((a.shape[0] * a.shape[1],) + a.shape[2:], a.dtype)
                   for a in jax.tree_util.tree_leaves(window)):
                self.extra_stacks.append((f"routed experts, stacked over {STACK_WINDOW} layers (arrays of 2-4 GiB: "
                                          f"the layer's slice copied)", window, jnp.int32(STACK_WINDOW - 1)))
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
            m = MoE.of(c, v, merged_experts=True)
            w, ids = m.route(x, c)
            return (x @ value(m.latent_down) if m.latent else x), w, ids

        def isolated_tiles(pe, z, w, ids, tiles):
            q = lambda n: (pe[f"{n}_packed"], pe[f"{n}_scale"])  # noqa: E731
            return moe_kernels.expert_mlp_mxfp4(
                z, ids, w, q("w13"), None, q("w2"), activation=c.hidden_act, situ_beta=c.situ_beta,
                situ_linear_beta=c.situ_linear_beta, interpret=backend.interpret or None, tiling=tiles,
                num_experts_total=c.num_experts, decoder=backend.mxfp4_decoder)

        self.isolated = jax.jit(isolated)
        self.isolated_tiles = jax.jit(isolated_tiles, static_argnames="tiles")
        self.routed_inputs = jax.jit(routed_inputs)
        self.routed = jax.jit(lambda pe, z, w, ids, layer: RoutedExperts.of(c, pe, merged=True)(
            z, w, ids, c, layer, backend))
        self.moe = jax.jit(lambda v, x, layer: MoE.of(c, v, merged_experts=True)(x, c, layer, backend))
        self.moe_reference = jax.jit(lambda v, x, layer: MoE.of(c, v, merged_experts=True)(x, c, layer, reference))
        self.dense_reference = jax.jit(lambda pe, z, w, ids: dense_reference(pe, z, w, ids, c))

    def routed_flop(self, tokens):
        c = self.c
        return 6.0 * tokens * c.num_experts_per_token * c.expert_hidden * c.moe_intermediate_size

    def case(self, tokens):
        c = self.c
        return (f"{self.label} T={tokens}: {c.num_experts} {c.expert_format} experts, top-{c.num_experts_per_token} "
                f"({tokens * c.num_experts_per_token} rows)")


def _touched(ids):
    return int(np.unique(np.asarray(ids)).size)


def _signature(fn, args):
    return fn, tuple((a.shape, a.dtype) for a in jax.tree_util.tree_leaves(args))


class Job:
    """One row: fn(*args) timed, its first REF_TOKENS rows checked against ref(*ref_args)."""

    def __init__(self, kind, case, call, variant, fn, args, ref, ref_args, flop, nbytes, isolated=None):
        self.kind, self.case, self.call, self.variant = kind, case, call, variant
        self.fn, self.args, self.ref, self.ref_args = fn, args, ref, ref_args
        self.flop, self.nbytes, self.isolated = flop, nbytes, isolated    # isolated: that row's Job


def case_jobs(m, kind, tokens, sweep_tiles=False):
    """The rows of one model at one step (isolated, as model: routed experts over each stack, MoE layer),
    inputs made. sweep_tiles: MXFP4 experts also get DECODE_TILE_SWEEP's isolated rows."""
    c, case = m.c, m.case(tokens)
    key = jax.random.fold_in(jax.random.key(1), tokens)
    # isolated: random top-k routing, inputs already in the experts' width
    z = jax.random.normal(jax.random.fold_in(key, 0), (tokens, c.expert_hidden), jnp.bfloat16)
    w, ids = jax.lax.top_k(jax.random.uniform(jax.random.fold_in(key, 1), (tokens, c.num_experts)),
                           c.num_experts_per_token)
    iso = Job(kind, case, "isolated", "ops.expert_mlp, random top-k", m.isolated, (m.experts, z, w, ids),
              m.dense_reference, (m.experts, z, w, ids), m.routed_flop(tokens), _touched(ids) * m.expert_bytes)
    z_iso, w_iso, ids_iso = z, w, ids
    # as the model calls it: the layer's own router on hidden states
    x = jax.random.normal(jax.random.fold_in(key, 2), (tokens, c.hidden_size), jnp.bfloat16)
    z, w, ids = m.routed_inputs(m.values, x)
    touched = _touched(ids) * m.expert_bytes
    call = f"as model: {m.label}"
    routed = Job(kind, case, call, "routed experts only (moe_experts)", m.routed,
                 (m.values["experts"], z, w, ids, m.layer), m.dense_reference, (m.experts, z, w, ids),
                 m.routed_flop(tokens), touched, iso)
    layer = Job(kind, case, call, "MoE layer (route + experts + shared)", m.moe, (m.values, x, m.layer),
                m.moe_reference, (m.values, x[:REF_TOKENS], m.layer),
                m.routed_flop(tokens) + tokens * m.other_flop_per_token, touched + m.other_bytes, iso)
    extra = [Job(kind, case, call, variant, m.routed, (stack, z, w, ids, r), m.dense_reference, (m.experts, z, w, ids),
                 m.routed_flop(tokens), touched, iso)
             for variant, stack, r in (m.extra_stacks if kind == "decode" else ())]
    sweep = []
    if sweep_tiles and c.expert_format == "mxfp4":
        for up, down in DECODE_TILE_SWEEP:
            fn = functools.partial(m.isolated_tiles, tiles=(up, down))
            sweep.append(Job(kind, case, "isolated", f"tiles up {tiles_label(up)} / down {tiles_label(down)}", fn,
                             (m.experts, z_iso, w_iso, ids_iso), m.dense_reference, (m.experts, z_iso, w_iso, ids_iso),
                             m.routed_flop(tokens), iso.nbytes, iso))
    return [iso, *sweep, routed, *extra, layer]


def run_job(run, job, exe, ref_exe):
    """Check, time and add one row; returns seconds or None (budget, failure)."""
    kernel = f"MoE {job.kind}"

    def go():
        err = rel_err(exe(*job.args)[:REF_TOKENS], ref_exe(*job.ref_args))
        return time_jax(exe, *job.args, reps=run.reps), err
    res = run.timed(kernel, job.case, job.call, job.variant, go)
    if res is None:
        return None
    t, err = res
    t_iso = None if job.isolated is None else job.isolated.seconds
    roof = job.flop / t / run.peak if job.kind == "prefill" else job.nbytes / t / run.copy_bw
    run.add(kernel=kernel, case=job.case, call=job.call, variant=job.variant, us=t * 1e6,
            tb_s=job.nbytes / t / 1e12, tflop_s=job.flop / t / 1e12, roof=roof,
            anchor=None if t_iso is None else f"isolated {t_iso * 1e6:.0f} us",
            vs_anchor=None if t_iso is None else t_iso / t,
            target=f"rel err {err:.1e}" + ("" if err <= CHECK_TOL else " WRONG"))
    return t


def moe_section(run):
    if run.over():     # its programs compile up front: past the budget, none starts
        run.skip("MoE", "every case", "isolated and as model", "default", "budget")
        return
    models = []
    for label, preset, num_experts in CASES:
        models.append(MoEModel(label, preset, num_experts, run.tiny, run.backend))
        c = models[-1].c
        print(f"# MoE {label}, as run: {c.expert_format} experts {c.num_experts} x (D' {c.expert_hidden}, I "
              f"{c.moe_intermediate_size}), top-{c.num_experts_per_token}, {c.hidden_act}, hidden {c.hidden_size}, "
              f"shared {c.num_shared_experts}, experts stacked over {models[-1].depth} layers", flush=True)
    # the tile sweep at the smallest decode step only (each tiling is two more programs to compile)
    sweep_step = min((s for s in steps(run.tiny) if s[0] == "decode"), key=lambda s: s[1], default=None)
    jobs = [j for kind, tokens in steps(run.tiny) for m in models
            for j in case_jobs(m, kind, tokens, sweep_tiles=(kind, tokens) == sweep_step)]
    # every program compiled side by side first (XLA and Triton compile outside the GIL), then each row
    # checked and timed with nothing else running
    programs = {}      # one compile per (function, argument shapes): the two expert rows share a reference
    for fn, args in [(j.fn, j.args) for j in jobs] + [(j.ref, j.ref_args) for j in jobs]:
        programs.setdefault(_signature(fn, args), (fn, args))
    done = dict(zip(programs, compile_all(list(programs.values()))))
    print(f"# MoE: {len(done)} programs compiled, {sum(e is not None for _, e in done.values())} failed", flush=True)
    for j in jobs:
        (exe, e), (ref_exe, ref_e) = done[_signature(j.fn, j.args)], done[_signature(j.ref, j.ref_args)]
        j.seconds = None
        if e is not None or ref_e is not None:
            e = e if e is not None else ref_e
            run.skip(f"MoE {j.kind}", j.case, j.call, j.variant,
                     f"compile: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        j.seconds = run_job(run, j, exe, ref_exe)
