"""Config parsing: both checkpoint layouts, presets, warnings and errors."""
import json
import logging
import os

import pytest

from k3jax.config import ModelConfig
from k3jax.presets import preset_config, preset_config_dict

SHARED_K3 = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "kimi-k3-config.json")


def test_k3_layout_from_published_config():
    path = SHARED_K3 if os.path.exists(SHARED_K3) else None
    c = ModelConfig.from_json_file(path) if path else preset_config("kimi-k3")
    assert c.num_layers == 93 and c.hidden_size == 7168
    assert c.mla_layers == tuple(list(range(3, 92, 4)) + [92])
    assert len(c.kda_layers) == 69 and c.mlp_types[0] == "dense" and set(c.mlp_types[1:]) == {"moe"}
    assert c.expert_format == "mxfp4" and c.expert_hidden == 3584 and c.latent_moe_norm
    assert c.gate_lower_bound == -5.0 and c.kda_full_rank_gate and c.mla_output_gate
    assert c.hidden_act == "situ" and c.situ_beta == 4.0 and c.situ_linear_beta == 25.0
    assert c.attn_res_block_size == 12 and c.q_lora_rank == 1536 and c.num_experts == 896
    assert c.vision == {"patch_size": 14, "vt_hidden_size": 1152}
    assert c.model_type == "kimi_k3" and c.thinks_by_default


def test_kimi_linear_layout():
    c = preset_config("kimi-linear-48b-a3b")
    assert c.mla_layers == (3, 7, 11, 15, 19, 23, 26)
    assert c.q_lora_rank is None and c.gate_lower_bound is None and not c.kda_full_rank_gate
    assert c.routed_scaling_factor == 2.446 and c.expert_format == "bf16" and c.attn_res_block_size is None
    assert not c.thinks_by_default           # Kimi-Linear Instruct answers directly


def test_thinking_default_follows_model_type_unless_the_config_says():
    assert preset_config("tiny-random").thinks_by_default           # K3-shaped: answers start in reasoning
    assert not preset_config("tiny").thinks_by_default              # trained on plain text, never on thinking
    d = preset_config_dict("kimi-linear-48b-a3b")
    assert ModelConfig.from_dict({**d, "k3jax_thinks_by_default": True}).thinks_by_default
    with pytest.raises(ValueError, match="k3jax_thinks_by_default"):
        ModelConfig.from_dict({**d, "k3jax_thinks_by_default": "yes"})


def test_unknown_field_warns(caplog):
    d = preset_config_dict("tiny-random")
    d["text_config"]["brand_new_field"] = 1
    with caplog.at_level(logging.WARNING):
        ModelConfig.from_dict(d)
    assert "brand_new_field" in caplog.text


@pytest.mark.parametrize("field,value", [
    ("hidden_act", "gelu"),
    ("moe_router_activation_func", "softmax"),
    ("mla_use_nope", False),
    ("quantization_config", {"quant_method": "gptq", "format": "int4"}),
    ("num_experts_per_token", 99),
])
def test_unsupported_values_name_the_field(field, value):
    d = preset_config_dict("tiny-random")
    d["text_config"][field] = value
    with pytest.raises(ValueError, match=field.split("_")[0]):
        ModelConfig.from_dict(d)


def test_bad_layer_index_and_bad_json(tmp_path):
    d = preset_config_dict("tiny-random")
    d["text_config"]["linear_attn_config"]["full_attn_layers"] = [4, 7]
    with pytest.raises(ValueError, match="full_attn_layers"):
        ModelConfig.from_dict(d)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_json_file(bad)
    assert json.loads(json.dumps(preset_config_dict("tiny-random")))  # presets are plain JSON


@pytest.mark.parametrize("given, expected", [({}, (1.0, None)),
                                             ({"activation_situ_beta": None, "activation_situ_linear_beta": None},
                                              (1.0, None)),
                                             ({"activation_situ_beta": 2.0, "activation_situ_linear_beta": 7.0},
                                              (2.0, 7.0))])
def test_situ_defaults_follow_the_k3_modeling_code(given, expected):
    # K3's modeling code (and sglang): beta = config value or 1.0; linear beta = config value or none
    raw = json.loads(json.dumps(preset_config_dict("tiny-random")))
    text = raw["text_config"]
    for k in ("activation_situ_beta", "activation_situ_linear_beta"):
        text.pop(k, None)
    text.update(given)
    c = ModelConfig.from_dict(raw)
    assert (c.situ_beta, c.situ_linear_beta) == expected
