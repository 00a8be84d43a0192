"""cuDNN fused attention (jax's cuDNN SDPA; FA3-class on Hopper) as the long-prefix op's attention over one key
window: the contract of expanded.block_attention_reference (o, lse), for pallas_kernels/mla/long_prefix.py.

cuDNN takes dense [B, T, H, D] operands, so the window is one batch row: the step's T queries against the
window's S keys, per-head K = [key nope | the shared rope key], and the ragged structure (each query sees its
own sequence's keys up to its position, inside the window) as a boolean [T, S] mask, which cuDNN adds as a
bias. Rows that see no key of the window get o = 0 and lse = -inf here (cuDNN's masked softmax gives them a
uniform average). Opt-in (Backend.mla_prefix_kernel = "cudnn"): checked on the GPU by
tests/kernels/test_mla_long_prefix_gpu.py.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.mla.reference import token_positions


def block_attention_cudnn(q, kv, latents, cu_seqlens, kv_lens, kv_start, *, nope_dim, scale, window):
    """q [T, H, Dn + Dr], kv [S, H, Dn + Dv], latents [S, L + Dr], cu_seqlens [N+1], kv_lens [N], kv_start [N]
    (buffer row of each sequence's position 0, may be negative), window = S. Returns (o [T, H, Dv] fp32,
    lse [T, H] fp32, natural log-sum-exp of the scaled visible scores, -inf where none)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attn
    n_tok, heads, _ = q.shape
    n_keys = kv.shape[0]
    dr = q.shape[-1] - nope_dim
    seq, pos, _ = token_positions(cu_seqlens.astype(jnp.int32), kv_lens.astype(jnp.int32), n_tok)
    lo = kv_start.astype(jnp.int32)[seq]                                    # [T] row of the token's position 0
    keys = jnp.arange(n_keys, dtype=jnp.int32)
    visible = (keys[None, :] >= lo[:, None]) & (keys[None, :] <= (lo + pos)[:, None]) & (keys[None, :] < window)
    seen = (jnp.minimum(lo + pos + 1, window) - jnp.maximum(lo, 0)) > 0       # [T]: pos < 0 (padding) sees none
    k_rope = jnp.broadcast_to(latents[:, None, latents.shape[-1] - dr:], (n_keys, heads, dr)).astype(kv.dtype)
    k = jnp.concatenate([kv[..., :nope_dim], k_rope], axis=-1)
    v = kv[..., nope_dim:]
    o, lse = cudnn_attn.dot_product_attention(q[None], k[None], v[None], mask=visible[None, None], scale=scale,
                                              mask_type=cudnn_attn.MaskType.NO_MASK, qkv_layout="BTNH",
                                              return_residual=True)
    lse = lse[0].astype(jnp.float32).T   # the residual is [B, H, T] (a shape test cannot tell it when T == H)
    o = jnp.where(seen[:, None, None], o[0].astype(jnp.float32), 0.0)
    return o, jnp.where(seen[:, None], lse, -jnp.inf)
