"""MLA (multi-head latent attention, no rotary) layer.

The `MLA` module (queries low-rank or full, output gate or none: fixed when built) has a kda-like
pair of entry points: `MLA.full` expands keys/values per head (the plain form), and `MLA.step`
runs an engine step on the paged 576-wide latent cache, in two equal forms:
absorbed (queries folded into the latent space; decode rows and small steps) or expanded (a sequence's
cached latents decompressed by kv_b_proj into per-head K/V a key window at a time, then varlen causal
flash attention: 3.4x fewer FLOPs per (query, key) pair, the better form for prefill chunks over any
context). The forms are mathematically equal, which the tests exploit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers.common import rms_norm, upcast
from k3jax.layers.module import Module, matmul, matmuls, param, read
from pallas_kernels import ops, scatter
from pallas_kernels.backend import Backend, resolve

# q_a_layernorm / kv_a_layernorm use the norm class default, not rms_norm_eps (spec section 3).
_LATENT_NORM_EPS = 1e-6


# "auto": steps of at least EXPANDED_MIN_TOKENS tokens (decode-only steps never), when the GPU kernel is
# there, run their prefill chunks expanded and their decode rows absorbed: a sequence whose chunk has
# >= EXPANDED_MIN_SEQ_TOKENS tokens attends expanded over its whole cache, any length, the keys decompressed a
# window of EXPANDED_KEYS_PER_TOKEN rows per step token at a time (pallas_kernels/mla/long_prefix.py); the
# others (decode and draft rows) absorbed, where one query per key does not pay for the key's decompress
# (2 * L * (Dn + Dv) FLOPs a head). "expanded" forces every sequence of every non-decode step expanded.
# Steps from 512 tokens on take the mixed form because the scheduler cuts long prompts' chunks to a few
# hundred tokens while decode rows run, and such a chunk absorbed at 128k context costs ~3.4x the expanded
# FLOPs; the measured per-layer trade-offs are in docs/performance.md ("Tuning of record").
EXPANDED_MIN_TOKENS = 512
# Below it: decode rows (1 token) and speculative verify rows (K + 1), absorbed. Not a cost break-even: by FLOPs
# a chunk of n tokens over a long cache is cheaper expanded from n ~ L (Dn + Dv) / (2L - Dn - Dv) = 171 tokens
# (L 512, Dn = Dv = 128: each key's decompress, 2 L H (Dn + Dv) FLOPs, against the 2 H (2L - Dn - Dv) the
# expanded form saves per (query, key) pair, at equal kernel rates); a step of >= EXPANDED_MIN_TOKENS holds such
# a chunk only beside other prefill chunks (the interactive cut at long context, ~2^26 / context tokens beside at
# most max_num_seqs decode rows, makes steps under 512 tokens, which run absorbed whole).
EXPANDED_MIN_SEQ_TOKENS = 16
# Window rows per step token. Each window merges the fp32 accumulator of every step token (o [T, H, Dv] and its
# log-sum-exp, ~12 T H Dv bytes read and written) and decompresses its keys (2 L H (Dn + Dv) FLOPs a key): at k
# keys a token that is k x 2 L (Dn + Dv) / (12 Dv) = 171 k FLOPs a byte, and 2 is the least k above an H200's
# ~206 FLOPs a byte of HBM (990 TFLOP/s over 4.8 TB/s), so the merges never outlast the decompress; the window's
# bf16 K/V (k T H (Dn + Dv) x 2 bytes) is then twice the accumulator, so the step's memory stays linear in T.
EXPANDED_KEYS_PER_TOKEN = 2
# ... and at least this many: a window is one gather, decompress and kernel launch per MLA layer, so a short
# chunk over a long context (a 512-token interactive chunk at 128k: 128 windows of 1,024 keys) paid that fixed
# cost per window; 8,192 keys is the regular largest step's window (4,096 tokens), so its memory is unchanged.
# A lone long prompt's 16,384-token step (EngineArgs.long_prefill_tokens) walks 32,768-key windows: 4 at 128k
# context, 32 at 1M (512 MiB of K/V at 32 heads, 1.5 GiB at 96, in the step's measured activations).
EXPANDED_MIN_WINDOW_KEYS = 8192


def expanded_key_budget(num_tokens: int, block_tables_shape, page_size: int, decode_only: bool,
                        backend: Backend | None = None) -> int:
    """Static rows of the expanded form's key window for a step shape; 0 = absorbed only. At most the
    keys the block tables can hold. The form is the backend's mla_prefill (EngineArgs.mla_prefill when the
    backend was built). decode_only: a step of decode rows only (decode-only or verify-only), always absorbed."""
    b = resolve(backend)
    if decode_only or b.mla_prefill == "absorbed":
        return 0
    if b.mla_prefill == "auto" and (num_tokens < EXPANDED_MIN_TOKENS or not ops.expanded_kernel_available(b)):
        return 0
    window = max(EXPANDED_KEYS_PER_TOKEN * num_tokens, EXPANDED_MIN_WINDOW_KEYS)
    return min(window, block_tables_shape[0] * block_tables_shape[1] * page_size)


def scale(c: ModelConfig) -> float:
    return c.qk_head_dim ** -0.5


class MLA(Module):
    """Multi-head latent attention (no rotary): queries low-rank (q_a/q_b, `low_rank_q`) or full
    (q_proj), the 576-wide latent cache entry, an optional sigmoid output gate (`output_gate`)."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        c = config
        D, H = c.hidden_size, c.mla_num_heads
        w = lambda shape, axes, kind="w": param(shape, axes, kind, dtype=dtype, rngs=rngs)  # noqa: E731
        self.low_rank_q = bool(c.q_lora_rank)
        self.output_gate = bool(c.mla_output_gate)
        if self.low_rank_q:
            self.q_a_proj = w((D, c.q_lora_rank), ("embed", "q_lora"))
            self.q_a_norm = w((c.q_lora_rank,), ("q_lora",), "norm")
            self.q_b_proj = w((c.q_lora_rank, H * c.qk_head_dim), ("q_lora", "mla_heads"))
        else:
            self.q_proj = w((D, H * c.qk_head_dim), ("embed", "mla_heads"))
        self.kv_a_proj = w((D, c.kv_lora_rank + c.qk_rope_head_dim), ("embed", "kv_lora"))
        self.kv_a_norm = w((c.kv_lora_rank,), ("kv_lora",), "norm")
        self.kv_b_proj = w((c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim)), ("kv_lora", "mla_heads"))
        self.o_proj = w((H * c.v_head_dim, D), ("mla_heads", "embed"))
        if self.output_gate:
            self.g_proj = w((D, H * c.v_head_dim), ("embed", "mla_heads"))

    def projections(self, x, c: ModelConfig):
        """(q [..., H, nope + rope], the per-token cache entry [..., normalized latent (kv_lora_rank) | k_rope
        (qk_rope_head_dim)]): x's query and latent projections, one kernel launch where a step reads stacked
        weights in place (module.matmuls)."""
        q, kv = matmuls((x, self.q_a_proj if self.low_rank_q else self.q_proj), (x, self.kv_a_proj))
        if self.low_rank_q:
            q = matmul(rms_norm(q, read(self.q_a_norm), _LATENT_NORM_EPS), self.q_b_proj)
        ckv = rms_norm(kv[..., :c.kv_lora_rank], read(self.kv_a_norm), _LATENT_NORM_EPS)
        return (q.reshape(*x.shape[:-1], c.mla_num_heads, c.qk_head_dim),
                jnp.concatenate([ckv, kv[..., c.kv_lora_rank:]], axis=-1))

    def kv_b(self, c: ModelConfig):
        """kv_b_proj split per head: W_uk [L, H, nope], W_uv [L, H, v]."""
        w = read(self.kv_b_proj).reshape(c.kv_lora_rank, c.mla_num_heads, c.qk_nope_head_dim + c.v_head_dim)
        return w[..., :c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]

    def output(self, x, o, c: ModelConfig):
        """o [..., H, v] -> optional sigmoid output gate -> o_proj."""
        o = o.reshape(*x.shape[:-1], c.mla_num_heads * c.v_head_dim)
        if self.output_gate:
            o = (upcast(o) * jax.nn.sigmoid(upcast(matmul(x, self.g_proj)))).astype(x.dtype)
        return matmul(o, self.o_proj)

    def full(self, x, c: ModelConfig, backend: Backend | None = None):
        """x [B, T, D] -> [B, T, D], causal attention within each sequence (plain jnp: no backend)."""
        q, kv = self.projections(x, c)
        q_nope, q_rope = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        ckv, k_rope = kv[..., :c.kv_lora_rank], kv[..., c.kv_lora_rank:]
        w_uk, w_uv = self.kv_b(c)
        k_nope = jnp.einsum("btl,lhd->bthd", ckv, w_uk)
        v = jnp.einsum("btl,lhd->bthd", ckv, w_uv)
        s = (jnp.einsum("bqhd,bkhd->bhqk", q_nope, k_nope, preferred_element_type=upcast(x).dtype)
             + jnp.einsum("bqhd,bkd->bhqk", q_rope, k_rope, preferred_element_type=upcast(x).dtype)) * scale(c)
        T = x.shape[1]
        causal = jnp.tril(jnp.ones((T, T), bool))
        s = jnp.where(causal, s, -jnp.inf)
        prob = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", prob.astype(v.dtype), v)
        return self.output(x, o, c)

    def _absorbed(self, c: ModelConfig, q, kv_pages, meta, dtype, backend: Backend):
        """o [T, H, v]: attention on the latent cache with queries folded through W_uk. In a speculative
        verification step (meta spec_dst [N, W]) on the kernels, the tokens of chunks of at most W tokens run
        as decode rows of their own (ops.mla_ragged_paged's token_rows), so that a verified token rounds as
        decoding it does and greedy speculation keeps plain decoding's tokens; longer chunks run ragged."""
        w_uk, w_uv = self.kv_b(c)
        q_lat = jnp.einsum("thd,lhd->thl", q[..., :c.qk_nope_head_dim], w_uk)
        kv_dtype = scatter.value_dtype(kv_pages, dtype)

        def attend(kv_lens, **kw):
            return ops.mla_ragged_paged(q_lat.astype(kv_dtype), q[..., c.qk_nope_head_dim:].astype(kv_dtype),
                                        kv_pages, meta["block_tables"], meta["cu_seqlens"], kv_lens,
                                        scale=scale(c), backend=backend, **kw)
        spec = meta.get("spec_dst")
        if spec is None or not backend.kernels:
            o_lat = attend(meta["kv_lens"], decode_only=bool(meta.get("decode_only", False)))
        elif meta.get("verify_only"):                # every chunk short: all decode rows, no branch
            o_lat = attend(meta["kv_lens"], token_rows=True)
        else:
            cu, kv_lens = meta["cu_seqlens"], meta["kv_lens"]
            short = (cu[1:] - cu[:-1]) <= spec.shape[1]
            o_lat = attend(jnp.where(short, kv_lens, 0), token_rows=True)
            tok_short = short[meta["token_seq"]]
            o_lat = jax.lax.cond(jnp.any(~short & (cu[1:] > cu[:-1])),
                                 lambda: jnp.where(tok_short[:, None, None], o_lat,
                                                   attend(jnp.where(short, 0, kv_lens))),
                                 lambda: o_lat)
        return jnp.einsum("thl,lhd->thd", o_lat.astype(dtype), w_uv)

    def _mixed(self, c: ModelConfig, q, kv_pages, meta, dtype, num_keys: int, backend: Backend):
        """o [T, H, v]: prefill chunks expanded over their whole caches (a key window of num_keys rows at
        a time), the other rows absorbed (module comment: which sequence takes which form)."""
        kv_dtype = scatter.value_dtype(kv_pages, dtype)
        cu, kv_lens = meta["cu_seqlens"].astype(jnp.int32), meta["kv_lens"].astype(jnp.int32)
        n_new = cu[1:] - cu[:-1]
        expanded = n_new >= (EXPANDED_MIN_SEQ_TOKENS if backend.mla_prefill == "auto" else 1)
        t = jnp.arange(q.shape[0], dtype=jnp.int32)
        tok_expanded = (t < cu[-1]) & expanded[meta["token_seq"]]
        # a sequence with kv_len 0 has no keys in a form: its tokens get zeros there
        o = ops.mla_prefix_attention(q.astype(kv_dtype), kv_pages, meta["block_tables"], cu,
                                     jnp.where(expanded, kv_lens, 0), read(self.kv_b_proj),
                                     nope_dim=c.qk_nope_head_dim, scale=scale(c), block_keys=num_keys,
                                     backend=backend).astype(dtype)
        rest = {**meta, "kv_lens": jnp.where(expanded, 0, kv_lens), "decode_only": False}
        absorbed = jax.lax.cond(jnp.any(~expanded & (n_new > 0)),
                                lambda: self._absorbed(c, q, kv_pages, rest, dtype, backend),
                                lambda: jnp.zeros(o.shape, dtype))
        return jnp.where(tok_expanded[:, None, None], o, absorbed)

    def step(self, x, c: ModelConfig, kv_pages, meta, backend: Backend | None = None):
        """One engine step over ragged chunks on the paged latent cache (form: `expanded_key_budget`).

        x [T, D]; kv_pages [P, page_size, L+R]; meta: slot_mapping [T] (cache row of each new token,
        -1 = padding), block_tables [N, max_pages], cu_seqlens [N+1], kv_lens [N] (cache length after
        this step), token_seq [T] (each token's sequence, clamped to N - 1), optional static decode_only and
        verify_only (StepBatch).
        Returns (out [T, D], kv_pages).
        """
        with jax.named_scope("mla_in"):
            q, kv = self.projections(x, c)
            kv_pages = ops.write_kv_pages(kv_pages, kv.astype(scatter.value_dtype(kv_pages, x.dtype)),
                                          meta["slot_mapping"])
        backend = resolve(backend)
        num_keys = expanded_key_budget(x.shape[0], meta["block_tables"].shape, kv_pages.shape[1],
                                       bool(meta.get("decode_only") or meta.get("verify_only")), backend)
        with jax.named_scope("mla_attn"):
            if num_keys:
                o = self._mixed(c, q, kv_pages, meta, x.dtype, num_keys, backend)
            else:
                o = self._absorbed(c, q, kv_pages, meta, x.dtype, backend)
        with jax.named_scope("mla_out"):
            return self.output(x, o, c), kv_pages
