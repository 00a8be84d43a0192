"""Cache pools and the per-step batch: the pytrees the jitted model step takes and returns.

Pools (donated through the step so XLA updates them in place), one array per kind, with every
layer of that kind side by side inside each page / slot (j = the layer's index among its kind):
  mla_kv     [num_pages, n_mla, page_size, kv_lora_rank + rope]   page 0 = garbage sink
             (an FP8 cache: uint32 rows of mla_row_width words, pallas_kernels/mla/fp8_cache.py)
  kda_state  [num_slots, n_kda, H, K, V] fp32                      slot 0 = garbage sink
  kda_conv   [num_slots, n_kda, conv_kernel - 1, 3 * H * K]        last inputs of the q|k|v short convs
Pages / slots are the major axis: that is what gets sharded, what the allocator hands out, and a
page copy moves every layer at once. The model views a pool as [rows * layers, ...] (model.py).
Each pool declares its logical axes next to its field (`pool_axes`; sharding/rules.py maps them to a
mesh): pages / slots ("batch") are what is sharded.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from k3jax.config import ModelConfig
from pallas_kernels.mla import fp8_cache
from pallas_kernels.scatter import storage_dtype


def _pool(*axes):
    """A pool field with its logical axes (one name or None per dimension)."""
    return struct.field(metadata={"logical_axes": axes})


@struct.dataclass
class CachePools:
    # the latent is shared by all heads: replicated over tensor
    mla_kv: jax.Array = _pool("batch", None, None, None)
    # fp32 states: slots over the data axes, heads over tensor
    kda_state: jax.Array = _pool("batch", None, "kda_heads", None, None)
    # packed q|k|v channels are not head-contiguous: replicated over tensor
    kda_conv: jax.Array = _pool("batch", None, None, None)

    @property
    def page_size(self) -> int:
        return self.mla_kv.shape[2]

    @property
    def num_pages(self) -> int:
        return self.mla_kv.shape[0]

    @property
    def num_slots(self) -> int:
        return self.kda_state.shape[0]

    @classmethod
    def pool_axes(cls) -> dict[str, tuple]:
        """{pool name: its declared logical axes}, every pool (ValueError for one that declares none)."""
        out = {}
        for f in dataclasses.fields(cls):
            if "logical_axes" not in f.metadata:
                raise ValueError(f"CachePools.{f.name} declares no logical axes (k3jax/cache.py, _pool(...))")
            out[f.name] = f.metadata["logical_axes"]
        return out

    def layer(self, kind: str, j: int):
        """One layer's view (a copy) of a pool: kind "mla_kv" | "kda_state" | "kda_conv"."""
        return getattr(self, kind)[:, j]


def mla_row_width(c: ModelConfig, mla_dtype) -> int:
    """Elements of one MLA cache row: kv_lora_rank + rope, or an FP8 cache's packed words."""
    if jnp.dtype(mla_dtype) == fp8_cache.FP8:
        return fp8_cache.packed_width(c.kv_lora_rank, c.qk_rope_head_dim)
    return c.mla_cache_dim


def mla_storage_dtype(mla_dtype, bits: bool):
    """The MLA pool's element type: uint32 for an FP8 cache (packed rows), else storage_dtype's."""
    return fp8_cache.STORAGE if jnp.dtype(mla_dtype) == fp8_cache.FP8 else storage_dtype(mla_dtype, bits)


def pool_shapes(c: ModelConfig, num_pages: int, page_size: int, num_slots: int, dtype=jnp.bfloat16,
                bits: bool = False, mla_dtype=None):
    """ShapeDtypeStruct pools (for planning and eval_shape); bits: 16-bit float pools stored as uint16
    (Backend.pool_bits, pallas_kernels/scatter.py). mla_dtype: the MLA pages' (None: dtype; float8_e4m3fn:
    packed FP8 rows)."""
    mla_dtype = dtype if mla_dtype is None else mla_dtype
    dtype = storage_dtype(dtype, bits)
    H, K = c.kda_num_heads, c.kda_head_dim
    nm, nk = len(c.mla_layers), len(c.kda_layers)
    kv = jax.ShapeDtypeStruct((num_pages, nm, page_size, mla_row_width(c, mla_dtype)),
                              mla_storage_dtype(mla_dtype, bits))
    st = jax.ShapeDtypeStruct((num_slots, nk, H, K, K), jnp.float32)
    cv = jax.ShapeDtypeStruct((num_slots, nk, c.conv_kernel - 1, 3 * H * K), dtype)
    return CachePools(mla_kv=kv, kda_state=st, kda_conv=cv)


