"""MoonViT vision tower + patch-merger projector as NNX modules that declare their parameters.

Layout (linear weights [in, out]; Q = qkv width, P = 3*p*p, k = kh*kw merged patches):
  patch_embed {w [P, D], b [D]}       the p x p stride-p conv as a matmul over (c, y, x)-flattened pixels
  pos_emb [H, W, D]                   learned table, resampled per image (positions.py)
  blocks[i] {norm0, norm1: {w [D], b [D]}, wqkv {w [D, 3Q], b}, wo {w [Q, D], b}, fc0 {w [D, I], b}, fc1 {w [I, D], b}}
  final_norm {w, b}
  projector: patchmerger   {pre_norm {w [D], b}, proj0 {w [kD, kD], b}, proj2 {w [kD, T], b}}
             patchmergerv2 {proj0 {w [kD, kD]}, proj2 {w [kD, T]}, post_norm {w [T]}}
Biases exist only where the config has them; RMSNorm has no bias. Every parameter is declared
replicated (logical axes None): the tower is small next to the LLM (~0.4 B parameters for K3) and
each process encodes its own requests' images, so sharding it would only add communication.

q/k columns are in Moonshot's checkpoint order: per head, rope pairs interleaved (x0, y0, x1, ...)
and rotated as complex numbers (names.py permutes transformers' rotate-half layout into it).
`VisionTower(config, stacked=True)` holds the blocks as one VisionBlock stacked over the layers,
run under lax.scan over the layer index (one compiled layer instead of num_layers). The functions below the modules
(`encode_images`, ...) are the same over a parameter dict (the module built over it, no copies).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.layers.common import upcast
from k3jax.layers.module import JaxRandom, List, Module, NumpyRandom, init_value, is_leaf, param, read, repeat, \
    stack_modules, value
from k3jax.vision.config import VisionConfig
from k3jax.vision.positions import VisionBatch, time_table


# ---- modules -----------------------------------------------------------------------------------

def _replicated(*shape):
    return (None,) * len(shape)


class VisionLinear(Module):
    """x @ w (+ b)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        self.w = param((n_in, n_out), _replicated(n_in, n_out), dtype=dtype, rngs=rngs)
        if bias:
            self.b = param((n_out,), _replicated(n_out), "bias", dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return _linear(_dict(self), x)


class VisionNorm(Module):
    """LayerNorm (with a bias) or RMSNorm (without)."""

    def __init__(self, d: int, bias: bool, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        self.w = param((d,), _replicated(d), "norm", dtype=dtype, rngs=rngs)
        if bias:
            self.b = param((d,), _replicated(d), "bias", dtype=dtype, rngs=rngs)

    def __call__(self, x, eps):
        return _norm_apply(_dict(self), x, eps)


def _dict(m: Module) -> dict:
    """{"w": array, "b": array (if declared)} of a VisionLinear / VisionNorm (a stacked block's: the
    running layer's, k3jax.layers.module.read)."""
    return {k: read(v) for k, v in vars(m).items() if isinstance(v, nnx.Param)}


class VisionBlock(Module):
    """norm0 -> rotary packed attention -> norm1 -> MLP, both residual."""

    def __init__(self, config: VisionConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        c = self.config = config
        D, Q, I = c.hidden_size, c.qkv_dim, c.intermediate_size
        kw = dict(dtype=dtype, rngs=rngs)
        self.norm0 = VisionNorm(D, c.norm == "layernorm", **kw)
        self.norm1 = VisionNorm(D, c.norm == "layernorm", **kw)
        self.wqkv = VisionLinear(D, 3 * Q, c.attn_bias, **kw)
        self.wo = VisionLinear(Q, D, c.attn_bias, **kw)
        self.fc0 = VisionLinear(D, I, c.mlp_bias, **kw)
        self.fc1 = VisionLinear(I, D, c.mlp_bias, **kw)

    def __call__(self, x, cos, sin, seg, q_block: int):
        c = self.config
        n = x.shape[0]
        H, hd, Q = c.num_heads, c.head_dim, c.qkv_dim
        y = self.norm0(x, c.norm_eps)
        qkv = self.wqkv(y)
        q, k, v = (qkv[:, i * Q:(i + 1) * Q].reshape(n, H, hd) for i in range(3))
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        x = x + self.wo(_attention(q, k, v, seg, q_block).reshape(n, Q))
        y = self.norm1(x, c.norm_eps)
        return x + self.fc1(_gelu(self.fc0(y), c.hidden_act))


class Projector(Module):
    """Merged patches [M, k, D] -> text embeddings [M, T] (patchmerger or patchmergerv2)."""

    def __init__(self, config: VisionConfig, text_hidden_size: int, *, dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None):
        c = self.config = config
        T, kD = text_hidden_size, config.hidden_size * config.merge_size
        kw = dict(dtype=dtype, rngs=rngs)
        self.v2 = c.projector != "patchmerger"
        if not self.v2:
            self.pre_norm = VisionNorm(c.hidden_size, True, **kw)
        self.proj0 = VisionLinear(kD, kD, not self.v2, **kw)
        self.proj2 = VisionLinear(kD, T, not self.v2, **kw)
        if self.v2:
            self.post_norm = VisionNorm(T, False, **kw)

    def __call__(self, merged):
        c = self.config
        m = merged.shape[0]
        if not self.v2:
            merged = self.pre_norm(merged, c.projector_eps)
        h = self.proj2(_gelu(self.proj0(merged.reshape(m, -1)), c.projector_act))
        return self.post_norm(h, c.projector_eps) if self.v2 else h


class VisionTower(Module):
    """The tower + projector. VisionTower(config, T, rngs=nnx.Rngs(0)): random parameters; without
    rngs: abstract ones (jax.ShapeDtypeStruct) for the checkpoint loader to fill (`fill`, `.of`).
    stacked: the blocks as one VisionBlock stacked over the layers (a leading "layers" axis), run by
    one scan. T: the text model's hidden size (default config.text_hidden_size)."""

    def __init__(self, config: VisionConfig, text_hidden_size: int | None = None, *, stacked: bool = False,
                 dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        c = self.config = config
        T = text_hidden_size or c.text_hidden_size
        if not T:
            raise ValueError("the vision tower needs the text hidden size (argument or VisionConfig.text_hidden_size)")
        D = c.hidden_size
        kw = dict(dtype=dtype, rngs=rngs)
        self.patch_embed = VisionLinear(c.patch_dim, D, c.patch_bias, **kw)
        shape = (c.pos_emb_height, c.pos_emb_width, D)
        self.pos_emb = param(shape, _replicated(*shape), dtype=dtype, rngs=rngs)
        self.stacked = stacked
        if stacked:           # random parameters: one draw per layer; abstract ones: one block stacked abstractly
            n = c.num_layers if rngs is not None else 1
            self.blocks = stack_modules([VisionBlock(c, **kw) for _ in range(n)], c.num_layers)
        else:
            self.blocks = List([VisionBlock(c, **kw) for _ in range(c.num_layers)])
        self.final_norm = VisionNorm(D, c.norm == "layernorm", **kw)
        self.projector = Projector(c, T, **kw)

    def features(self, pixel_values, vb: VisionBatch, *, q_block: int = 1024):
        """Patches [N, 3, p, p] -> final-normed patch features [N, D] (N = the batch's padded count)."""
        c = self.config
        n = vb.segment_ids.shape[0]
        dtype = value(self.patch_embed.w).dtype
        px = jnp.asarray(pixel_values)
        if px.shape[0] < n:                                   # unpadded pixels: pad here (static shapes)
            px = jnp.pad(px, [(0, n - px.shape[0])] + [(0, 0)] * (px.ndim - 1))
        x = self.patch_embed(px.reshape(n, -1).astype(dtype))

        # Resampled position table as a weighted gather, one tap at a time ([N, D] live, not [N, taps, D]).
        table = upcast(value(self.pos_emb)).reshape(-1, c.hidden_size)
        idx, wts = jnp.asarray(vb.pos_index), jnp.asarray(vb.pos_weight, jnp.float32)
        pos = sum(wts[:, t, None] * table[idx[:, t]] for t in range(idx.shape[1]))
        pos = pos + jnp.asarray(time_table(c.hidden_size, c.pos_emb_time))[vb.time_index]
        x = x + pos.astype(dtype)

        ang = _rope_angles(c, jnp.asarray(vb.rope_hw))
        cos, sin = jnp.cos(ang), jnp.sin(ang)
        seg = jnp.asarray(vb.segment_ids)
        if self.stacked:              # one scan over the layer index; the block reads that layer's slices
            def body(h, i):
                with repeat(i, None):
                    return self.blocks(h, cos, sin, seg, q_block), None
            x, _ = jax.lax.scan(body, x, jnp.arange(c.num_layers, dtype=jnp.int32))
        else:
            for block in self.blocks:
                x = block(x, cos, sin, seg, q_block)
        return self.final_norm(x, c.norm_eps)

    def __call__(self, pixel_values, vb: VisionBatch, *, q_block: int = 1024):
        """Tower + final norm + kh x kw merge + projector: [N_pad // k, text_hidden]; see encode_images."""
        return self.projector(merge_patches(self.config, self.features(pixel_values, vb, q_block=q_block), vb))


def tower_of(params: dict, c: VisionConfig) -> VisionTower:
    """The VisionTower over a parameter dict (the same arrays; blocks a list, or stacked)."""
    return VisionTower.of(c, params, text_hidden_size=params["projector"]["proj2"]["w"].shape[-1],
                          stacked=not isinstance(params["blocks"], (list, tuple)))


# ---- parameter spec / init ---------------------------------------------------------------------

def vision_param_spec(c: VisionConfig, text_hidden_size: int | None = None) -> dict:
    """Nested dict of k3jax.params.Leaf for the tower + projector, as VisionTower declares them."""
    return VisionTower(c, text_hidden_size).spec()


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


def vision_tower(params, c: VisionConfig, pixel_values, vb: VisionBatch, *, q_block: int = 1024):
    """Patches [N, 3, p, p] -> final-normed patch features [N, D] (VisionTower.features over `params`)."""
    return tower_of(params, c).features(pixel_values, vb, q_block=q_block)


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
    return tower_of(params, c).projector(merged)


def encode_images(params, c: VisionConfig, pixel_values, vb: VisionBatch, *, q_block: int = 1024):
    """Tower + final norm + kh x kw merge + projector: [N_pad // k, text_hidden].

    Jittable with `c` (and q_block) static; rows [0, vb.num_tokens) are the images' tokens in
    order (image i at vb.token_offsets[i]); the remaining rows come from padding and are garbage.
    """
    return tower_of(params, c)(pixel_values, vb, q_block=q_block)
