"""The one dispatch point between the model and its heavy ops.

Each op picks an implementation from its `backend` (pallas_kernels/backend.py: built once per model or
runner; None = detected for the device with the default choices, for direct calls):
Pallas kernels or the pure-jnp references, interpret mode, and the kernel family by platform.
GPU runs our Triton-backend kernels. TPU: the MoE grouped matmuls run jax's Mosaic-TPU megablox
kernel (pallas_kernels/moe/tpu.py); KDA prefill, KDA decode and paged MLA run their Mosaic kernels
(pallas_kernels/kda/chunk_tpu.py, pallas_kernels/kda/recurrent_tpu.py,
pallas_kernels/mla/tpu_kernel.py; lowering checked, never run on a TPU here). KDA prefill's TPU
kernel has its own [H, R, K] layout: the GPU chunk kernels' per-head [C, 1, K] blocks break
Mosaic's (8, 128) block-tiling rule.
The model's call sites only ever call the functions below.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import scatter
from pallas_kernels.backend import Backend, resolve
from pallas_kernels.kda import reference as kda_ref
from pallas_kernels.mla import blocked as mla_blocked
from pallas_kernels.mla import reference as mla_ref


# ---- KDA -------------------------------------------------------------------
l2norm = kda_ref.l2norm
kda_gate = kda_ref.kda_gate


def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, safe_gate=False,
              backend: Backend | None = None):
    """Chunked KDA (prefill / mixed steps). Shapes as flash-linear-attention's chunk_kda.
    safe_gate: every log decay in g is >= -5 (K3's bounded gate), which allows a cheaper kernel."""
    b = resolve(backend)
    if b.kernels:
        from pallas_kernels import kda
        return kda.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             cu_seqlens=cu_seqlens, safe_gate=safe_gate, interpret=b.interpret,
                             platform=b.platform)
    # On CPU the token-serial scan is 100x faster than the chunked (UT-transform) reference for the
    # sizes a CPU serves; accelerators without a kernel take the chunked form (parallel over chunks).
    ref = kda_ref.recurrent_kda_reference if b.device == "cpu" else kda_ref.chunk_kda_reference
    return ref(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)


def kda_decode(q, k, v, g, beta, state_pool, state_indices, *, scale=None, backend: Backend | None = None):
    """One token per sequence against the state pool, updated in place (donate it).
    q, k, g [N, H, K]; v [N, H, V]; beta [N, H]; state_indices [N] (negative = padding, skipped)."""
    b = resolve(backend)
    if b.kernels:
        from pallas_kernels import kda
        return kda.fused_recurrent_kda(q, k, v, g, beta, state_pool, state_indices, scale=scale,
                                       interpret=b.interpret, platform=b.platform)
    idx = state_indices.astype(jnp.int32)
    ok = idx >= 0
    s0 = scatter.read_rows(state_pool, jnp.maximum(idx, 0))
    o, s1 = kda_ref.recurrent_kda_reference(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                            scale=scale, initial_state=s0)
    pool = scatter.set_rows(state_pool, jnp.where(ok, idx, state_pool.shape[0]), s1, mode="drop")
    return jnp.where(ok[:, None, None], o[:, 0], 0).astype(v.dtype), pool


def kda_decode_positions(q, k, v, g, beta, state_pool, initial_state, run, dst, *, scale=None,
                         backend: Backend | None = None):
    """A speculative verification chunk's tokens (each sequence's first W) decoded in order from initial_state,
    the state after position t written to pool row dst[n, t] (negative: not written). q, k, g [N, W, H, K];
    v [N, W, H, V]; beta [N, W, H]; run [N, W] bool. Returns (o [N, W, H, V], the state after each sequence's
    last run position, the pool, updated in place: donate it). Each token rounds as kda_decode's."""
    b = resolve(backend)
    if b.kernels:
        from pallas_kernels import kda
        return kda.fused_recurrent_kda_positions(q, k, v, g, beta, state_pool, initial_state, run, dst,
                                                 scale=scale, interpret=b.interpret, platform=b.platform)
    step = lambda q, k, v, g, bt, s, i: kda_decode(q, k, v, g, bt, s, i, scale=scale, backend=b)  # noqa: E731
    return kda_ref.decode_positions_by_steps(step, q, k, v, g, beta, state_pool, initial_state, run, dst)


