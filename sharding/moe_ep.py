"""Expert-parallel MoE: routed experts under shard_map with all-to-all over the `expert` axis.

Same semantics as `k3jax.layers.moe.moe` / `routed_experts`; only where the work runs differs:
  tokens are split over (data, expert); each device routes its own tokens, sends every token
  copy to the device owning its expert (all-to-all over `expert`), runs its E/expert local
  experts as grouped matmuls (`ops.gmm`, intermediate width split over `tensor`), sends the
  results back (second all-to-all), and combines the k copies per token in fp32 in ascending
  expert order (the reference's order), then sums the tensor partials (psum over `tensor`).

Capacity: by default dropless with a static worst-case buffer: each device reserves, for every
destination, room for all of its T_local * k copies (exact, but the receive buffer and the
grouped matmul see expert * T_local * k rows). `capacity_factor=f` shrinks the per-destination
buffer to ceil(f * T_local * k / expert) rows; copies beyond it are DROPPED (contribute zero),
which changes results when routing is unbalanced. Tests use the dropless default.

`expert_parallel(backend, mesh)` is the backend (pallas_kernels/backend.py) whose model steps run their
routed experts this way; the model never imports this module.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.config import ModelConfig
from k3jax.expert_layout import split_experts
from k3jax.layers.common import glu_act, upcast
from k3jax.layers.moe import MoE, expert_weights
from pallas_kernels import ops
from pallas_kernels.backend import Backend, resolve
from sharding.mesh import axis_sizes

TOKENS = ("data", "expert")      # token axis of the shard_map: attention DP = data x expert


def shard_map(f, mesh, in_specs, out_specs):
    """jax.shard_map (jax >= 0.6) or jax.experimental.shard_map on older versions."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map as legacy
    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def expert_parallel(backend: Backend | None, mesh, *, capacity_factor: float | None = None) -> Backend:
    """`backend` (None: detected) with its routed experts run expert-parallel on `mesh`."""
    def routed(pe, z, weights, ids, c, b):
        return routed_experts_ep(pe, z, weights, ids, c, mesh, capacity_factor=capacity_factor, backend=b)
    return resolve(backend).replace(routed_experts=routed)


def _expert_specs(pe, mesh, c):
    """The partition rules' specs for the expert leaves (so shard_map never reshards weights)."""
    from sharding.rules import expert_specs
    specs = expert_specs(c, mesh)
    return {k: specs[k] for k in pe}


