"""Image sources (data URLs, files, optionally http) -> ImageInput ready for the engine.

Loading limits and the remote-URL switch live here so the server, the offline API and the
tests share one policy. Every input problem raises k3jax.vision.media.ImageInputError.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from serving.multimodal import ImageInput


@dataclasses.dataclass(frozen=True)
class ImagePolicy:
    allow_remote: bool = False          # http(s) URLs are fetched only when allowed
    allow_local: bool = True            # file paths (the server allows them only under local_dir)
    max_bytes: int = 20 << 20           # encoded size (data URL payload, file, download)
    max_pixels: int = 64 << 20          # decoded width x height (decompression bombs)
    timeout_s: float = 10.0             # remote fetch
    local_dir: Optional[str] = None     # local paths must lie under it (None: any path allowed)


class ImageLoader:
    def __init__(self, vision, policy: ImagePolicy = ImagePolicy()):
        self.vision = vision
        self.policy = policy

    @property
    def pad_id(self) -> int:
        return self.vision.pad_id

    def load(self, source: str) -> ImageInput:
        from k3jax.vision.media import image_digest, load_image
        p = self.policy
        img = load_image(source, allow_remote=p.allow_remote, allow_local=p.allow_local, max_bytes=p.max_bytes,
                         max_pixels=p.max_pixels, timeout_s=p.timeout_s, local_dir=p.local_dir)
        return self.from_pil(img, image_digest(img))

    def from_pil(self, img, digest: str) -> ImageInput:
        from k3jax.vision.positions import tokens_per_image
        from k3jax.vision.preprocess import preprocess
        pixel_values, grid = preprocess([img], self.vision.processor)
        n = tokens_per_image(self.vision.config, grid)[0]
        return ImageInput(digest=digest, pixel_values=pixel_values, grid_thw=tuple(int(x) for x in grid[0]),
                          num_tokens=n, size=tuple(int(x) for x in img.size))
