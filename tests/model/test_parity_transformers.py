"""Logits parity with transformers' KimiLinearForCausalLM (tiny random config, CPU, fp32)."""
import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from tests.support.hf_reference import tiny_kimi_linear_model
from k3jax.checkpoint.hf_load import load_hf_params
from k3jax.config import ModelConfig
from k3jax.layer_stack import stack_layers
from k3jax.model import K3Model


def _max_rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _ours(path, tokens):
    cfg = ModelConfig.from_json_file(path / "config.json")
    params = stack_layers(load_hf_params(path, cfg, jnp.float32), cfg)     # the scanned decoder
    return cfg, np.asarray(jax.jit(lambda p, t: K3Model(cfg, p)(t))(params, tokens))


@pytest.mark.parametrize("kw", [dict(), dict(q_lora_rank=24), dict(num_experts=8, top_k=3, n_group=2, topk_group=1)],
                         ids=["plain-q", "q-lora", "grouped-topk"])
def test_logits_match_transformers(tmp_path, kw):
    model = tiny_kimi_linear_model(seed=1, **kw)
    model.save_pretrained(tmp_path)
    tokens = np.random.RandomState(0).randint(0, 256, (2, 150)).astype(np.int32)   # crosses 64-token KDA chunks
    ref = _torch_logits(model, tokens)
    cfg, ours = _ours(tmp_path, tokens)
    assert cfg.layer_types == ("kda", "kda", "kda", "mla", "kda", "mla")
    assert _max_rel(ours, ref) <= 1e-4


def test_transformers_in_memory_spelling(tmp_path):
    """transformers' own names (packed conv1d, forget_gate.*, stacked gate_up_proj) load too."""
    from safetensors.torch import save_file
    model = tiny_kimi_linear_model(seed=2)
    model.save_pretrained(tmp_path)              # for config.json
    (tmp_path / "model.safetensors").unlink()
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any("forget_gate" in k for k in sd) and any("gate_up_proj" in k for k in sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    tokens = np.random.RandomState(1).randint(0, 256, (1, 70)).astype(np.int32)
    _, ours = _ours(tmp_path, tokens)
    assert _max_rel(ours, _torch_logits(model, tokens)) <= 1e-4
