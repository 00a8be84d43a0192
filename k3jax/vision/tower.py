"""MoonViT vision tower + patch-merger projector as pure functions over an explicit param tree.

Layout (linear weights [in, out]; Q = qkv width, P = 3*p*p, k = kh*kw merged patches):
  patch_embed {w [P, D], b [D]}       the p x p stride-p conv as a matmul over (c, y, x)-flattened pixels
  pos_emb [H, W, D]                   learned table, resampled per image (positions.py)
  blocks[i] {norm0, norm1: {w [D], b [D]}, wqkv {w [D, 3Q], b}, wo {w [Q, D], b}, fc0 {w [D, I], b}, fc1 {w [I, D], b}}
  final_norm {w, b}
  projector: patchmerger   {pre_norm {w [D], b}, proj0 {w [kD, kD], b}, proj2 {w [kD, T], b}}
             patchmergerv2 {proj0 {w [kD, kD]}, proj2 {w [kD, T]}, post_norm {w [T]}}
Biases exist only where the config has them; RMSNorm has no bias.

q/k columns are in Moonshot's checkpoint order: per head, rope pairs interleaved (x0, y0, x1, ...)
and rotated as complex numbers (names.py permutes transformers' rotate-half layout into it).
`blocks` may also be stacked (`stack_blocks`): the layers then run under lax.scan (one compiled
layer instead of num_layers).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers.common import upcast
from k3jax.layers.module import JaxRandom, Leaf, NumpyRandom, init_value, is_leaf
from k3jax.vision.config import VisionConfig
from k3jax.vision.positions import VisionBatch, time_table


# ---- parameter spec / init ---------------------------------------------------------------------

def _lin(cfg_bias: bool, n_in: int, n_out: int) -> dict:
    d = {"w": Leaf((n_in, n_out))}
    if cfg_bias:
        d["b"] = Leaf((n_out,), "bias")
    return d


def _norm(c: VisionConfig, d: int) -> dict:
    out = {"w": Leaf((d,), "norm")}
    if c.norm == "layernorm":
        out["b"] = Leaf((d,), "bias")
    return out


def vision_param_spec(c: VisionConfig, text_hidden_size: int | None = None) -> dict:
    """Nested dict of k3jax.params.Leaf for the tower + projector."""
    T = text_hidden_size or c.text_hidden_size
    if not T:
        raise ValueError("vision_param_spec needs the text hidden size (argument or VisionConfig.text_hidden_size)")
    D, Q, I = c.hidden_size, c.qkv_dim, c.intermediate_size
    kD = D * c.merge_size

    def block():
        return {
            "norm0": _norm(c, D), "norm1": _norm(c, D),
            "wqkv": _lin(c.attn_bias, D, 3 * Q), "wo": _lin(c.attn_bias, Q, D),
            "fc0": _lin(c.mlp_bias, D, I), "fc1": _lin(c.mlp_bias, I, D),
        }
    if c.projector == "patchmerger":
        proj = {"pre_norm": {"w": Leaf((D,), "norm"), "b": Leaf((D,), "bias")},
                "proj0": _lin(True, kD, kD), "proj2": _lin(True, kD, T)}
    else:
        proj = {"proj0": _lin(False, kD, kD), "proj2": _lin(False, kD, T), "post_norm": {"w": Leaf((T,), "norm")}}
    return {
        "patch_embed": _lin(c.patch_bias, c.patch_dim, D),
        "pos_emb": Leaf((c.pos_emb_height, c.pos_emb_width, D)),
        "blocks": [block() for _ in range(c.num_layers)],
        "final_norm": _norm(c, D),
        "projector": proj,
    }


def init_vision_params(c: VisionConfig, key, text_hidden_size: int | None = None, dtype=jnp.bfloat16):
    """Random parameters (jax key; jit-friendly). Norm weights near 1, everything else random."""
    leaves, treedef = jax.tree_util.tree_flatten(vision_param_spec(c, text_hidden_size), is_leaf=is_leaf)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [init_value(l, JaxRandom(k), dtype, 0.02)
                                                  for l, k in zip(leaves, keys)])


def init_vision_params_numpy(c: VisionConfig, seed: int, text_hidden_size: int | None = None, dtype=jnp.bfloat16):
    """Host-side random parameters (one numpy Generator per leaf), returned as jax arrays."""
    leaves, treedef = jax.tree_util.tree_flatten(vision_param_spec(c, text_hidden_size), is_leaf=is_leaf)
    rngs = np.random.default_rng(seed).spawn(len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(init_value(l, NumpyRandom(g), dtype, 0.02))
                                                  for l, g in zip(leaves, rngs)])


def stack_blocks(params: dict) -> dict:
    """Same tree with `blocks` stacked into [L, ...] arrays (encode_images then scans over layers)."""
    blocks = params["blocks"]
    if not isinstance(blocks, (list, tuple)):
        return params
    return {**params, "blocks": jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *blocks)}


# ---- forward -----------------------------------------------------------------------------------

def _linear(p, x):
    y = x @ p["w"].astype(x.dtype)
    return y + p["b"].astype(x.dtype) if "b" in p else y


def _norm_apply(p, x, eps):
    """LayerNorm when the norm has a bias, else RMSNorm; fp32 math, result in x's dtype."""
    xf = upcast(x)
    if eps is None:          # torch.nn.RMSNorm(eps=None): eps of the fp32-or-wider compute type, even for bf16
        eps = float(jnp.finfo(xf.dtype).eps)
    if "b" in p:
        xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    xf = xf * upcast(p["w"])
    if "b" in p:
        xf = xf + upcast(p["b"])
    return xf.astype(x.dtype)


