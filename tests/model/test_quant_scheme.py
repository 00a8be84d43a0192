"""Which tensors are MXFP4 follows the checkpoint's compressed-tensors targets and ignore list:
a release that packs more than the routed experts loads and converts (packed linears are
dequantized), and one whose ignore list covers the experts keeps them bf16."""
import glob
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tools import synthetic_k3
from k3jax import load_model
from k3jax.checkpoint import convert_stream
from k3jax.checkpoint.quant_scheme import dequantize, is_quantized, scheme_of
from k3jax.checkpoint.safetensors_dir import SafetensorsDir
from k3jax.config import ModelConfig

K3_RELEASE = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
              "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"]}},
              "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                         "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]}


def test_matching_rules():
    targets, ignore = scheme_of(K3_RELEASE)
    assert targets == ("Linear",)
    L = "language_model.model.layers.3."
    packed = [L + "block_sparse_moe.experts.7.w2", L + "block_sparse_moe.routed_expert_down_proj"]
    kept = [L + "self_attn.q_a_proj", L + "block_sparse_moe.shared_experts.down_proj",
            "language_model.model.layers.0.mlp.gate_proj", "language_model.lm_head"]
    assert all(is_quantized(targets, ignore, n) for n in packed)
    assert not any(is_quantized(targets, ignore, n) for n in kept)
    assert not is_quantized(targets, ignore, L + "input_layernorm", is_linear=False)
    # re: entries use re.match (anchored at the start); plain entries are whole names
    assert is_quantized(("re:model\\..*w1",), (), "model.x.w1") and not is_quantized(("re:w1",), (), "model.w1")
    assert is_quantized(("model.a",), (), "model.a") and not is_quantized(("model.a",), (), "model.ab")
    assert scheme_of(None) == ((), ())


def test_dequantize_values():
    # codes 0..15 on one row (low nibble first), scale 2^(128-127) = 2
    packed = np.array([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2], np.uint8)
    scale = np.array([[128]], np.uint8)
    want = 2 * np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6] * 2, np.float32)
    assert np.array_equal(dequantize(packed, scale), want[None])


def _repack(src, modules, rng):
    """Rewrite the checkpoint so each of `modules` is stored packed (random codes and scales)."""
    tensors = {}
    for f in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        tensors.update(load_file(f))
        os.remove(f)
    expected = {}
    for m in modules:
        w = tensors.pop(m + ".weight")
        out, inn = w.shape
        packed = rng.integers(0, 256, (out, inn // 2), dtype=np.uint8)
        scale = rng.integers(120, 125, (out, inn // 32), dtype=np.uint8)
        tensors[m + ".weight_packed"], tensors[m + ".weight_scale"] = packed, scale
        expected[m] = dequantize(packed, scale).T
    save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: "model.safetensors" for n in tensors}}, f)
    return expected


@pytest.fixture(scope="module")
def packed_release(tmp_path_factory):
    """K3's scheme minus the shared-experts ignore: latent projections and shared experts packed too."""
    src = str(tmp_path_factory.mktemp("packed"))
    raw = synthetic_k3.k3_config_dict()
    scheme = json.loads(json.dumps(K3_RELEASE))
    scheme["ignore"] = [i for i in scheme["ignore"] if "shared_experts" not in i]
    raw["text_config"]["quantization_config"] = scheme
    synthetic_k3.write_checkpoint(src, raw, seed=5, vision=False, tokenizer=False)
    L = "language_model.model.layers.1.block_sparse_moe."
    modules = [L + "routed_expert_down_proj", L + "routed_expert_up_proj", L + "shared_experts.down_proj"]
    expected = _repack(src, modules, np.random.default_rng(1))
    return src, modules, expected


def test_a_release_packing_more_than_the_experts_loads(packed_release):
    src, modules, expected = packed_release
    cfg = ModelConfig.from_json_file(os.path.join(src, "config.json"))
    assert cfg.expert_format == "mxfp4" and cfg.quant_targets == ("Linear",)
    m = load_model(src, dtype="float32")
    moe = m.layer_params(1)["mlp"]            # the model holds the scanned layout
    got = {modules[0]: moe["latent_down"], modules[1]: moe["latent_up"],
           modules[2]: moe["shared"]["down"]}
    for name, arr in got.items():
        np.testing.assert_array_equal(np.asarray(arr, np.float32), expected[name], err_msg=name)
    assert moe["experts"]["w1_packed"].dtype == np.uint8     # routed experts stay MXFP4


def test_a_release_packing_more_than_the_experts_converts(packed_release):
    src, modules, expected = packed_release
    cfg = ModelConfig.from_json_file(os.path.join(src, "config.json"))
    ckpt = SafetensorsDir(src)
    out_cfg, plans = convert_stream.plan_conversion(ckpt, cfg, np.float32)
    by_key = {p.key: p for p in plans}
    leaf = convert_stream.build_leaf(ckpt, by_key["layers.1.mlp.latent_down"])
    np.testing.assert_array_equal(leaf, expected[modules[0]])


def test_ignored_experts_stay_bf16():
    raw = synthetic_k3.k3_config_dict()
    scheme = json.loads(json.dumps(K3_RELEASE))
    scheme["ignore"].append("re:.*experts.*")
    raw["text_config"]["quantization_config"] = scheme
    assert ModelConfig.from_dict(raw).expert_format == "bf16"
    raw["text_config"]["quantization_config"] = K3_RELEASE
    assert ModelConfig.from_dict(raw).expert_format == "mxfp4"
