"""Test helper: tiny random transformers KimiLinearForCausalLM models with every tensor randomized."""
from __future__ import annotations

import math

import torch


def tiny_kimi_linear_config(q_lora_rank=None, num_experts=8, top_k=2, n_group=1, topk_group=1):
    from transformers import KimiLinearConfig
    return KimiLinearConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
        num_local_experts=num_experts, num_experts_per_tok=top_k, n_shared_experts=1,
        n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.446,
        kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_act="silu",
        linear_attn_config=dict(kda_layers=[1, 2, 3, 5], full_attn_layers=[4, 6], head_dim=16, num_heads=4,
                                short_conv_kernel_size=4),
        first_k_dense_replace=1)


def randomize_(model, seed=0):
    """Give every tensor random values of a realistic scale (library inits hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("A_log"):
                t.copy_(torch.empty(t.shape).uniform_(1.0, 16.0, generator=g).log())
            elif name.endswith("dt_bias"):
                t.copy_(torch.randn(t.shape, generator=g) - 3.0)
            elif "norm" in name:
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            elif t.ndim >= 2:
                fan_in = t.shape[-1] if "conv" not in name else t.shape[-1]
                std = 0.5 if "conv" in name else 1.0 / math.sqrt(fan_in)
                t.copy_(torch.randn(t.shape, generator=g) * std)
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return model


def tiny_kimi_linear_model(seed=0, **kw):
    from transformers import KimiLinearForCausalLM
    torch.manual_seed(seed)
    m = KimiLinearForCausalLM(tiny_kimi_linear_config(**kw)).eval()
    return randomize_(m, seed)
