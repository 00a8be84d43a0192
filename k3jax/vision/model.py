"""The image side of a loaded multimodal model (k3jax.api.Model.vision), made by the checkpoint loaders."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class VisionModel:
    """The image side of a multimodal model: the tower + projector module (its parameters filled by
    the checkpoint loader), image preprocessing, and the placeholder id whose embeddings the tower's
    output replaces."""
    config: object               # k3jax.vision.config.VisionConfig
    tower: object                # k3jax.vision.tower.VisionTower
    processor: object            # k3jax.vision.preprocess.ImageProcessorConfig
    pad_id: int                  # <|media_pad|>

    @property
    def params(self) -> dict:
        """The tower's parameters as a dict of arrays (the same arrays), named as in the checkpoint."""
        return self.tower.tree()

    @property
    def max_patches(self) -> int:
        """Most patches one preprocessed image can have (the encoder's largest bucket)."""
        return self.processor.max_patches


def media_pad_id(config, tokenizer) -> int:
    """The id of `<|media_pad|>` (the image placeholder): the tokenizer's, else the config's special-token layout."""
    if tokenizer is not None:
        return tokenizer.id_of("<|media_pad|>")
    from k3jax.tokenizer import vocab
    return config.vocab_size - vocab.NUM_SPECIAL + vocab.SPECIAL_OFFSETS["<|media_pad|>"]
