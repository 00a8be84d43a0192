"""Small shared pieces: RMSNorm, GLU activations, Attention Residuals (functions and modules), dense MLP."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers.module import Module, glu, matmul, param, read


def upcast(x):
    """At least fp32 (fp64 stays fp64, so float64 tests run the whole model in float64)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def rms_norm(x, weight, eps: float):
    """RMSNorm computed in fp32; the weight multiplies after casting back (HF convention)."""
    xf = upcast(x)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def glu_act(gate, up, c: ModelConfig):
    """SwiGLU (Kimi Linear) or SiTU-GLU (K3), in fp32; returns the input dtype."""
    g = upcast(gate)
    u = upcast(up)
    if c.hidden_act == "silu":
        out = jax.nn.silu(g) * u
    else:
        b = c.situ_beta
        out = b * jnp.tanh(g / b) * jax.nn.sigmoid(g)
        if c.situ_linear_beta is not None:
            u = c.situ_linear_beta * jnp.tanh(u / c.situ_linear_beta)
        out = out * u
    return out.astype(gate.dtype)


def attn_res(prefix_sum, blocks, proj, norm, eps: float):
    """Attention Residuals: softmax over sources [blocks..., prefix_sum] scored per token (fp32).

    Keys are the RMS-normalized sources; values are the raw sources. Token-local.
    """
    return attn_res_stacked(jnp.stack([*blocks, prefix_sum], axis=0), proj, norm, eps)


def attn_res_stacked(sources, proj, norm, eps: float, count=None):
    """attn_res over stacked sources [S, ..., D]; count (traced): only the first `count` sources
    take part (the rest get probability 0), so a fixed-size buffer can carry them through a scan."""
    v = upcast(sources)
    kn = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    w = upcast(norm) * upcast(proj)
    score = jnp.sum(kn * w, axis=-1)                                       # [S, ...]
    if count is not None:
        live = jnp.arange(sources.shape[0]) < count
        score = jnp.where(live.reshape((-1,) + (1,) * (score.ndim - 1)), score, -jnp.inf)
    p = jax.nn.softmax(score, axis=0)
    return jnp.sum(p[..., None] * v, axis=0).astype(sources.dtype)


def mix_sources(buf, n, proj, norm, eps: float):
    """attn_res over a block buffer's sources 0..n (n static: exactly the unrolled formula; traced:
    masked, for the scan)."""
    if isinstance(n, int):
        return buf[0] if n == 0 else attn_res_stacked(buf[:n + 1], proj, norm, eps)
    return attn_res_stacked(buf, proj, norm, eps, count=n + 1)


def add_to_source(buf, n, x):
    """buf[n] += x (n static or traced)."""
    if isinstance(n, int):
        return buf.at[n].add(x.astype(buf.dtype))
    cur = jax.lax.dynamic_index_in_dim(buf, n, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, cur + x.astype(buf.dtype), n, 0)


class DenseMLP(Module):
    """gate/up/down GLU MLP (the dense first layer, shared experts: `inter` their width)."""

    def __init__(self, config: ModelConfig, inter: int | None = None, *, dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None):
        d, inter = config.hidden_size, config.intermediate_size if inter is None else inter
        self.gate = param((d, inter), ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.up = param((d, inter), ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.down = param((inter, d), ("mlp", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x, c: ModelConfig):
        return matmul(glu(x, self.gate, self.up, lambda g, u: glu_act(g, u, c)), self.down)


def norm_param(config: ModelConfig, dtype, rngs):
    return param((config.hidden_size,), ("embed",), "norm", dtype=dtype, rngs=rngs)


class AttnRes(Module):
    """Attention Residuals of one layer: the learned queries and key norms that mix the block
    history before the attention and before the MLP."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        for name in ("attn_proj", "attn_norm", "mlp_proj", "mlp_norm"):
            setattr(self, name, norm_param(config, dtype, rngs))

    def before_attn(self, buf, n, eps: float):
        return mix_sources(buf, n, read(self.attn_proj), read(self.attn_norm), eps)

    def before_mlp(self, buf, n, eps: float):
        return mix_sources(buf, n, read(self.mlp_proj), read(self.mlp_norm), eps)


class OutputAttnRes(Module):
    """Attention Residuals after the last layer: mixes the block history into the final hidden states."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        self.proj = norm_param(config, dtype, rngs)
        self.norm = norm_param(config, dtype, rngs)

    def __call__(self, buf, n, eps: float):
        return mix_sources(buf, n, read(self.proj), read(self.norm), eps)
