"""The vision tower inside the engine: packed, bucketed, compiled once per bucket, outputs cached.

Images a step needs (the scheduler's `encode` list, already within the encoder budget) are
packed into as few tower calls as the largest patch bucket allows; each call is padded to a
power-of-two patch count so only a handful of shapes ever compile (all during warm-up). The
embeddings land in an EncoderCache keyed by image digest, in the model's dtype, ready to be
sliced into step batches.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import jax
import numpy as np

from serving.encoder_cache import EncoderCache
from serving.runner import CompileAfterWarmupError

log = logging.getLogger(__name__)


def patch_buckets(largest: int, merge: int, smallest: int = 64) -> list:
    """Powers of two (multiples of the merge kernel) from `smallest` up to one holding `largest`."""
    b, out = max(smallest, merge), []
    while True:
        out.append(b)
        if b >= largest:
            return out
        b *= 2


class VisionEncoder:
    def __init__(self, vision, *, cache_bytes: int, out_dtype, mesh=None, max_patches: int | None = None):
        from k3jax.layers.module import split_module
        from k3jax.vision.tower import stack_blocks, tower_of
        self.vision = vision
        self.config = cfg = vision.config
        self.pad_id = vision.pad_id
        self.out_dtype = np.dtype(out_dtype)
        self.cache = EncoderCache(cache_bytes)
        largest = max_patches or vision.max_patches
        self.buckets = patch_buckets(largest, cfg.merge_size)
        tower = tower_of(stack_blocks(vision.params), cfg)     # the layers run under one scan: one compiled block
        # The tower declares its parameters replicated (small next to the LLM). Multi-host: it runs on
        # process 0's own device only, and its embeddings reach the other processes in the step batch
        # (serving/multihost.py).
        if mesh is not None and jax.process_count() == 1:
            from sharding.rules import shard_vision
            tower = shard_vision(tower, mesh)
        graph, self.params = split_module(tower)               # split once; merged inside the trace
        self._fn = jax.jit(lambda p, px, vb: graph.merge(p)(px, vb))
        self.guard = False
        self._seen: set = set()
        self.counters = {"encoded_images": 0, "encoded_tokens": 0, "encoder_time": 0.0}

    # ------------------------------------------------------------------ compile accounting
    def _bucket(self, patches: int) -> int:
        for b in self.buckets:
            if b >= patches:
                break
        if b < patches:
            raise ValueError(f"an image of {patches} patches exceeds the largest encoder bucket {self.buckets[-1]}")
        if b not in self._seen:
            if self.guard:
                raise CompileAfterWarmupError(f"vision bucket {b} was not compiled during warm-up")
            self._seen.add(b)
        return b

    def warmup(self):
        from k3jax.vision.positions import prepare_vision_batch
        t0 = time.perf_counter()
        kh, kw = self.config.merge_kernel
        for b in self.buckets:
            self._bucket(b)
            vb = prepare_vision_batch(self.config, [(1, kh, kw)], pad_patches_to=b)
            px = np.zeros((b, 3, self.config.patch_size, self.config.patch_size), np.float32)
            jax.block_until_ready(self._fn(self.params, px, vb))
        log.info("vision warm-up: %d patch buckets (%s) compiled in %.1fs", len(self.buckets),
                 ",".join(map(str, self.buckets)), time.perf_counter() - t0)

    # ------------------------------------------------------------------ encoding
    def encode(self, images: Sequence) -> dict:
        """Encode the images not cached yet (packed); returns {digest: embeddings} for all of them."""
        out, todo = {}, []
        for img in images:
            emb = self.cache.get(img.digest)
            if emb is not None:
                out[img.digest] = emb
            elif img.digest not in {i.digest for i in todo}:
                todo.append(img)
        group, size = [], 0
        for img in todo + [None]:
            n = 0 if img is None else img.pixel_values.shape[0]
            if group and (img is None or size + n > self.buckets[-1]):
                out.update(self._run(group))
                group, size = [], 0
            if img is not None:
                group.append(img)
                size += n
        return out

    def embeddings(self, img) -> np.ndarray:
        """One image's embeddings [num_tokens, D], encoding it now if the cache lost it."""
        emb = self.cache.get(img.digest)
        return emb if emb is not None else self.encode([img])[img.digest]

    def _run(self, group: list) -> dict:
        from k3jax.vision.positions import pad_pixel_values, prepare_vision_batch
        t0 = time.perf_counter()
        grids = [tuple(img.grid_thw) for img in group]
        b = self._bucket(sum(img.pixel_values.shape[0] for img in group))
        vb = prepare_vision_batch(self.config, grids, pad_patches_to=b)
        px = pad_pixel_values(np.concatenate([img.pixel_values for img in group]).astype(np.float32), vb)
        rows = np.asarray(self._fn(self.params, px, vb)).astype(self.out_dtype)
        out = {}
        for img, at, n in zip(group, vb.token_offsets, vb.tokens_per_image):
            if n != img.num_tokens:
                raise ValueError(f"image {img.digest[:12]}: the tower gives {n} tokens, the prompt has "
                                 f"{img.num_tokens} placeholders")
            emb = np.ascontiguousarray(rows[at:at + n])
            self.cache.put(img.digest, emb)
            out[img.digest] = emb
        self.counters["encoded_images"] += len(group)
        self.counters["encoded_tokens"] += sum(vb.tokens_per_image)
        self.counters["encoder_time"] += time.perf_counter() - t0
        return out

    def stats(self) -> dict:
        return {**self.counters, "encoder_cache_hits": self.cache.hits, "encoder_cache_entries": len(self.cache),
                "encoder_cache_bytes": self.cache.bytes}
