"""Image -> (pixel_values [P, 3, p, p] float32, grid_thw [n, 3] int64), as transformers'
Kimi_K25ImageProcessor computes them on CPU.

Per image (navit_resize): scale = min(1, sqrt(max_patches / (max(1, H//p) * max(1, W//p))),
max_patches_per_side*p / H, max_patches_per_side*p / W); new size = max(1, int(side * scale))
capped at max_patches_per_side*p; resize (bicubic, antialiased) only when the size changes;
zero-pad right/bottom to a multiple of merge*p; normalize; cut p x p patches row-major over
the (H/p, W/p) grid. grid_thw = (1, H/p, W/p); the tower merges 2x2 patches into one token.

The resize reproduces what transformers runs: torchvision's uint8 resize on CPU, which is
torch's antialiased separable filter in fixed point (int16 weights at a per-axis precision,
horizontal pass then vertical, each rounded to uint8), bit for bit. Pillow's own bicubic
(what Moonshot's original media_utils.py calls) differs by a level or two on some pixels;
resize_backend="pil" selects it.
Normalization follows transformers' fused form: (x - mean*255) / (std*255) in float32.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

PREPROCESSOR_CONFIG = "preprocessor_config.json"
_RESAMPLE_NAMES = {2: "bilinear", 3: "bicubic", "bilinear": "bilinear", "bicubic": "bicubic"}


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """Kimi_K25ImageProcessor's settings (defaults are that class's)."""
    patch_size: int = 14
    merge_size: int = 2                   # merge_kernel_size: 2x2 patches -> one token
    max_patches: int = 16384              # in_patch_limit: patches per image before merging
    max_patches_per_side: int = 512       # size.max_height / patch_limit_on_one_side
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: str = "bicubic"             # or "bilinear"
    resize_backend: str = "torch"         # "torch": transformers-exact; "pil": Pillow's filter

    def __post_init__(self):
        for name in ("patch_size", "merge_size", "max_patches", "max_patches_per_side"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        object.__setattr__(self, "image_mean", tuple(float(x) for x in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(x) for x in self.image_std))
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std need three values (R, G, B)")
        if any(s == 0 for s in self.image_std):
            raise ValueError("image_std values must be non-zero")
        if self.resample not in ("bicubic", "bilinear"):
            raise ValueError(f"resample must be 'bicubic' or 'bilinear', got {self.resample!r}")
        if self.resize_backend not in ("torch", "pil"):
            raise ValueError(f"resize_backend must be 'torch' or 'pil', got {self.resize_backend!r}")
        if not self.rescale_factor > 0:
            raise ValueError("rescale_factor must be positive")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ImageProcessorConfig":
        """From a preprocessor_config.json dict: transformers' keys (patch_size, merge_size,
        max_patches, size.max_height, ...) or Moonshot's media_proc_cfg (in_patch_limit,
        merge_kernel_size, patch_limit_on_one_side, ...). Unknown keys are ignored."""
        d = dict(d)
        for nested in ("media_proc_cfg", "image_processor"):
            if isinstance(d.get(nested), Mapping):
                d = {**d, **d[nested]}
        kw: dict = {}
        aliases = {"patch_size": "patch_size", "merge_size": "merge_size", "merge_kernel_size": "merge_size",
                   "max_patches": "max_patches", "in_patch_limit": "max_patches",
                   "patch_limit_on_one_side": "max_patches_per_side", "max_patches_per_side": "max_patches_per_side",
                   "image_mean": "image_mean", "image_std": "image_std", "rescale_factor": "rescale_factor",
                   "do_resize": "do_resize", "do_rescale": "do_rescale", "do_normalize": "do_normalize",
                   "resize_backend": "resize_backend"}
        for key, field in aliases.items():
            if d.get(key) is not None:
                kw[field] = d[key]
        if isinstance(kw.get("merge_size"), (list, tuple)):   # (2, 2) in some configs
            sizes = set(kw["merge_size"])
            if len(sizes) != 1:
                raise ValueError(f"non-square merge kernel {kw['merge_size']} is not supported")
            kw["merge_size"] = sizes.pop()
        size = d.get("size")
        if isinstance(size, Mapping) and size.get("max_height") is not None:
            if size.get("max_height") != size.get("max_width"):
                raise ValueError(f"size needs equal max_height and max_width, got {dict(size)}")
            kw["max_patches_per_side"] = size["max_height"]
        if d.get("resample") is not None:
            r = d["resample"]
            key = r.lower() if isinstance(r, str) else int(r)
            if key not in _RESAMPLE_NAMES:
                raise ValueError(f"unsupported resample {r!r} (bicubic or bilinear)")
            kw["resample"] = _RESAMPLE_NAMES[key]
        for name in ("patch_size", "merge_size", "max_patches", "max_patches_per_side"):
            if name in kw and isinstance(kw[name], float) and kw[name].is_integer():
                kw[name] = int(kw[name])
        return cls(**kw)

    @classmethod
    def from_checkpoint_dir(cls, path: str | os.PathLike) -> "ImageProcessorConfig":
        """From <path>/preprocessor_config.json, or the defaults when the file is absent."""
        f = os.path.join(os.fspath(path), PREPROCESSOR_CONFIG)
        if not os.path.isfile(f):
            return cls()
        with open(f, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))


# ------------------------------------------------------------------------------ sizes, tokens

def resize_plan(height: int, width: int, config: ImageProcessorConfig | None = None):
    """((new_h, new_w), (padded_h, padded_w)) for an image of height x width (navit_resize)."""
    c = config or ImageProcessorConfig()
    p, side = c.patch_size, c.max_patches_per_side
    if not c.do_resize:
        return (height, width), (height, width)
    num_h = max(1.0, height // p)
    num_w = max(1.0, width // p)
    scale = min(1.0, math.sqrt(c.max_patches / (num_h * num_w)), side * p / height, side * p / width)
    new_h = min(max(1, int(height * scale)), side * p)
    new_w = min(max(1, int(width * scale)), side * p)
    f = c.merge_size * p
    return (new_h, new_w), (new_h + (f - new_h % f) % f, new_w + (f - new_w % f) % f)


def grid_for_size(height: int, width: int, config: ImageProcessorConfig | None = None) -> tuple:
    """(1, grid_h, grid_w) in patches for an image of height x width, without any pixels."""
    c = config or ImageProcessorConfig()
    _, (ph, pw) = resize_plan(height, width, c)
    return (1, ph // c.patch_size, pw // c.patch_size)


def num_image_tokens(grid_thw, merge_size: int = 2) -> int:
    """Placeholder tokens of one image: t*h*w // merge^2 (transformers' replace_image_token)."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // (merge_size * merge_size)