def _gelu(x, kind: str):
    return jax.nn.gelu(x, approximate=(kind == "gelu_pytorch_tanh"))


def _rope_angles(c: VisionConfig, rope_hw):
    """[N, head_dim/2] angles: pair 2j turns with the column (x), pair 2j+1 with the row (y)."""
    hd = c.head_dim
    freqs = 1.0 / (c.rope_theta ** (np.arange(0, hd, 4)[: hd // 4].astype(np.float32) / hd))
    pos = rope_hw.astype(jnp.float32)
    ang = jnp.stack([pos[:, 1:2] * freqs, pos[:, 0:1] * freqs], axis=-1)  # [N, hd/4, (x, y)]
    return ang.reshape(pos.shape[0], hd // 2)


def _apply_rope(x, cos, sin):
    """x [N, H, hd] with interleaved pairs, rotated in fp32 (as the references do)."""
    xf = upcast(x).reshape(*x.shape[:-1], -1, 2)
    a, b = xf[..., 0], xf[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def _attention(q, k, v, seg, q_block: int):
    """Packed bidirectional attention; a query sees only keys of its own segment. Softmax in fp32.

    Queries go in blocks of `q_block` so scores stay [H, q_block, N] (memory linear in N).
    Masked scores are a large finite negative, so a row with no visible key (padding) is
    uniform instead of NaN; real rows never see other segments or padding (segment -1).
    """
    n, h, hd = q.shape
    scale = hd ** -0.5

    def block(qb, sb):
        s = jnp.einsum("qhd,khd->hqk", qb, k, preferred_element_type=jnp.float32) * scale
        s = jnp.where((sb[:, None] == seg[None, :])[None], s, -1e30)
        pr = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("hqk,khd->qhd", pr, v, preferred_element_type=jnp.float32).astype(v.dtype)

    if n <= q_block:
        return block(q, seg)
    nb = -(-n // q_block)
    pad = nb * q_block - n
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(nb, q_block, h, hd)
    sp = jnp.pad(seg, (0, pad), constant_values=-1).reshape(nb, q_block)
    out = jax.lax.map(lambda a: block(*a), (qp, sp))
    return out.reshape(nb * q_block, h, hd)[:n]


def _block(c: VisionConfig, p, x, cos, sin, seg, q_block):
    n = x.shape[0]
    H, hd, Q = c.num_heads, c.head_dim, c.qkv_dim
    y = _norm_apply(p["norm0"], x, c.norm_eps)
    qkv = _linear(p["wqkv"], y)
    q, k, v = (qkv[:, i * Q:(i + 1) * Q].reshape(n, H, hd) for i in range(3))
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    x = x + _linear(p["wo"], _attention(q, k, v, seg, q_block).reshape(n, Q))
    y = _norm_apply(p["norm1"], x, c.norm_eps)
    return x + _linear(p["fc1"], _gelu(_linear(p["fc0"], y), c.hidden_act))


def vision_tower(params, c: VisionConfig, pixel_values, vb: VisionBatch, *, q_block: int = 1024):
    """Patches [N, 3, p, p] -> final-normed patch features [N, D] (N = the batch's padded count)."""
    n = vb.segment_ids.shape[0]
    dtype = params["patch_embed"]["w"].dtype
    px = jnp.asarray(pixel_values)
    if px.shape[0] < n:                                   # unpadded pixels: pad here (static shapes)
        px = jnp.pad(px, [(0, n - px.shape[0])] + [(0, 0)] * (px.ndim - 1))
    x = _linear(params["patch_embed"], px.reshape(n, -1).astype(dtype))

    # Resampled position table as a weighted gather, one tap at a time ([N, D] live, not [N, taps, D]).
    table = upcast(params["pos_emb"]).reshape(-1, c.hidden_size)
    idx, wts = jnp.asarray(vb.pos_index), jnp.asarray(vb.pos_weight, jnp.float32)
    pos = sum(wts[:, t, None] * table[idx[:, t]] for t in range(idx.shape[1]))
    pos = pos + jnp.asarray(time_table(c.hidden_size, c.pos_emb_time))[vb.time_index]
    x = x + pos.astype(dtype)

    ang = _rope_angles(c, jnp.asarray(vb.rope_hw))
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    seg = jnp.asarray(vb.segment_ids)
    blocks = params["blocks"]
    if isinstance(blocks, (list, tuple)):
        for p in blocks:
            x = _block(c, p, x, cos, sin, seg, q_block)
    else:
        x, _ = jax.lax.scan(lambda h, p: (_block(c, p, h, cos, sin, seg, q_block), None), x, blocks)
    return _norm_apply(params["final_norm"], x, c.norm_eps)


def merge_patches(c: VisionConfig, x, vb: VisionBatch):
    """[N, D] -> [N // k, k, D]: kh x kw neighbours side by side, frames averaged (fp32 sums)."""
    k = c.merge_size
    rows = (vb.segment_ids.shape[0] // k) * k
    acc = jnp.zeros((rows, x.shape[-1]), upcast(x).dtype)
    acc = acc.at[jnp.asarray(vb.merge_dest)].add(
        upcast(x) * jnp.asarray(vb.merge_weight, upcast(x).dtype)[:, None], mode="drop")
    return acc.reshape(rows // k, k, -1).astype(x.dtype)


def project(params, c: VisionConfig, merged):
    """Merged patches [M, k, D] -> text embeddings [M, T]."""
    p = params["projector"]
    m = merged.shape[0]
    if c.projector == "patchmerger":
        merged = _norm_apply(p["pre_norm"], merged, c.projector_eps)
    h = _gelu(_linear(p["proj0"], merged.reshape(m, -1)), c.projector_act)
    h = _linear(p["proj2"], h)
    if c.projector == "patchmergerv2":
        h = _norm_apply(p["post_norm"], h, c.projector_eps)
    return h


def encode_images(params, c: VisionConfig, pixel_values, vb: VisionBatch, *, q_block: int = 1024):
    """Tower + final norm + kh x kw merge + projector: [N_pad // k, text_hidden].

    Jittable with `c` (and q_block) static; rows [0, vb.num_tokens) are the images' tokens in
    order (image i at vb.token_offsets[i]); the remaining rows come from padding and are garbage.
    """
    x = vision_tower(params, c, pixel_values, vb, q_block=q_block)
    return project(params, c, merge_patches(c, x, vb))

