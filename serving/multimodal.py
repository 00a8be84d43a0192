"""Images inside a token prompt: placeholder expansion, prefix-cache keys, per-chunk embedding rows.

A rendered prompt holds one `<|media_pad|>` per image (k3jax.tokenizer.chat). Expansion
replaces each with as many pads as the image has tokens after the tower's patch merge; the
engine later swaps those positions' token embeddings for the tower's output. The pad ids
are all alike, so the image's content hash becomes an extra prefix-cache key of every unit
the image touches: two prompts with different images never share a cache entry.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
    """One preprocessed image placed in a prompt."""
    digest: str                  # content hash (k3jax.vision.media.image_digest)
    pixel_values: np.ndarray     # [patches, 3, p, p] float32
    grid_thw: tuple              # (1, h, w) in patches
    num_tokens: int              # placeholder tokens = embeddings the tower returns
    offset: int = -1             # prompt position of the first placeholder (set by expansion)
    size: Optional[tuple] = None  # (width, height) as uploaded: K3's image prompt names it

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def expand_image_placeholders(token_ids: Sequence[int], images: Sequence[ImageInput], pad_id: int):
    """(ids with each image's single pad widened to num_tokens pads, images with offsets set).
    Raises ValueError when the prompt's pads and the images do not pair up one to one."""
    ids = [int(t) for t in token_ids]
    pads = [i for i, t in enumerate(ids) if t == pad_id]
    if len(pads) != len(images):
        raise ValueError(f"the prompt has {len(pads)} image placeholders for {len(images)} images")
    out, placed, prev = [], [], 0
    for at, img in zip(pads, images):
        if img.num_tokens < 1:
            raise ValueError("an image must have at least one token")
        out += ids[prev:at]
        placed.append(dataclasses.replace(img, offset=len(out)))
        out += [pad_id] * img.num_tokens
        prev = at + 1
    out += ids[prev:]
    return out, placed


def image_extra_keys(images: Sequence[ImageInput], unit: int) -> dict:
    """{unit index: (image digests)} for every hash unit an image's placeholders fall in."""
    keys: dict = {}
    for img in images:
        for u in range(img.offset // unit, (img.end - 1) // unit + 1):
            keys.setdefault(u, ())
            keys[u] = keys[u] + (f"img:{img.digest}:{img.offset}",)
    return keys


def images_in(images: Sequence[ImageInput], start: int, end: int) -> list:
    """The images whose placeholders overlap token positions [start, end)."""
    return [img for img in images if img.offset < end and img.end > start]


def chunk_rows(images: Sequence[ImageInput], start: int, end: int, embeddings_of) -> list:
    """SeqChunk.mm rows for positions [start, end): [(offset in the chunk, embeddings)].
    embeddings_of(image) -> [num_tokens, D]."""
    rows = []
    for img in images_in(images, start, end):
        lo, hi = max(start, img.offset), min(end, img.end)
        emb = embeddings_of(img)
        if emb.shape[0] != img.num_tokens:
            raise ValueError(f"image {img.digest[:12]}: {emb.shape[0]} embeddings for {img.num_tokens} placeholders")
        rows.append((lo - start, np.asarray(emb[lo - img.offset:hi - img.offset])))
    return rows