# The text a K2.5-style chat template puts around one image; processing_kimi_k25 then widens
# the single <|media_pad|> into num_image_tokens pads.
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = (
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")


def image_placeholder_text(num_tokens: int, *, original_size: tuple | None = None) -> str:
    """<|media_begin|>image<|media_content|><|media_pad|>*N<|media_end|>. With original_size=(w, h)
    the label reads "image {w}x{h}" (the framing sglang's Kimi-K3 processor emits)."""
    if num_tokens < 1:
        raise ValueError("an image needs at least one placeholder token")
    label = "image" if original_size is None else f"image {int(original_size[0])}x{int(original_size[1])}"
    return f"{MEDIA_BEGIN}{label}{MEDIA_CONTENT}" + MEDIA_PAD * num_tokens + MEDIA_END


def image_placeholder_ids(num_tokens: int, tokenizer, *, original_size: tuple | None = None) -> list:
    """Token ids of image_placeholder_text; tokenizer needs id_of(special) and encode(text)
    (k3jax.tokenizer.KimiTokenizer)."""
    if num_tokens < 1:
        raise ValueError("an image needs at least one placeholder token")
    label = "image" if original_size is None else f"image {int(original_size[0])}x{int(original_size[1])}"
    return ([tokenizer.id_of(MEDIA_BEGIN)] + list(tokenizer.encode(label)) + [tokenizer.id_of(MEDIA_CONTENT)]
            + [tokenizer.id_of(MEDIA_PAD)] * num_tokens + [tokenizer.id_of(MEDIA_END)])


# ------------------------------------------------------------------------------ resize

def _int16_weights(in_size: int, out_size: int, resample: str):
    """(first input index [out], int weights [out, taps], precision bits) of torch's
    antialiased uint8 resize along one axis (align_corners=False, no explicit scale)."""
    interp = 4 if resample == "bicubic" else 2
    scale = in_size / out_size
    support = interp * 0.5 * scale if scale >= 1.0 else interp * 0.5
    taps = int(math.ceil(support)) * 2 + 1
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)   # C++ int cast
    count = np.minimum(np.trunc(center + support + 0.5), in_size).astype(np.int64) - first
    j = np.arange(taps, dtype=np.int64)
    x = np.abs((j[None, :] + first[:, None] - center[:, None] + 0.5) * inv)
    if resample == "bicubic":   # Keys' cubic with a = -0.5, as torch and PIL; same operation order
        a = -0.5
        w = np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0,
                     np.where(x < 2.0, ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a, 0.0))
    else:
        w = np.where(x < 1.0, 1.0 - x, 0.0)
    w = np.where(j[None, :] < count[:, None], w, 0.0)
    total = np.cumsum(w, axis=1)[:, -1:]                # sequential sum, as the C++ loop
    w = np.where(total != 0.0, w / np.where(total != 0.0, total, 1.0), w)
    w_max = w.max()
    prec = 0                                            # largest precision keeping weights in int16
    while prec < 22 and int(0.5 + w_max * (1 << (prec + 1))) < (1 << 15):
        prec += 1
    k = np.trunc(w * (1 << prec) + np.where(w < 0, -0.5, 0.5)).astype(np.int32)
    return first, k, prec