def make_pools(c: ModelConfig, num_pages: int, page_size: int, num_slots: int, dtype=jnp.bfloat16,
               bits: bool = False, mla_dtype=None) -> CachePools:
    """Zero-filled pools. num_pages / num_slots include the reserved id 0; bits, mla_dtype: see pool_shapes."""
    if num_pages < 2 or num_slots < 2:
        raise ValueError("pools need at least 2 pages and 2 slots (id 0 is reserved)")
    shapes = pool_shapes(c, num_pages, page_size, num_slots, dtype, bits, mla_dtype)
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def pool_bytes_per_page(c: ModelConfig, page_size: int, dtype=jnp.bfloat16) -> int:
    """Bytes of one MLA page (every layer); dtype: the MLA pages' (float8_e4m3fn: packed FP8 rows)."""
    return len(c.mla_layers) * page_size * mla_row_width(c, dtype) * mla_storage_dtype(dtype, False).itemsize


def pool_bytes_per_slot(c: ModelConfig, dtype=jnp.bfloat16) -> int:
    H, K = c.kda_num_heads, c.kda_head_dim
    return len(c.kda_layers) * (H * K * K * 4 + (c.conv_kernel - 1) * 3 * H * K * jnp.dtype(dtype).itemsize)


@struct.dataclass
class StepBatch:
    """One engine step: N sequences' token chunks laid out flat (T tokens, bucket-padded).

    tokens [T]            token ids (padding: any valid id)
    slot_mapping [T]      MLA cache row (page * page_size + offset) of each token; -1 = padding
    cu_seqlens [N+1]      chunk boundaries in `tokens`; tokens past cu_seqlens[N] are padding
    kv_lens [N]           tokens in each sequence's cache after this step (context + chunk)
    block_tables [N, P]   MLA pages of each sequence (unused entries 0)
    state_src [N]         KDA slot to resume from (-1 = fresh zero state; may be a prefix checkpoint)
    state_dst [N]         KDA slot receiving the state after the chunk (0 for padding sequences)
    ckpt_dst [N]          extra slot that also receives it (a prefix-cache checkpoint; 0 = none)
    logits_indices [N]    flat index of the token whose logits each sequence needs
    decode_only           static: every real sequence feeds one token and continues in its own
                          slot (no checkpoint), so KDA runs the fused decode kernel on the pool
    mm_embeds [T, D]      optional: input embeddings replacing the token embedding where mm_mask
    mm_mask [T]           is set (image placeholders); None on text-only steps (own compiled variant)
    spec_dst [N, W]       optional (speculative verification): KDA slot receiving the state after each
                          of the chunk's first W tokens (-1 = not kept); logits_indices then has N * W
                          entries, row n * W + j the logits after token j of sequence n
    verify_only           static: a verification step whose every chunk has at most W tokens (text only), so
                          KDA runs the decode recurrence token by token and no chunk kernel, and MLA runs
                          every token as a decode row (no branch on the chunks' lengths)
    """
    tokens: jax.Array
    slot_mapping: jax.Array
    cu_seqlens: jax.Array
    kv_lens: jax.Array
    block_tables: jax.Array
    state_src: jax.Array
    state_dst: jax.Array
    ckpt_dst: jax.Array
    logits_indices: jax.Array
    decode_only: bool = struct.field(pytree_node=False, default=False)
    mm_embeds: Optional[jax.Array] = None
    mm_mask: Optional[jax.Array] = None
    spec_dst: Optional[jax.Array] = None
    verify_only: bool = struct.field(pytree_node=False, default=False)


@dataclasses.dataclass
class SeqChunk:
    """Host description of one sequence's part of a step."""
    tokens: Sequence[int]       # the new tokens of this chunk
    context_len: int            # tokens already in the cache before the chunk
    pages: Sequence[int]        # the sequence's block table (covers context_len + len(tokens))
    state_src: int              # KDA slot to resume from (-1 = fresh)
    state_dst: int              # KDA slot to write
    ckpt_dst: int = 0           # extra checkpoint slot (0 = none)
    mm: Sequence = ()           # (offset in the chunk, embeddings [m, D]) replacing token embeddings
    spec_slots: Sequence[int] = ()  # speculative verification: slot for the state after token j (see StepBatch)