def _dispatch_plan(ids, E: int, n: int, cap: int):
    """Where each token copy goes. ids [Tl, k] (E = padding) -> order, dest, pos (pos == cap: dropped)."""
    flat = ids.reshape(-1)
    el = E // n
    order = jnp.argsort(flat, stable=True)           # grouped by destination, then by expert
    fs = flat[order]
    valid = fs < E
    dest = jnp.where(valid, fs // el, 0)
    counts = jnp.zeros((n,), jnp.int32).at[dest].add(valid.astype(jnp.int32))
    starts = jnp.cumsum(counts) - counts
    pos = jnp.arange(fs.shape[0], dtype=jnp.int32) - starts[dest]
    pos = jnp.where(valid & (pos < cap), pos, cap)
    return order, fs, dest, pos


def _local_experts(pe_local, rx, re, el: int, c: ModelConfig, backend: Backend | None):
    """Grouped expert MLP on received rows rx [M, D'] with local expert ids re [M] (el = empty row)."""
    w1, w3, w2 = expert_weights(pe_local, rx.dtype, c.expert_format == "mxfp4")
    order = jnp.argsort(re, stable=True)
    gs = jnp.zeros((el,), jnp.int32).at[re].add(1, mode="drop")
    xs = rx[order]
    h = glu_act(ops.gmm(xs, w1, gs, backend=backend), ops.gmm(xs, w3, gs, backend=backend), c)
    y = ops.gmm(h, w2, gs, backend=backend)            # rows past sum(gs) are zero
    return jnp.zeros_like(y).at[order].set(y)


def routed_experts_ep(pe, z, weights, ids, c: ModelConfig, mesh, *, capacity_factor: float | None = None,
                      backend: Backend | None = None):
    """Expert-parallel `routed_experts`: z [T, D'], weights [T, k] fp32, ids [T, k] -> [T, D'] (z.dtype).

    mesh: a Mesh with axes data/expert/tensor; num_experts must be divisible by the expert axis.
    Experts in the merged gate/up layout (k3jax.expert_layout, a single-device load) are split back
    first: the partition rules and the tensor split of the intermediate width are the checkpoint's.
    """
    pe = split_experts(pe)
    sizes = axis_sizes(mesh)
    n, E = sizes["expert"], c.num_experts
    if E % n:
        raise ValueError(f"expert parallelism: {E} experts are not divisible by the expert axis ({n})")
    dp = sizes["data"] * n
    T, k = ids.shape
    Tp = -(-T // dp) * dp
    if Tp != T:     # pad the token axis so it splits evenly; padded copies are never sent
        z = jnp.pad(z, ((0, Tp - T), (0, 0)))
        weights = jnp.pad(weights, ((0, Tp - T), (0, 0)))
        ids = jnp.pad(ids, ((0, Tp - T), (0, 0)), constant_values=E)
    tl = Tp // dp
    rows = tl * k
    cap = rows if capacity_factor is None else max(1, min(rows, math.ceil(capacity_factor * rows / n)))
    el = E // n
    wspecs = _expert_specs(pe, mesh, c)
    split_i = any("tensor" in (s if isinstance(s, tuple) else (s,)) for spec in jax.tree_util.tree_leaves(
        wspecs, is_leaf=lambda x: isinstance(x, P)) for s in spec if s is not None)

    def local(z, w, ids, pe_local):
        d = z.shape[-1]
        order, fs, dest, pos = _dispatch_plan(ids, E, n, cap)
        tok = order // k
        send_x = jnp.zeros((n, cap + 1, d), z.dtype).at[dest, pos].set(z[tok])[:, :cap]
        send_e = jnp.full((n, cap + 1), el, jnp.int32).at[dest, pos].set(
            jnp.where(fs < E, fs % el, el))[:, :cap]
        rx = jax.lax.all_to_all(send_x.reshape(n * cap, d), "expert", 0, 0, tiled=True)
        re = jax.lax.all_to_all(send_e.reshape(n * cap), "expert", 0, 0, tiled=True)
        y = _local_experts(pe_local, rx, re, el, c, backend)
        back = jax.lax.all_to_all(y, "expert", 0, 0, tiled=True).reshape(n, cap, d)
        got = jnp.pad(back, ((0, 0), (0, 1), (0, 0)))[dest, pos]          # dropped copies read zeros
        res = jnp.zeros((rows, d), got.dtype).at[order].set(got).reshape(tl, k, d)
        # Sum the k copies in ascending expert order, like the reference's sorted scatter-add.
        kord = jnp.argsort(ids, axis=-1)
        yk = upcast(jnp.take_along_axis(res, kord[..., None], axis=1)) * jnp.take_along_axis(w, kord, axis=1)[..., None]
        out = jnp.zeros((tl, d), yk.dtype)
        for j in range(k):
            out = out + yk[:, j]
        if split_i:
            out = jax.lax.psum(out, "tensor")
        return out.astype(z.dtype)

    tok_spec = P(TOKENS, None)
    fn = shard_map(local, mesh, in_specs=(tok_spec, tok_spec, tok_spec, wspecs), out_specs=tok_spec)
    return fn(z, weights, ids, pe)[:T]


def moe_ep(p, x, c: ModelConfig, mesh, *, capacity_factor: float | None = None, backend: Backend | None = None):
    """The MoE layer (k3jax.layers.moe.MoE over p) with expert-parallel routed experts. x [..., D] -> [..., D]."""
    return MoE.of(c, p)(x, c, backend=expert_parallel(backend, mesh, capacity_factor=capacity_factor))