# ---- MLA -------------------------------------------------------------------
def write_kv_pages(kv_pages, new_kv, slot_mapping):
    """Scatter new latent rows into the page pool (in place under donation; rows in the pool's value dtype
    when it stores bits, pallas_kernels/scatter.py)."""
    return mla_ref.write_kv_pages(kv_pages, new_kv, slot_mapping)


def mla_ragged_paged(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens, *, scale,
                     decode_only=False, token_rows=False, backend: Backend | None = None):
    """Absorbed MLA attention of ragged query chunks over paged latent caches.
    decode_only (static): at most one token per sequence (the kernel's decode schedule and tuning).
    token_rows (static): each token a decode row of its own on the decode kernel (short speculative
    verification chunks: their tokens round as decode steps; mla.paged.ragged_paged_mla)."""
    b = resolve(backend)
    if b.kernels:
        from pallas_kernels import mla
        kv_pages = scatter.values(kv_pages, q_latent.dtype)   # a CPU bits pool (interpret mode): as floats
        return mla.ragged_paged_mla(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens,
                                    scale=scale, interpret=b.interpret, platform=b.platform,
                                    decode_only=bool(decode_only), decode_kernel=b.mla_decode,
                                    token_rows=bool(token_rows))
    # CPU: work bounded by the real lengths (the reference reads every table entry: ~3x slower there at the
    # default 8192-token context); accelerators without a kernel keep the reference's parallel form
    ragged = mla_blocked.ragged_paged_mla_blocked if b.device == "cpu" else mla_ref.ragged_paged_mla_reference
    return ragged(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens, scale=scale)


def mla_prefix_attention(q, kv_pages, block_tables, cu_seqlens, kv_lens, kv_b, *, nope_dim, scale, block_keys,
                         backend: Backend | None = None):
    """Expanded-form MLA attention of ragged chunks over their whole paged caches (any length), the keys
    decompressed by kv_b_proj a window of block_keys at a time (pallas_kernels/mla/long_prefix.py). GPU: each
    window's attention by backend.mla_prefix_kernel (the Triton varlen kernel, cuDNN's fused attention, or
    cuDNN split into unmasked prefix windows and a causal chunk);
    TPU / CPU: the jnp reference."""
    from pallas_kernels.mla import long_prefix
    b = resolve(backend)
    impl = "reference"
    if b.kernels and b.platform != "tpu":
        impl = b.mla_prefix_kernel if b.platform == "gpu" and not b.interpret else "triton"
    if impl == "cudnn-split":      # one sequence's prefix unmasked + its chunk causal; several sequences: triton
        from pallas_kernels.mla.long_prefix_split import split_prefix_attention
        return split_prefix_attention(q, kv_pages, block_tables, cu_seqlens, kv_lens, kv_b, nope_dim=nope_dim,
                                      scale=scale, block_keys=block_keys, attention="cudnn", fallback="triton")
    return long_prefix.prefix_attention(q, kv_pages, block_tables, cu_seqlens, kv_lens, kv_b, nope_dim=nope_dim,
                                        scale=scale, block_keys=block_keys, impl=impl, interpret=b.interpret or None)


def expanded_kernel_available(backend: Backend | None = None) -> bool:
    """The expanded MLA form has a fast kernel here (the GPU Triton one)."""
    b = resolve(backend)
    return b.kernels and b.platform == "gpu"


# ---- dense matmuls of scanned layers ----------------------------------------
def stacked_matmul(x, w, index, *, backend: Backend | None = None):
    """x [..., K] @ w[index], w [L, K, N] a weight stacked over scanned layers, index traced
    (pallas_kernels/stacked.py: GPU kernels read few-row steps' weight in place)."""
    from pallas_kernels import stacked
    b = resolve(backend)
    return stacked.stacked_matmul(x, w, index, kernel=_gpu_kernels(b), interpret=b.interpret)