def _resize_axis0(a: np.ndarray, out_size: int, resample: str, use_scipy: bool = True) -> np.ndarray:
    """Resize uint8 a along axis 0 with torch's fixed-point antialiased filter.

    Integer sums are exact in any order, so a sparse (out x in) weight matrix times the
    image gives the same bytes as torch's loops. |sum| <= 255 * sum|k| < 255 * 1.3 * 2**22
    < 2**31, so int32 cannot overflow."""
    in_size = a.shape[0]
    first, k, prec = _int16_weights(in_size, out_size, resample)
    offset = np.int32(1 << (prec - 1) if prec else 0)
    flat = np.ascontiguousarray(a).reshape(in_size, -1)
    out = np.empty((out_size, flat.shape[1]), np.uint8)
    cols = first[:, None] + np.arange(k.shape[1])
    used = (k != 0) & (cols < in_size)
    sparse = None
    if use_scipy:
        try:
            import scipy.sparse as sparse   # a jax dependency; ~3x faster than the tap loop
        except ImportError:
            pass
    if sparse is not None:
        rows = np.broadcast_to(np.arange(out_size)[:, None], k.shape)
        m = sparse.csr_matrix((k[used], (rows[used], cols[used])), shape=(out_size, in_size))
        step = max(1, (1 << 20) // in_size)   # bounded int32 temporaries
        for c0 in range(0, flat.shape[1], step):
            acc = m @ flat[:, c0:c0 + step].astype(np.int32)
            acc += offset
            out[:, c0:c0 + step] = np.clip(acc >> prec, 0, 255)
    else:
        acc = np.full((out_size, flat.shape[1]), offset, np.int32)
        for j in range(k.shape[1]):
            kj = np.where(used[:, j], k[:, j], 0)
            acc += flat[np.minimum(first + j, in_size - 1)].astype(np.int32) * kj[:, None]
        out[:] = np.clip(acc >> prec, 0, 255)
    return out.reshape((out_size,) + a.shape[1:])


def resize_uint8(img: np.ndarray, height: int, width: int, resample: str = "bicubic") -> np.ndarray:
    """HWC uint8 -> height x width, bit-identical to torch.nn.functional.interpolate(uint8,
    mode=resample, antialias=True) on CPU (what torchvision's resize runs for uint8)."""
    h, w = img.shape[:2]
    if (h, w) == (height, width):
        return img
    out = img
    if width != w:      # horizontal pass first, as torch does
        out = _resize_axis0(np.swapaxes(out, 0, 1), width, resample).swapaxes(0, 1)
    if height != h:
        out = _resize_axis0(out, height, resample)
    return np.ascontiguousarray(out)


# ------------------------------------------------------------------------------ preprocess

def _as_rgb_array(image) -> np.ndarray:
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"array images must be uint8 [H, W, 3], got {image.dtype} {image.shape}")
        return image
    from k3jax.vision.media import to_rgb   # lazy: Pillow stays off the model import path
    return np.asarray(to_rgb(image))


