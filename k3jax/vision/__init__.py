"""Native vision: MoonViT tower + patch-merger projector (Kimi K2.5 / K3) as pure JAX functions.

config.py (VisionConfig), positions.py (host-side per-patch index math), tower.py (param spec,
init, encode_images), names.py (checkpoint names -> param tree). Image decoding and patchifying
live in preprocess.py / media.py (imported lazily by the server path, not here).
"""
from k3jax.vision.config import VisionConfig
from k3jax.vision.names import load_vision_params, vision_sources
from k3jax.vision.positions import (VisionBatch, pad_pixel_values, prepare_vision_batch,
                                    tokens_per_image)
from k3jax.vision.tower import (encode_images, init_vision_params, init_vision_params_numpy,
                                stack_blocks, vision_param_spec, vision_tower)

__all__ = [
    "VisionConfig", "VisionBatch", "prepare_vision_batch", "pad_pixel_values", "tokens_per_image",
    "vision_param_spec", "init_vision_params", "init_vision_params_numpy", "stack_blocks",
    "vision_tower", "encode_images", "vision_sources", "load_vision_params",
]
