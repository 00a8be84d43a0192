"""Host-side (numpy) index math for a packed batch of images: everything that depends on grid_thw.

Patches of all images are concatenated, each image row-major over its (h, w) patch grid and,
for a clip of t frames, frame-major (transformers' / Moonshot's order). For each patch:
- `pos_index`/`pos_weight` [N, taps]: the resampled learned position table as a weighted gather
  (taps 16 for bicubic, 4 for bilinear), equal to `F.interpolate(table, (h, w), align_corners=False)`;
- `time_index` [N]: row of the fixed temporal sinusoid table (0 = none: images, padding);
- `rope_hw` [N, 2]: (row, col) of the patch in its image, for the 2D rotary embedding;
- `segment_ids` [N]: image index, -1 for padding (block-diagonal attention);
- `merge_dest`/`merge_weight` [N]: destination row `token * kh*kw + position_in_kernel` of the
  kh x kw merge (mean over frames, so weight 1/t); padding points past the end and is dropped.
Padding to a bucket keeps every shape static, so one compiled `encode_images` serves many batches.
"""
from __future__ import annotations

import dataclasses

import numpy as np

import jax

from k3jax.vision.config import VisionConfig


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int, mode: str):
    """Per-axis taps into a `side`-long table and their weights for targets `index` of `size`.

    float32 throughout, in transformers' order of operations (`_interpolation_axis_taps_weights`),
    so the weights match theirs to the last bit on the same inputs.
    """
    index = index.astype(np.float32)
    size = size.astype(np.float32)
    src = (index + np.float32(0.5)) * np.float32(side) / size - np.float32(0.5)  # half-pixel centres
    floor = np.floor(src)
    offsets = np.arange(-1, 3) if mode == "bicubic" else np.arange(0, 2)
    raw = floor.astype(np.int64)[:, None] + offsets
    taps = np.clip(raw, 0, side - 1)                 # border padding, like F.interpolate
    d = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32)).astype(np.float32)
    if mode == "bilinear":
        w = np.maximum(np.float32(1) - d, np.float32(0))
    else:                                            # Keys cubic kernel, a = -0.75 (as torch)
        a = np.float32(-0.75)
        near = ((a + 2) * d - (a + 3)) * d * d + 1
        far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
        w = np.where(d <= 1, near, far)
    return taps, w.astype(np.float32)


def interpolation_taps(rows: np.ndarray, cols: np.ndarray, heights: np.ndarray, widths: np.ndarray,
                       table_hw: tuple[int, int], mode: str):
    """Gather indices into the flattened [H*W] table and weights, [N, taps] each."""
    th, tw = table_hw
    h_taps, h_w = _axis_taps(rows, heights, th, mode)
    w_taps, w_w = _axis_taps(cols, widths, tw, mode)
    n = h_taps.shape[1]
    idx = (h_taps[:, :, None] * tw + w_taps[:, None, :]).reshape(-1, n * n)
    wts = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, n * n)
    return idx.astype(np.int32), wts.astype(np.float32)


def time_table(dim: int, frames: int) -> np.ndarray:
    """[frames + 1, dim]: row 0 zero (single images), row f + 1 = [sin | cos](f * omega)."""
    omega = 1.0 / 10000 ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    ang = np.outer(np.arange(frames, dtype=np.float32), omega.astype(np.float32))
    return np.concatenate([np.zeros((1, dim), np.float32),
                           np.concatenate([np.sin(ang), np.cos(ang)], axis=1)]).astype(np.float32)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class VisionBatch:
    """Per-patch index arrays (the pytree's leaves) plus host-only bookkeeping (not traced)."""

    pos_index: np.ndarray      # [N, taps] int32
    pos_weight: np.ndarray     # [N, taps] float32
    time_index: np.ndarray     # [N] int32
    rope_hw: np.ndarray        # [N, 2] int32
    segment_ids: np.ndarray    # [N] int32, -1 = padding
    merge_dest: np.ndarray     # [N] int32, >= num_output_rows * kh*kw for padding (dropped)
    merge_weight: np.ndarray   # [N] float32
    # Host-only (dropped when flattened, so jit never retraces on them):
    grid_thw: np.ndarray | None = None
    tokens_per_image: tuple[int, ...] | None = None

    _ARRAYS = ("pos_index", "pos_weight", "time_index", "rope_hw", "segment_ids", "merge_dest", "merge_weight")

    def tree_flatten(self):
        return tuple(getattr(self, k) for k in self._ARRAYS), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def padded_patches(self) -> int:
        return int(self.segment_ids.shape[0])

    @property
    def num_patches(self) -> int:
        """Real (unpadded) patches."""
        return int(np.sum(np.asarray(self.segment_ids) >= 0))

    @property
    def num_tokens(self) -> int:
        """Real merged tokens (the first rows of encode_images' output)."""
        return int(sum(self.tokens_per_image))

    @property
    def token_offsets(self) -> tuple[int, ...]:
        """Start row of each image's tokens in encode_images' output."""
        return tuple(int(x) for x in np.cumsum((0,) + tuple(self.tokens_per_image))[:-1])


