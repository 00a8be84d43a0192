"""Vision tower weights through checkpoints: HF dir loading, conversion, text-only fallbacks."""
import json
import logging
import os

import numpy as np
import pytest

import jax

from tools import synthetic_k3
from k3jax import load_model
from k3jax.convert import convert


def _assert_tree_equal(got, want):
    g, gt = jax.tree_util.tree_flatten(got)
    w, wt = jax.tree_util.tree_flatten(want)
    assert gt == wt
    for a, b in zip(g, w):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("hf"))
    tower = {}
    synthetic_k3.write_checkpoint(src, seed=3, vision_out=tower, keep_params=False)
    with open(os.path.join(src, "preprocessor_config.json"), "w") as f:
        json.dump({"patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 128}, f)
    return src, tower


def test_hf_dir_and_converted_dir_load_the_same_tower(hf_dir, tmp_path):
    src, tower = hf_dir
    m = load_model(src, dtype="bfloat16")
    assert m.vision is not None and m.vision.processor.max_patches == 128
    from k3jax.vision.tower import VisionTower
    assert isinstance(m.vision.tower, VisionTower)         # the loader filled the tower module's parameters
    assert m.vision.tower.blocks[0].wqkv.w.logical_axes == (None, None)
    _assert_tree_equal(m.vision.params, tower)
    dst = str(tmp_path / "converted")
    summary = convert(src, dst, progress=False)
    assert summary["vision_bytes"] > 0
    assert os.path.exists(os.path.join(dst, "preprocessor_config.json"))
    c = load_model(dst, dtype="bfloat16")
    _assert_tree_equal(c.vision.params, tower)
    assert c.vision.config == m.vision.config and c.vision.pad_id == m.vision.pad_id


def test_vision_config_without_tower_serves_text_only(tmp_path, caplog):
    src = str(tmp_path / "noviz")
    synthetic_k3.write_checkpoint(src, seed=4, vision=False, keep_params=False)
    with caplog.at_level(logging.WARNING):
        m = load_model(src, dtype="float32")
    assert m.vision is None and "images are disabled" in caplog.text
    dst = str(tmp_path / "noviz-out")
    assert convert(src, dst, progress=False)["vision_bytes"] == 0
    assert load_model(dst, dtype="float32").vision is None


def test_partial_tower_is_an_error(hf_dir, tmp_path):
    src, _ = hf_dir
    bad = str(tmp_path / "partial")
    os.makedirs(bad)
    from safetensors.numpy import load_file, save_file
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if name.endswith(".safetensors"):
            t = {k: v for k, v in load_file(path).items() if "encoder.blocks.1." not in k}
            save_file(t, os.path.join(bad, name), metadata={"format": "pt"})
        elif os.path.isfile(path):
            with open(path, "rb") as f, open(os.path.join(bad, name), "wb") as g:
                g.write(f.read())
    idx = os.path.join(bad, "model.safetensors.index.json")
    with open(idx) as f:
        index = json.load(f)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if "encoder.blocks.1." not in k}
    with open(idx, "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match="part of the vision tower.*blocks.1"):
        load_model(bad, dtype="float32")