def make_step_batch(chunks: Sequence[SeqChunk], page_size: int, *, num_tokens: int | None = None,
                    num_seqs: int | None = None, max_pages: int | None = None, spec_width: int = 0) -> StepBatch:
    """Lay chunks out flat (numpy), padded to num_tokens / num_seqs / max_pages (shape buckets).
    Multimodal rows (SeqChunk.mm) are laid out at their tokens' flat positions. spec_width W > 0: a
    verification step (StepBatch.spec_dst from SeqChunk.spec_slots, logits after each of the first W
    tokens of every chunk)."""
    lens = [len(ch.tokens) for ch in chunks]
    T = num_tokens or max(sum(lens), 1)
    N = num_seqs or len(chunks)
    P = max_pages or max((len(ch.pages) for ch in chunks), default=1)
    if sum(lens) > T or len(chunks) > N:
        raise ValueError(f"{sum(lens)} tokens / {len(chunks)} sequences exceed the bucket {T} / {N}")
    tokens = np.zeros(T, np.int32)
    slot = np.full(T, -1, np.int32)
    cu = np.zeros(N + 1, np.int32)
    kv_lens = np.zeros(N, np.int32)
    bt = np.zeros((N, P), np.int32)
    src = np.full(N, -1, np.int32)
    dst = np.zeros(N, np.int32)
    ckpt = np.zeros(N, np.int32)
    logits_idx = np.zeros(N, np.int32)
    start = 0
    for n, ch in enumerate(chunks):
        m = lens[n]
        end_pos = ch.context_len + m
        pages = np.asarray(ch.pages, np.int32)
        if len(pages) > P or len(pages) * page_size < end_pos:
            raise ValueError(f"sequence {n}: {len(pages)} pages cannot hold {end_pos} tokens (max {P} pages)")
        pos = ch.context_len + np.arange(m)
        tokens[start:start + m] = ch.tokens
        slot[start:start + m] = pages[pos // page_size] * page_size + pos % page_size
        bt[n, :len(pages)] = pages
        kv_lens[n] = end_pos
        src[n], dst[n], ckpt[n] = ch.state_src, ch.state_dst, ch.ckpt_dst
        logits_idx[n] = start + max(m - 1, 0)
        start += m
        cu[n + 1] = start
    cu[len(chunks) + 1:] = start
    mm_embeds = mm_mask = None
    rows = [(start_n + off, e) for start_n, ch in zip(cu[:len(chunks)], chunks) for off, e in ch.mm]
    if rows:
        dim = rows[0][1].shape[-1]
        mm_embeds = np.zeros((T, dim), rows[0][1].dtype)
        mm_mask = np.zeros(T, bool)
        for at, e in rows:
            if at < 0 or at + len(e) > cu[len(chunks)]:
                raise ValueError(f"multimodal rows at {at}..{at + len(e)} fall outside their chunk")
            mm_embeds[at:at + len(e)] = e
            mm_mask[at:at + len(e)] = True
    spec_dst = None
    if spec_width:
        spec_dst = np.full((N, spec_width), -1, np.int32)
        # a verify chunk (spec_slots given): the logits after each of its tokens; any other: its last token's
        last = np.maximum(np.diff(cu), 1)[:, None] - 1
        verify = np.zeros((N, 1), bool)
        verify[:len(chunks), 0] = [bool(len(ch.spec_slots)) for ch in chunks]
        cols = np.where(verify, np.minimum(np.arange(spec_width)[None], last), last)
        logits_idx = (cu[:-1, None] + cols).reshape(-1).astype(np.int32)
        for n, ch in enumerate(chunks):
            if len(ch.spec_slots) > min(spec_width, lens[n]):
                raise ValueError(f"sequence {n}: {len(ch.spec_slots)} position states for {lens[n]} tokens "
                                 f"(spec width {spec_width})")
            spec_dst[n, :len(ch.spec_slots)] = ch.spec_slots
    decode_only = not spec_width and not rows and bool(chunks) and all(len(ch.tokens) == 1 and ch.state_src == ch.state_dst >= 0 and not ch.ckpt_dst
                                       for ch in chunks)
    verify_only = bool(spec_width) and not rows and bool(chunks) and max(lens) <= spec_width
    return StepBatch(tokens=tokens, slot_mapping=slot, cu_seqlens=cu, kv_lens=kv_lens, block_tables=bt,
                     state_src=src, state_dst=dst, ckpt_dst=ckpt, logits_indices=logits_idx, decode_only=decode_only,
                     mm_embeds=mm_embeds, mm_mask=mm_mask, spec_dst=spec_dst, verify_only=verify_only)
