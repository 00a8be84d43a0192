"""Named model presets, each as the `config.json` a checkpoint would carry."""
from __future__ import annotations

import json
import os

from k3jax.config import ModelConfig

_HERE = os.path.dirname(__file__)

# Kimi-Linear-48B-A3B as published (Kimi Linear layout: fields at top level).
KIMI_LINEAR_48B = {
    "model_type": "kimi_linear",
    "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27,
    "num_attention_heads": 32, "num_key_value_heads": 32,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "mla_use_nope": True,
    "intermediate_size": 9216, "moe_intermediate_size": 1024, "first_k_dense_replace": 1,
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
    "routed_scaling_factor": 2.446, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "num_expert_group": 1, "topk_group": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "max_position_embeddings": 1048576,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
        "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
    },
}

# The seeded random model the tests use: every K3 feature on (AttnRes, SiTU, latent MoE + norm,
# safe gate, full-rank KDA gate, MLA output gate + q_lora, MXFP4 experts, a vision tower), a few
# MB, a 1024-token vocab whose tokenizer ships in k3jax/assets. Special ids follow the Kimi layout
# relative to 768.
TINY_RANDOM = {
    "model_type": "kimi_k3",
    "text_config": {
        "vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "intermediate_size": 256, "moe_intermediate_size": 64, "first_k_dense_replace": 1,
        "num_experts": 16, "num_experts_per_token": 4, "num_shared_experts": 1,
        "routed_expert_hidden_size": 64, "latent_moe_use_norm": True,
        "routed_scaling_factor": 1.0, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "max_position_embeddings": 8192,
        "bos_token_id": 768, "eos_token_id": 770, "pad_token_id": 1023,
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
        "linear_attn_config": {
            "full_attn_layers": [4, 6], "kda_layers": [1, 2, 3, 5], "head_dim": 32, "num_heads": 4,
            "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True,
        },
    },
    # A tiny K3-style tower (RMSNorm, no biases, qkv width != hidden, patchmergerv2 projector).
    "vision_config": {
        "patch_size": 14, "vt_hidden_size": 64, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 4,
        "vt_intermediate_size": 128, "qkv_hidden_size": 96, "init_pos_emb_height": 8, "init_pos_emb_width": 8,
        "init_pos_emb_time": 4, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
        "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bicubic", "norm_type": "rmsnorm",
        "mlp_type": "mlp2", "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
        "mm_projector_type": "patchmergerv2", "mm_hidden_size": 64,
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
    },
}

# The embedded default, trained on English documentation (tools/train_tiny.py; weights in
# k3jax/assets/tiny-trained.safetensors): TINY_RANDOM's features at a size that learns readable
# text in a few GPU minutes, and a 4096-token English BPE (k3jax/assets/tiny-en.tiktoken,
# special ids relative to 3840). Text only.
_RANDOM_TEXT = TINY_RANDOM["text_config"]
TINY = {
    "model_type": "kimi_k3",
    # trained on plain documentation, never on the chat format or reasoning: its chat answers are content
    "k3jax_thinks_by_default": False,
    "text_config": {
        **_RANDOM_TEXT,
        "vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 8, "q_lora_rank": 128, "kv_lora_rank": 128,
        "qk_nope_head_dim": 48, "v_head_dim": 64, "intermediate_size": 768, "moe_intermediate_size": 128,
        "routed_expert_hidden_size": 128, "bos_token_id": 3840, "eos_token_id": 3841, "pad_token_id": 4095,
        "linear_attn_config": {**_RANDOM_TEXT["linear_attn_config"], "full_attn_layers": [4, 8],
                               "kda_layers": [1, 2, 3, 5, 6, 7], "head_dim": 64},
    },
}

# TINY_RANDOM's image preprocessing: at most 256 patches (64 image tokens) per image keeps CPU runs fast.
TINY_IMAGE_PROCESSOR = {"patch_size": 14, "merge_size": 2, "max_patches": 256, "max_patches_per_side": 32}

TINY_SEED = 0


def _k3() -> dict:
    with open(os.path.join(_HERE, "kimi-k3.json")) as f:
        return json.load(f)


_PRESETS = {
    "tiny": lambda: TINY,
    "tiny-random": lambda: TINY_RANDOM,
    "kimi-linear-48b-a3b": lambda: KIMI_LINEAR_48B,
    "kimi-k3": _k3,
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def preset_config_dict(name: str) -> dict:
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(preset_names())}")
    return json.loads(json.dumps(_PRESETS[name]()))  # deep copy


def preset_config(name: str) -> ModelConfig:
    return ModelConfig.from_dict(preset_config_dict(name))


def resolve_config(model: str, *, revision: str | None = None, download_dir: str | None = None) -> ModelConfig:
    """A preset name, a checkpoint directory (its config.json) or a Hugging Face model id -> ModelConfig."""
    from k3jax.checkpoint import hub
    if model not in _PRESETS and hub.looks_like_repo_id(model):
        model = hub.resolve(model, revision=revision, download_dir=download_dir)
    if os.path.isdir(model):
        return ModelConfig.from_json_file(os.path.join(model, "config.json"))
    return preset_config(model)
