"""Paged absorbed-MLA decode on Mosaic GPU (Hopper wgmma + TMA), for 64+ query heads.

The decode-only MLA kernel on Hopper (the backend's ``mla_decode``: auto|mosaic|triton, pallas_kernels/backend.py).
Checked on the GPU by `python -m benchmarks.bench_kernels --only mla_mosaic` (matches the reference as
closely as the Triton kernel); tests/kernels/test_mla_mosaic_gpu.py runs it in Mosaic GPU's interpret mode on CPU and checks
that the GPU lowering (Pallas -> Mosaic GPU MLIR) succeeds. Decode only: one query token per sequence.

One CTA = (sequence, 64 query heads, key split), three warpgroups:
  WG2 (producer): TMA-copies the 64-head query tile [64, L+R] once, then the cache block by block
    (``bk`` keys, one TMA per page or part of a page, following the block table) into a ring of
    ``stages`` shared-memory buffers; a unit wholly past the sequence's end copies zeros instead.
  WG0 / WG1 (consumers): the scores S = Q K^T [64, bk] are split over the contraction (WG0 columns
    [0, 288), WG1 [288, 576), whole swizzle tiles); each writes its fp32 partial to shared
    memory and adds the other's (a 2-arrival barrier, double-buffered by block parity). Both then
    run the same base-2 online softmax (fp32 m / l) and accumulate O[:, half] += P V[:, half] on
    wgmma (P bf16 from registers), WG0 output columns [0, L/2), WG1 [L/2, L): a [64, 256]
    fp32 accumulator a warpgroup (128 registers a thread), FlashMLA's split of the output.
Heads are the wgmma M dimension: H=96 runs as two 64-row tiles, the second half padding (zero
queries). Per split the normalised output (q dtype) and fp32 (m, l) are written in
triton_kernel.combine_splits' format, which merges the splits. The grid holds the key splits of a lone
sequence of the bucket (plan); a step uses those its live sequences fill the SMs with (plan_live, an int32
input read on the device), and the CTAs of the other splits exit at once.

Shared memory at L+R = 576, bk = 32, 3 stages: Q 72 KiB + ring 108 KiB + score exchange 32 KiB
= 212.5 KiB of the H200's 227 (P stays in registers: wgmma's register A operand). The query tile and
the ring are swizzled 64 bytes wide (bk = 32): wgmma needs P V's K (= bk) to be a multiple of the
swizzle's elements and both operands' swizzles equal; bk = 64 with its 128-byte swizzle does not fit
next to the score exchange.
Unused cache slots: pages past a sequence's end are never read (zeros are copied instead); the
slots of its last copied unit past kv_len are read and masked out of the scores, so they must be
finite (0 * NaN in P V): the engine's pools are zero-initialised and only ever hold written rows.

Interpret mode (jax 0.10.2's Mosaic GPU interpreter) lacks wgmma on a transposed operand and
``pl.run_state``: there the two products go through `_scores` / `_accumulate`'s interpret branch
(the same contraction from the shared-memory refs: jnp.dot, and wgmma into a fresh accumulator
added to the carried one), the other warpgroup's partial scores are read with ``ref[...]``
(no ``plgpu.load``) and register layouts are left to the interpreter (no layout_cast). Everything
else (TMA ring, barriers, warpgroups, softmax, split-K) is the kernel that lowers for the GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.mla.reference import decode_row_positions
from pallas_kernels.mla.splits import decode_splits, live_seqs, live_splits, split_range

_LOG2E = math.log2(math.e)
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp2(MASK - MASK) is 1, never NaN
ROWS = 64            # query heads per CTA: the wgmma M dimension of one warpgroup
MIN_HEADS = 64       # below this the Triton keys-on-M kernel is the better fit (docs/performance.md)
SMEM_LIMIT = 227 * 1024


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
    """The kernel's tiling knobs. bk: keys per block (16 or 32: the fp32 score exchange is swizzled bk
    wide and holds <= 128 bytes a row, and bk 64's ring does not fit next to it); stages: buffers of the
    cache ring (smem_bytes <= SMEM_LIMIT: 3 at bk 32, up to 7 at bk 16); splits: key splits per
    (sequence, head tile) (None: plan's wave-quantised choice); slots: the SMs plan fills (None: the
    device's)."""
    bk: int = 32
    stages: int = 3
    splits: int | None = None
    slots: int | None = None

    def label(self) -> str:
        extra = "".join(f" {k} {v}" for k, v in (("splits", self.splits), ("slots", self.slots)) if v is not None)
        return f"bk{self.bk} st{self.stages}{extra}"


DEFAULT_TILING = MosaicTiling()
DEFAULTS = {"bk": DEFAULT_TILING.bk, "stages": DEFAULT_TILING.stages}
# Tilings found faster than DEFAULT_TILING by bench_kernels' Mosaic sweep rows, by (query heads padded to
# whole 64-row tiles, page size, max keys >= LONG_KEYS): the decode steps of models without a config.
TUNED: dict = {}
LONG_KEYS = 65536


def as_tiling(config) -> MosaicTiling | None:
    """A MosaicTiling from a MosaicTiling, a dict or hashable (key, value) pairs; None stays None."""
    if config is None or isinstance(config, MosaicTiling):
        return config
    return MosaicTiling(**dict(config))


def tiling_for(num_heads, page_size, max_keys, lat, rope) -> MosaicTiling:
    """TUNED's tiling for this step where it has one and it fits the shapes, else DEFAULT_TILING."""
    t = TUNED.get((-(-num_heads // ROWS) * ROWS, page_size, max_keys >= LONG_KEYS), DEFAULT_TILING)
    try:
        check_shapes(lat, rope, t.bk, t.stages, page_size)
    except ValueError:
        return DEFAULT_TILING
    return t


def _plgpu():
    """jax.experimental.pallas.mosaic_gpu, imported on first use (its import pulls in the Mosaic GPU
    dialect; this module must import on any jax the package supports)."""
    from jax.experimental.pallas import mosaic_gpu
    return mosaic_gpu


def interpret_params(**kw):
    """Mosaic GPU interpret mode's parameters (private in jax 0.10-0.11: no public alias yet)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:  # pragma: no cover - depends on the jax version
        raise RuntimeError(f"this jax ({jax.__version__}) has no Mosaic GPU interpret mode") from e
    return InterpretGPUParams(**kw)


def _swizzled(plgpu, dtype, row_elems):
    """Tiling + swizzle transforms for a smem buffer whose tiles are row_elems wide (swizzle =
    the tile row's bytes, at most 128)."""
    row_bytes = min(128, row_elems * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, row_bytes // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(row_bytes))


def smem_bytes(width, bk, stages, itemsize=2):
    """Shared memory of one CTA on the GPU: Q tile, cache ring, fp32 score exchange (2 WGs x 2
    parities), m / l (P stays in registers)."""
    return (ROWS * width + stages * bk * width) * itemsize + 4 * ROWS * bk * 4 + 2 * ROWS * 4


def tile_cols(bk, itemsize=2):
    """Columns of one swizzle tile of the query tile and the ring (swizzled by bk: 32 at bk = 32): the
    granularity of the contraction split, of wgmma's K and of the output columns."""
    return min(128, bk * itemsize) // itemsize


def contraction_split(width, bk):
    """WG0 contracts the scores over columns [0, split), WG1 over [split, width): halves in whole tiles."""
    tile = tile_cols(bk)
    return (width // tile + 1) // 2 * tile


def check_shapes(lat, rope, bk, stages, page_size):
    """ValueError unless the kernel's tiling covers these sizes."""
    width = lat + rope
    why = []
    if bk % 16 or bk < 16 or bk * 4 > 128 or (page_size % bk and bk % page_size):
        why.append(f"bk={bk}: a multiple of 16, <= 32, dividing or divided by the page size {page_size}")
    tile = tile_cols(bk)
    if width % tile or lat % (2 * tile) or lat // 2 > 256 or width // tile < 2:
        why.append(f"L={lat}, R={rope}: needs L+R and L/2 in whole {tile}-column tiles (>= 2) and L <= 512")
    if min(bk, page_size) % 8:
        why.append(f"page size {page_size}: copies of < 8 rows do not fit the 8-row smem tiles")
    if stages < 2:
        why.append(f"stages={stages}: needs >= 2")
    if smem_bytes(width, bk, stages) > SMEM_LIMIT:
        why.append(f"needs {smem_bytes(width, bk, stages)} bytes of shared memory (> {SMEM_LIMIT})")
    if why:
        raise ValueError("MLA Mosaic GPU decode: " + "; ".join(why))


def supports(num_heads, lat, rope, page_size, dtype, bk=DEFAULTS["bk"], stages=DEFAULTS["stages"]):
    """The kernel's tiling covers this decode step (the dispatch's test; the Triton kernel otherwise)."""
    if num_heads < MIN_HEADS or jnp.dtype(dtype).itemsize != 2:
        return False
    try:
        check_shapes(lat, rope, bk, stages, page_size)
    except ValueError:
        return False
    return True


def _load(plgpu, ref, layout):
    """ref's whole value in `layout` (jax 0.11 takes no index and deprecates one; 0.10 requires it)."""
    try:
        return plgpu.load(ref, layout=layout)
    except TypeError:
        return plgpu.load(ref, (), layout=layout)


def _scores(plgpu, a_ref, b_ref, shape, interpret):
    """a [M, K] @ b[N, K]^T in fp32 from shared memory (b transposed: wgmma's K-major B)."""
    if interpret:
        return jnp.dot(a_ref[...], b_ref[...].T, preferred_element_type=jnp.float32)

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a_ref, b_ref.T)
        return acc_ref[...]
    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _accumulate(plgpu, acc, p, p_ref, v_ref, interpret):
    """acc + p @ v: p [M, K] bf16 in registers (wgmma's register A operand; the interpreter takes only
    shared-memory operands, so there it goes through p_ref), v [K, N] in shared memory."""
    if interpret:
        p_ref[...] = p

        def fresh(acc_ref):
            plgpu.wgmma(acc_ref, p_ref, v_ref)
            return acc_ref[...]
        return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p, v_ref))(plgpu.ACC.init(acc))


def _kernel(q_ref, kv_ref, zeros_ref, bt_ref, lens_ref, live_ref, o_ref, m_ref, l_ref,
            q_smem, kv_smem, sx_smem, p_smem, ml_smem, q_bar, full_bar, used_bar, sx_bar, *,
            plgpu, lat, bk, stages, page_size, max_pages, splits, heads_padded, scale,
            interpret):
    seq = jax.lax.axis_index("seq")
    grp = jax.lax.axis_index("grp")
    split = jax.lax.axis_index("split")
    wg = jax.lax.axis_index("wg")
    width = q_smem.shape[-1]
    row0 = seq * heads_padded + grp * ROWS
    kv_len = lens_ref[seq]
    live = live_ref[0]      # the splits this step uses (<= splits)
    k_lo, k_hi = split_range(split, live, kv_len, bk)
    # A CTA past the live splits runs nothing, not even its warpgroups' register handoff (all skip it, so no
    # consumer waits on registers the producer never frees): no Q or cache copy, no MMA, no store. Its
    # partials are never written (combine_splits' `live` masks them). A live split without keys (a short
    # context) still runs: zero blocks, and it writes the neutral partials o = 0, l = 0.
    active = split < live
    n_blocks = jnp.maximum(pl.cdiv(k_hi - k_lo, bk), 0)
    unit = min(bk, page_size)          # rows of one TMA: a page, or the block's part of a page
    n_units = bk // unit

    @pl.when((wg == 2) & active)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, ROWS)], q_smem, q_bar.at[0])

        @pl.loop(0, n_blocks)
        def _block(i):
            stage = jax.lax.rem(i, stages)

            @pl.when(i >= stages)
            def _():
                plgpu.barrier_wait(used_bar.at[stage])

            for j in range(n_units):
                key0 = k_lo + i * bk + j * unit
                dst = kv_smem.at[stage, pl.ds(j * unit, unit)]
                page = bt_ref[seq, jnp.minimum(key0 // page_size, max_pages - 1)]
                off = jax.lax.rem(key0, page_size) if page_size > unit else 0

                @pl.when(key0 < k_hi)
                def _():
                    plgpu.copy_gmem_to_smem(kv_ref.at[page, pl.ds(off, unit)], dst, full_bar.at[stage])

                @pl.when(key0 >= k_hi)  # past the end: zeros, never the pool's unused pages
                def _():
                    plgpu.copy_gmem_to_smem(zeros_ref, dst, full_bar.at[stage])

        # wait for the consumers' last release of each stage: every phase of a barrier is observed
        # (the interpreter checks it; on the GPU it keeps the CTA alive until the ring is drained)
        for stage in range(stages):
            pl.when(stage < n_blocks)(lambda stage=stage: plgpu.barrier_wait(used_bar.at[stage]))

    split_col = contraction_split(width, bk)
    half = lat // 2
    qk_scale = scale * _LOG2E

    def consumer(w):
        plgpu.set_max_registers(232, action="increase")
        cols = pl.ds(0, split_col) if w == 0 else pl.ds(split_col, width - split_col)
        out_cols = pl.ds(w * half, half)
        plgpu.barrier_wait(q_bar.at[0])
        wgmma = plgpu.Layout.WGMMA
        cast = (lambda x, layout: x) if interpret else plgpu.layout_cast  # no layouts when interpreted
        m = cast(jnp.full((ROWS,), _MASK, jnp.float32), wgmma.reduce(1))
        l = cast(jnp.zeros((ROWS,), jnp.float32), wgmma.reduce(1))
        acc = cast(jnp.zeros((ROWS, half), jnp.float32), wgmma)
        col = (jax.lax.broadcasted_iota(jnp.int32, (ROWS, bk), 1) if interpret else
               plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 1, layout=wgmma))

        def block(i, carry):
            acc, m, l = carry
            stage = jax.lax.rem(i, stages)
            parity = jax.lax.rem(i, 2)
            plgpu.barrier_wait(full_bar.at[stage])
            s = _scores(plgpu, q_smem.at[:, cols], kv_smem.at[stage, :, cols], (ROWS, bk), interpret)
            sx_smem.at[w, parity][...] = s
            plgpu.barrier_arrive(sx_bar.at[parity])
            plgpu.barrier_wait(sx_bar.at[parity])
            other = sx_smem.at[1 - w, parity]  # the interpreter has no plgpu.load (load_p)
            s = s + (other[...] if interpret else _load(plgpu, other, wgmma))
            key = k_lo + i * bk + col
            s = jnp.where(key < k_hi, s * qk_scale, _MASK)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
            acc = _accumulate(plgpu, acc, p.astype(q_smem.dtype), None if p_smem is None else p_smem.at[w],
                              kv_smem.at[stage, :, out_cols], interpret)
            plgpu.barrier_arrive(used_bar.at[stage])
            return acc, m_new, l

        acc, m, l = jax.lax.fori_loop(0, n_blocks, block, (acc, m, l))
        o = acc / jax.lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])
        # Q is dead once both halves of the last score block are exchanged: stage the output there
        q_smem.at[:, out_cols][...] = o.astype(q_smem.dtype)
        if w == 0:
            ml_smem.at[0][...] = m
            ml_smem.at[1][...] = l
        plgpu.commit_smem()
        for r in range(0, ROWS, 8):  # one 8-row band of column tiles is contiguous in smem
            plgpu.copy_smem_to_gmem(q_smem.at[pl.ds(r, 8), out_cols],
                                    o_ref.at[split, pl.ds(row0 + r, 8), out_cols])
        if w == 0:
            plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[split, pl.ds(row0, ROWS)])
            plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[split, pl.ds(row0, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    pl.when((wg == 0) & active)(lambda: consumer(0))
    pl.when((wg == 1) & active)(lambda: consumer(1))


def mla_tiles_mosaic(q_rows, kv_pages, block_tables, kv_lens, *, lat, scale, heads_padded, splits,
                     bk, stages, interpret=False, live_splits=None):
    """Run the kernel. q_rows [N * heads_padded, L+R] (latent then rope; padded heads zero),
    kv_pages [P, page_size, L+R], block_tables [N, max_pages], kv_lens [N] (0: no keys).
    Returns per-split partials o [splits, N*heads_padded, L] (normalised, q dtype) and fp32 base-2
    m, l [splits, N*heads_padded] (triton_kernel.combine_splits' format). live_splits: int32 [1], the
    splits this step uses (default all): each row's keys are divided over those, and the grid's later splits
    are never written (combine_splits' `live` masks them). interpret: True, or the interpreter's parameters
    (interpret_params(detect_races=True), ...)."""
    plgpu = _plgpu()
    n_rows, width = q_rows.shape
    _, page_size, _ = kv_pages.shape
    n_seqs, max_pages = block_tables.shape
    check_shapes(lat, width - lat, bk, stages, page_size)
    assert n_rows == n_seqs * heads_padded, (n_rows, n_seqs, heads_padded)
    dt = q_rows.dtype
    unit = min(bk, page_size)
    kernel = functools.partial(
        _kernel, plgpu=plgpu, lat=lat, bk=bk, stages=stages, page_size=page_size,
        max_pages=max_pages, splits=splits, heads_padded=heads_padded,
        scale=float(scale), interpret=bool(interpret))
    f32 = jnp.float32
    scratch = [
        # wgmma wants both operands' swizzle equal and P V's K (= bk) a multiple of the swizzle's
        # elements: the query tile and the ring are swizzled by bk (64 bytes at bk = 32)
        plgpu.SMEM((ROWS, width), dt, transforms=_swizzled(plgpu, dt, bk)),
        plgpu.SMEM((stages, bk, width), dt, transforms=_swizzled(plgpu, dt, bk)),
        plgpu.SMEM((2, 2, ROWS, bk), f32, transforms=_swizzled(plgpu, f32, bk)),
        plgpu.SMEM((2, ROWS, bk), dt, transforms=_swizzled(plgpu, dt, bk)) if interpret else None,
        plgpu.SMEM((2, ROWS), f32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=bk // unit, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=2),
    ]
    out_type = [jax.ShapeDtypeStruct((splits, n_rows, lat), dt),
                jax.ShapeDtypeStruct((splits, n_rows), f32),
                jax.ShapeDtypeStruct((splits, n_rows), f32)]
    call = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch,
        grid=(n_seqs, heads_padded // ROWS, splits), grid_names=("seq", "grp", "split"),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=(interpret_params() if interpret is True else interpret) or None)
    zeros = jnp.zeros((unit, width), kv_pages.dtype)
    live = jnp.full((1,), splits, jnp.int32) if live_splits is None else live_splits.astype(jnp.int32).reshape(1)
    return call(q_rows, kv_pages, zeros, block_tables.astype(jnp.int32), kv_lens.astype(jnp.int32), live)


def plan(num_heads, max_keys, n_seqs, bk, splits=None, slots=None):
    """(heads_padded, splits): the grid's key splits (one 220 KiB CTA an SM). Unless `splits` is given, those
    of a lone sequence of the n_seqs-sequence bucket, up to a split a slot (splits.decode_splits); each step
    then uses those its live sequences fill the slots with (plan_live). Each sequence divides its own keys
    over the splits it uses (splits.split_range)."""
    heads_padded = -(-num_heads // ROWS) * ROWS
    n_blocks = max(1, -(-max_keys // bk))
    if splits is None:
        tiles = heads_padded // ROWS
        splits = decode_splits(n_seqs * tiles, tiles, n_blocks, _slots(slots))
    kps = -(-n_blocks // max(1, splits)) * bk
    return heads_padded, -(-max_keys // kps)


def plan_live(n_live, heads_padded, splits, tiling: MosaicTiling):
    """int32 [1]: the splits of plan's `splits` a step with n_live live sequences uses (splits.live_splits:
    their head tiles share the slots plan filled); None where the tiling names its splits (exactly those,
    all live)."""
    if tiling.splits is not None:
        return None
    return live_splits(n_live, splits, heads_padded // ROWS, _slots(tiling.slots))


def _slots(slots):
    from pallas_kernels.device_info import num_sms
    return slots or num_sms()


def token_rows_mosaic(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens, *, scale,
                      interpret=False, config=None):
    """ragged_paged_mla's token_rows form on the Mosaic kernel: every token a decode row of its own (its
    sequence's block table, its own position), split as a decode step of the N sequences would be."""
    seq, pos, valid = decode_row_positions(cu_seqlens, kv_lens, q_latent.shape[0])
    return mla_paged_decode_mosaic(q_latent, q_rope, kv_pages, block_tables[seq], jnp.where(valid, pos + 1, 0),
                                   scale=scale, interpret=interpret, config=config, plan_seqs=block_tables.shape[0],
                                   n_live=live_seqs(cu_seqlens.astype(jnp.int32)))


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config", "plan_seqs"))
def mla_paged_decode_mosaic(q_latent, q_rope, kv_pages, block_tables, kv_lens, *, scale,
                            interpret=False, config=None, plan_seqs=None, n_live=None):
    """Paged MLA decode, same contract as paged.mla_paged_decode: q_latent [N, H, L], q_rope [N, H, R],
    kv_pages [P, page_size, L+R] (16-bit), block_tables [N, max_pages], kv_lens [N] (the query sits at
    kv_lens - 1; 0 = padding sequence, zeros out). ``config``: a MosaicTiling or hashable (key, value)
    pairs of its fields (the fields not named: DEFAULT_TILING's); None: tiling_for's choice. plan_seqs: split
    the keys as a step of that many sequences would (default N); n_live (int32 scalar): of which that many
    are live, i.e. have a token (default: those of kv_lens > 0); the two fix the splits each row uses.
    Returns [N, H, L] in q_latent.dtype."""
    from pallas_kernels.mla.triton_kernel import combine_splits
    n_seqs, num_heads, lat = q_latent.shape
    _, page_size, width = kv_pages.shape
    t = as_tiling(config) or tiling_for(num_heads, page_size, block_tables.shape[1] * page_size, lat,
                                        width - lat)
    cfg = dataclasses.asdict(t)
    if jnp.dtype(kv_pages.dtype).itemsize != 2:
        raise ValueError(f"MLA Mosaic GPU decode: 16-bit caches only (wgmma bf16/f16), got {kv_pages.dtype}")
    if lat + q_rope.shape[-1] != width:
        raise ValueError(f"q widths {lat} + {q_rope.shape[-1]} != cache row width {width}")
    heads_padded, splits = plan(num_heads, block_tables.shape[1] * page_size, plan_seqs or n_seqs, cfg["bk"],
                                     cfg.get("splits"), cfg.get("slots"))
    q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(kv_pages.dtype)
    q = jnp.pad(q, ((0, 0), (0, heads_padded - num_heads), (0, 0))).reshape(n_seqs * heads_padded, width)
    live = plan_live(jnp.sum(kv_lens > 0) if n_live is None else n_live, heads_padded, splits, t)
    o, m, l = mla_tiles_mosaic(q, kv_pages, block_tables, kv_lens, lat=lat, scale=scale,
                               heads_padded=heads_padded, splits=splits,
                               bk=cfg["bk"], stages=cfg["stages"], interpret=interpret, live_splits=live)
    out = combine_splits(o, m, l, jnp.ones((n_seqs * heads_padded,), bool), live)
    return out.reshape(n_seqs, heads_padded, lat)[:, :num_heads].astype(q_latent.dtype)


def ragged_decode_mosaic(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens, *, scale,
                         interpret=False, config=None):
    """ragged_paged_mla's decode-only form (each sequence at most one token; token rows past
    cu_seqlens[N] are padding and get zeros) on the Mosaic kernel: tokens gathered to their
    sequences, the decode kernel, scattered back."""
    n_tok = q_latent.shape[0]
    if n_tok == 0:
        return jnp.zeros_like(q_latent)
    cu = cu_seqlens.astype(jnp.int32)
    has_tok = cu[1:] > cu[:-1]
    first = jnp.clip(cu[:-1], 0, n_tok - 1)
    lens = jnp.where(has_tok, kv_lens.astype(jnp.int32), 0)
    # live: the sequences with a token, as token_rows_mosaic counts them (its rows split as these do)
    o = mla_paged_decode_mosaic(q_latent[first], q_rope[first], kv_pages, block_tables, lens,
                                scale=scale, interpret=interpret, config=config, n_live=live_seqs(cu))
    dest = jnp.where(has_tok, cu[:-1], n_tok)  # sequences without a token write nowhere
    out = jnp.zeros_like(q_latent).at[dest].set(o, mode="drop")
    return out