def stacked_matmuls(pairs, index, *, backend: Backend | None = None):
    """[x @ w[index] for (x, w) in pairs], w stacks of one scanned block: few-row steps' products in one GPU
    kernel launch (pallas_kernels/stacked.py)."""
    from pallas_kernels import stacked
    b = resolve(backend)
    return stacked.stacked_matmuls(pairs, index, kernel=_gpu_kernels(b), interpret=b.interpret)


def stacked_glu(x, w_gate, w_up, index, act, *, backend: Backend | None = None):
    """act(x @ w_gate[index], x @ w_up[index]), stacks of one scanned block: few-row steps in one GPU kernel
    launch with act in its epilogue (pallas_kernels/stacked.py)."""
    from pallas_kernels import stacked
    b = resolve(backend)
    return stacked.stacked_glu(x, w_gate, w_up, index, act, kernel=_gpu_kernels(b), interpret=b.interpret)


def _gpu_kernels(b: Backend) -> bool:
    """The stacked dense kernels run: Pallas kernels on the GPU (elsewhere the layer's slice and XLA's dot)."""
    return b.kernels and b.platform == "gpu"


# ---- MoE -------------------------------------------------------------------
def gmm(lhs, rhs, group_sizes, *, backend: Backend | None = None):
    """Grouped matmul with jax.lax.ragged_dot semantics: lhs [M, K], rhs [G, K, N]."""
    b = resolve(backend)
    if b.kernels and b.platform == "tpu":
        from pallas_kernels.moe.tpu import gmm_tpu
        return gmm_tpu(lhs, rhs, group_sizes, interpret=b.interpret)
    if b.kernels:
        from pallas_kernels import moe
        return moe.gmm(lhs, rhs, group_sizes, interpret=b.interpret, platform=b.platform)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def expert_mlp(x, topk_ids, topk_weights, experts: dict, *, mxfp4: bool, activation: str, situ_beta: float,
               situ_linear_beta, reference, num_experts_total=None, layer=None, backend: Backend | None = None):
    """Routed experts: sum_k w[t, k] * expert_{ids[t, k]}(x[t]). experts holds w1/w3/w2 ([E, in, out])
    or, when mxfp4, MXFP4 (w*_packed, w*_scale); w13 (w13_packed, w13_scale) in place of w1 and w3: the
    merged gate/up layout (pallas_kernels/moe/layout.py). `reference()` computes the same with the model's own jnp code.
    num_experts_total: the model's expert count; under expert parallelism E is this device's share
    and the kernels size their tiles from the rows that land here (about T*k / num_experts_total).
    layer (int32, may be traced): every array in experts is a stack over layers ([L, E, ...]) and this
    layer runs; the kernels read its experts in place (reference() must take the layer's slice)."""
    b = resolve(backend)
    if not b.kernels or b.platform == "tpu":    # TPU: the model's composition, its gmm calls on megablox
        return reference()
    from pallas_kernels import moe
    kw = dict(activation=activation, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta, interpret=b.interpret,
              num_experts_total=num_experts_total, layer=layer, platform=b.platform)
    if not mxfp4:
        up = (experts["w13"], None) if "w13" in experts else (experts["w1"], experts["w3"])
        return moe.expert_mlp(x, topk_ids, topk_weights, *up, experts["w2"], **kw)
    # MXFP4: weights decoded in the kernels' main loop at every row count (decode tiles for few rows
    # per expert, schedule.PREFILL_TILES from 65 on): at decode ~50x faster than dequantizing all
    # experts first, at prefill ~1.4x faster than one XLA decode pass + the bf16 kernels.
    q = lambda n: (experts[f"{n}_packed"], experts[f"{n}_scale"])
    up = (q("w13"), None) if "w13_packed" in experts else (q("w1"), q("w3"))
    return moe.expert_mlp_mxfp4(x, topk_ids, topk_weights, *up, q("w2"), decoder=b.mxfp4_decoder, **kw)