def check_grid_thw(vcfg: VisionConfig, grid_thw) -> np.ndarray:
    g = np.asarray(grid_thw)
    if g.ndim != 2 or g.shape[1] != 3 or g.shape[0] == 0:
        raise ValueError(f"grid_thw must be [n_images, 3] with n_images >= 1, got shape {g.shape}")
    if not np.issubdtype(g.dtype, np.integer):
        raise ValueError(f"grid_thw must be integers, got {g.dtype}")
    kh, kw = vcfg.merge_kernel
    for i, (t, h, w) in enumerate(g.tolist()):
        if t < 1 or h < 1 or w < 1:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: every entry must be >= 1")
        if h % kh or w % kw:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: h and w must be multiples of the merge "
                             f"kernel {vcfg.merge_kernel}")
        if t > vcfg.pos_emb_time:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: {t} frames exceed the {vcfg.pos_emb_time} "
                             f"the temporal embedding covers")
    return g.astype(np.int64)


def tokens_per_image(vcfg: VisionConfig, grid_thw) -> list[int]:
    """Merged tokens (placeholder count) per image/clip: (h/kh) * (w/kw); frames are averaged."""
    g = check_grid_thw(vcfg, grid_thw)
    return [int(h // vcfg.merge_kernel[0] * (w // vcfg.merge_kernel[1])) for _, h, w in g.tolist()]


def prepare_vision_batch(vcfg: VisionConfig, grid_thw, pad_patches_to: int | None = None) -> VisionBatch:
    """All data-dependent indices for one packed encode_images call (numpy, static shapes).

    `pad_patches_to` (>= total patches) pads to a bucket; the output then has
    pad_patches_to // (kh*kw) rows, of which the first `num_tokens` are real.
    """
    g = check_grid_thw(vcfg, grid_thw)
    t, h, w = g[:, 0], g[:, 1], g[:, 2]
    counts = t * h * w
    n = int(counts.sum())
    n_pad = n if pad_patches_to is None else int(pad_patches_to)
    if n_pad < n:
        raise ValueError(f"pad_patches_to = {pad_patches_to} is less than the {n} patches of this batch")
    kh, kw = vcfg.merge_kernel
    k = kh * kw
    tokens = (h // kh) * (w // kw)
    n_out = n_pad // k

    img = np.repeat(np.arange(len(g)), counts)
    start = np.repeat(np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    local = np.arange(n) - start                        # index within its clip
    hh, ww = h[img], w[img]
    frame = local // (hh * ww)
    within = local % (hh * ww)
    row, col = within // ww, within % ww

    idx, wts = interpolation_taps(row, col, hh, ww, (vcfg.pos_emb_height, vcfg.pos_emb_width), vcfg.pos_interp)
    tokens_before = np.concatenate([[0], np.cumsum(tokens)[:-1]])[img]
    token = tokens_before + (row // kh) * (ww // kw) + col // kw
    dest = token * k + (row % kh) * kw + col % kw

    def pad(a, value):
        width = [(0, n_pad - n)] + [(0, 0)] * (a.ndim - 1)
        return np.pad(a, width, constant_values=value)

    return VisionBatch(
        pos_index=pad(idx, 0).astype(np.int32),
        pos_weight=pad(wts, 0).astype(np.float32),
        time_index=pad(np.where(t[img] > 1, frame + 1, 0), 0).astype(np.int32),
        rope_hw=pad(np.stack([row, col], axis=1), 0).astype(np.int32),
        segment_ids=pad(img, -1).astype(np.int32),
        merge_dest=pad(dest, n_out * k).astype(np.int32),
        merge_weight=pad((1.0 / t[img]).astype(np.float32), 0).astype(np.float32),
        grid_thw=g,
        tokens_per_image=tuple(int(x) for x in tokens),
    )


def pad_pixel_values(pixel_values: np.ndarray, vbatch: VisionBatch) -> np.ndarray:
    """Zero-pad [num_patches, 3, p, p] pixels to the batch's padded patch count."""
    n = pixel_values.shape[0]
    if n != vbatch.num_patches:
        raise ValueError(f"pixel_values has {n} patches, grid_thw describes {vbatch.num_patches}")
    extra = vbatch.padded_patches - n
    return np.pad(pixel_values, [(0, extra)] + [(0, 0)] * (pixel_values.ndim - 1)) if extra else pixel_values