def _normalize_lut(c: ImageProcessorConfig) -> np.ndarray:
    """[3, 256] float32: the normalized value of each byte per channel, computed with the
    float32 operations transformers' TorchvisionBackend runs."""
    x = np.arange(256, dtype=np.float32)[None, :].repeat(3, 0)
    mean = np.asarray(c.image_mean, np.float32)[:, None]
    std = np.asarray(c.image_std, np.float32)[:, None]
    if c.do_normalize:
        if c.do_rescale:   # fused: mean and std scaled by 1/rescale_factor in float32
            inv = np.float32(1.0 / c.rescale_factor)
            mean, std = mean * inv, std * inv
        return (x - mean) / std
    if c.do_rescale:
        return x * np.float32(c.rescale_factor)
    return x


def preprocess(images: Sequence, config: ImageProcessorConfig | None = None):
    """(pixel_values float32 [sum of patches, 3, p, p], grid_thw int64 [n, 3]).

    images: PIL images (any mode; converted like media.to_rgb) or uint8 [H, W, 3] arrays.
    Patches of image i follow those of image i-1, each row-major over its (h, w) grid."""
    c = config or ImageProcessorConfig()
    p = c.patch_size
    lut = _normalize_lut(c)
    chunks, grids = [], []
    for image in images:
        arr = _as_rgb_array(image)
        h, w = arr.shape[:2]
        (nh, nw), (ph, pw) = resize_plan(h, w, c)
        if (nh, nw) != (h, w):
            if c.resize_backend == "pil":
                from PIL import Image
                flt = Image.Resampling.BICUBIC if c.resample == "bicubic" else Image.Resampling.BILINEAR
                arr = np.asarray(Image.fromarray(arr).resize((nw, nh), flt))
            else:
                arr = resize_uint8(arr, nh, nw, c.resample)
        if (ph, pw) != (nh, nw):
            padded = np.zeros((ph, pw, 3), np.uint8)     # zero bytes, normalized like pixels
            padded[:nh, :nw] = arr
            arr = padded
        if ph % p or pw % p:
            raise ValueError(f"image size {ph}x{pw} is not a multiple of patch size {p} (do_resize=False?)")
        gh, gw = ph // p, pw // p
        patches = arr.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3)   # [gh, gw, 3, p, p]
        out = np.empty((gh * gw, 3, p, p), np.float32)
        patches = patches.reshape(gh * gw, 3, p, p)
        for ch in range(3):
            out[:, ch] = lut[ch][patches[:, ch]]
        chunks.append(out)
        grids.append((1, gh, gw))
    if not chunks:
        return np.zeros((0, 3, p, p), np.float32), np.zeros((0, 3), np.int64)
    return np.concatenate(chunks, axis=0), np.asarray(grids, dtype=np.int64)
