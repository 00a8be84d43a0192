"""Synthetic Kimi K3-format Hugging Face checkpoints (random weights, Moonshot names).

Written from the spec (shared/design/k3-architecture.md sections 6-7), independently of
k3jax/checkpoint/hf_names.py: every k3jax parameter is turned into the tensors a K3 release
checkpoint stores (`language_model.` prefix, [out, in] linears, per-expert MXFP4
`weight_packed` uint8 [out, in/2] + `weight_scale` uint8 [out, in/32], AttnRes projections
[1, hidden], conv1d [C, 1, 4], A_log as a longer vector whose tail is unused, vision tensors).
Used by the conversion tests and by tools/make_synthetic_checkpoint.py (multi-GB, streamed).
"""
from __future__ import annotations

import copy
import json
import math
import os
import shutil

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

import jax

from k3jax.config import ModelConfig
from k3jax.params import is_leaf, param_spec
from k3jax.presets import preset_config_dict

BF16 = ml_dtypes.bfloat16
TINY_TIKTOKEN = os.path.join(os.path.dirname(__file__), "..", "k3jax", "assets", "tiny.tiktoken")


def k3_config_dict(quantized: bool = True, top_level_quant: bool = False, **text_overrides) -> dict:
    """K3 config.json: the tiny preset's text_config (with overrides), a full compressed-tensors
    quantization_config (in text_config like the kimi-k3 preset, or at the top level where HF
    usually writes it) and a vision_config."""
    raw = copy.deepcopy(preset_config_dict("tiny-random"))
    text = raw["text_config"]
    text.pop("quantization_config", None)
    text.update(text_overrides)
    raw["architectures"] = ["KimiK3ForConditionalGeneration"]
    # (the tiny preset's K3-style vision_config is kept: the tower below matches it)
    if quantized:
        (raw if top_level_quant else text)["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {
                "format": "mxfp4-pack-quantized", "targets": ["re:.*block_sparse_moe.experts.*"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                            "symmetric": True, "scale_dtype": "torch.uint8"}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*"],
        }
    return raw


def wide_config(num_layers: int, hidden: int, experts: int, expert_inter: int, latent: int, vocab: int = 1024) -> dict:
    """A widened tiny K3 (big stacked expert tensors) for memory measurements; a KDA/MLA mix."""
    n = num_layers
    full = [i for i in range(4, n + 1, 4)] or [n]
    return k3_config_dict(
        hidden_size=hidden, num_hidden_layers=n, vocab_size=vocab, intermediate_size=2 * hidden,
        moe_intermediate_size=expert_inter, routed_expert_hidden_size=latent, num_experts=experts,
        num_attention_heads=8, q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, linear_attn_config={
            "full_attn_layers": full, "kda_layers": [i for i in range(1, n + 1) if i not in full],
            "head_dim": 64, "num_heads": 8, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
            "use_full_rank_gate": True})


def parse(raw: dict) -> ModelConfig:
    """Parse as the converter does (a top-level quantization_config counts for text_config)."""
    r = copy.deepcopy(raw)
    if "quantization_config" in r:
        r["text_config"]["quantization_config"] = r.pop("quantization_config")
    return ModelConfig.from_dict(r)


def random_leaf(key: str, leaf, rng: np.random.Generator) -> np.ndarray:
    """Random values of a trained-weight scale; float weights are bf16 (as in the release), fp32 kinds fp32."""
    shape, k = leaf.shape, leaf.kind
    if k == "mx_packed":
        return rng.integers(0, 256, shape, dtype=np.uint8)
    if k == "mx_scale":
        return rng.integers(121, 124, shape, dtype=np.uint8)       # 2^-6 .. 2^-4
    if k == "A_log":
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if k == "dt_bias":
        return (rng.standard_normal(shape, np.float32) - 3.0)
    if k == "zeros32":
        return 0.1 * rng.standard_normal(shape, np.float32)
    if k == "norm":
        x = 1.0 + 0.1 * rng.standard_normal(shape, np.float32)
    elif k == "conv":
        x = 0.5 * rng.standard_normal(shape, np.float32)
    else:
        fan_in = shape[-2] if len(shape) >= 2 else shape[-1]
        x = rng.standard_normal(shape, np.float32)
        x *= fan_in ** -0.5
    return x.astype(np.float32 if k == "router" else BF16)


def _t(a):
    return np.ascontiguousarray(np.swapaxes(a, -1, -2))


def hf_tensors(c: ModelConfig, key: str, a: np.ndarray, rng: np.random.Generator):
    """Moonshot-named checkpoint tensors [(name, array)] holding k3jax parameter `key` = a."""
    P, M = "language_model.", "language_model.model."
    parts = key.split(".")
    if key == "embed":
        return [(M + "embed_tokens.weight", a)]
    if key == "lm_head":
        return [(P + "lm_head.weight", _t(a))]
    if key == "final_norm":
        return [(M + "norm.weight", a)]
    if parts[0] == "output_attn_res":
        return [(M + f"output_attn_res_{parts[1]}.weight", a.reshape(1, -1) if parts[1] == "proj" else a)]
    i, group, rest = int(parts[1]), parts[2], parts[3:]
    L = f"{M}layers.{i}."
    if group in ("input_norm", "post_attn_norm"):
        return [(L + {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm"}[group] + ".weight", a)]
    if group == "attn_res":
        name = {"attn_proj": "self_attention_res_proj", "attn_norm": "self_attention_res_norm",
                "mlp_proj": "mlp_res_proj", "mlp_norm": "mlp_res_norm"}[rest[0]]
        return [(L + name + ".weight", a.reshape(1, -1) if rest[0].endswith("proj") else a)]
    if group == "attn":
        n, A = rest[0], L + "self_attn."
        if n in ("q_conv", "k_conv", "v_conv"):
            return [(A + n[0] + "_conv1d.weight", _t(a)[:, None, :])]          # [Kc, C] -> [C, 1, Kc]
        if n == "A_log":          # K3 stores a longer vector; only the first H entries are used
            tail = rng.uniform(5.0, 9.0, max(32, 4 * a.size) - a.size).astype(np.float32)
            return [(A + "A_log", np.concatenate([a, tail]))]
        if n == "dt_bias":
            return [(A + "dt_bias", a)]
        norms = {"o_norm": "o_norm", "q_a_norm": "q_a_layernorm", "kv_a_norm": "kv_a_layernorm"}
        if n in norms:
            return [(A + norms[n] + ".weight", a)]
        return [(A + {"kv_a_proj": "kv_a_proj_with_mqa"}.get(n, n) + ".weight", _t(a))]
    if group == "mlp":
        B = L + "block_sparse_moe."
        n = rest[0]
        if n in ("gate", "up", "down"):                         # dense layer: Moonshot puts it under mlp.
            return [(L + f"mlp.{n}_proj.weight", _t(a))]
        if n == "router":
            return [(B + "gate.weight", _t(a))]
        if n == "router_bias":
            return [(B + "gate.e_score_correction_bias", a)]
        if n == "shared":
            return [(B + f"shared_experts.{rest[1]}_proj.weight", _t(a))]
        if n in ("latent_down", "latent_up"):
            return [(B + f"routed_expert_{n[7:]}_proj.weight", _t(a))]
        if n == "latent_norm":
            return [(B + "routed_expert_norm.weight", a)]
        if n == "experts":
            w = rest[1]
            if w.endswith(("_packed", "_scale")):
                base, kind = w.split("_")
                suffix = "weight_packed" if kind == "packed" else "weight_scale"
                return [(B + f"experts.{e}.{base}.{suffix}", np.ascontiguousarray(a[e])) for e in range(a.shape[0])]
            return [(B + f"experts.{e}.{w}.weight", _t(a[e])) for e in range(a.shape[0])]
    raise KeyError(key)


def _vision_tensors(raw: dict, rng, out: dict | None):
    """A complete tower in Moonshot's spelling (K3-style config: no biases, RMSNorm, patchmergerv2),
    written from the names alone; `out` receives the same weights in k3jax's layout ([in, out])."""
    v = raw["vision_config"]
    D, Q, I, p = v["vt_hidden_size"], v["qkv_hidden_size"], v["vt_intermediate_size"], v["patch_size"]
    T, M = raw["text_config"]["hidden_size"], D * 4                       # 2x2 merge
    r = lambda *shape: (rng.standard_normal(shape, np.float32) * 0.2).astype(BF16)
    ones = lambda n: (1 + r(n).astype(np.float32) * 0.5).astype(BF16)
    t = {"vision_tower.patch_embed.proj.weight": r(D, 3, p, p),
         "vision_tower.patch_embed.pos_emb.weight": r(v["init_pos_emb_height"], v["init_pos_emb_width"], D),
         "vision_tower.encoder.final_layernorm.weight": ones(D),
         "mm_projector.proj.0.weight": r(M, M), "mm_projector.proj.2.weight": r(T, M),
         "mm_projector.post_norm.weight": ones(T)}
    ours = {"patch_embed": {"w": t["vision_tower.patch_embed.proj.weight"].reshape(D, -1).T},
            "pos_emb": t["vision_tower.patch_embed.pos_emb.weight"],
            "final_norm": {"w": t["vision_tower.encoder.final_layernorm.weight"]},
            "projector": {"proj0": {"w": t["mm_projector.proj.0.weight"].T},
                          "proj2": {"w": t["mm_projector.proj.2.weight"].T},
                          "post_norm": {"w": t["mm_projector.post_norm.weight"]}}, "blocks": []}
    for i in range(v["vt_num_hidden_layers"]):
        B = f"vision_tower.encoder.blocks.{i}."
        blk = {B + "norm0.weight": ones(D), B + "norm1.weight": ones(D), B + "wqkv.weight": r(3 * Q, D),
               B + "wo.weight": r(D, Q), B + "mlp.fc0.weight": r(I, D), B + "mlp.fc1.weight": r(D, I)}
        t.update(blk)
        ours["blocks"].append({"norm0": {"w": blk[B + "norm0.weight"]}, "norm1": {"w": blk[B + "norm1.weight"]},
                               "wqkv": {"w": blk[B + "wqkv.weight"].T}, "wo": {"w": blk[B + "wo.weight"].T},
                               "fc0": {"w": blk[B + "mlp.fc0.weight"].T}, "fc1": {"w": blk[B + "mlp.fc1.weight"].T}})
    if out is not None:
        out.update(ours)
    return list(t.items())


def write_checkpoint(path, raw: dict | None = None, *, seed: int = 0, shard_bytes: int = 1 << 20,
                     vision: bool = True, tokenizer: bool | str = True, keep_params: bool = True,
                     vision_out: dict | None = None):
    """Write a K3-format HF checkpoint dir: config.json, sharded safetensors + index, tokenizer files
    (tokenizer=True: the K2-layout tiny tokenizer with a jinja template; "k3": K3's declared names).

    Generates and writes parameter by parameter (memory ~ one shard + one parameter).
    Returns (ModelConfig, k3jax params tree of numpy arrays or None, total bytes written).
    """
    raw = raw or k3_config_dict()
    c = parse(raw)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    rng = np.random.default_rng(seed)
    flat, treedef = jax.tree_util.tree_flatten_with_path(param_spec(c), is_leaf=is_leaf)
    weight_map, shard, shard_size, leaves, total = {}, {}, 0, [], 0

    def flush():
        nonlocal shard, shard_size
        if shard:
            fname = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
            shard, shard_size = {}, 0

    def add(tensors):
        nonlocal shard_size, total
        for name, t in tensors:
            if shard and shard_size + t.nbytes > shard_bytes:
                flush()
            shard[name] = t
            shard_size += t.nbytes
            total += t.nbytes

    for p, leaf in flat:
        key = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p)
        a = random_leaf(key, leaf, rng)
        add(hf_tensors(c, key, a, rng))
        if keep_params:
            leaves.append(a)
        del a
    if vision:
        add(_vision_tensors(raw, rng, vision_out))
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    if tokenizer == "k3":   # K3's tokenizer files: declared special names, no jinja template
        from k3jax.tokenizer.vocab import k3_added_tokens, load_tiktoken_bpe
        shutil.copy(TINY_TIKTOKEN, os.path.join(path, "tiktoken.model"))
        names = k3_added_tokens(len(load_tiktoken_bpe(TINY_TIKTOKEN)))
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"model_max_length": 8192, "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]",
                       "eos_token": "[EOS]", "added_tokens_decoder": {
                           str(i): {"content": n, "special": True} for i, n in sorted(names.items())}}, f)
    elif tokenizer:
        shutil.copy(TINY_TIKTOKEN, os.path.join(path, "tiktoken.model"))
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"model_max_length": 8192, "tokenizer_class": "TikTokenTokenizer"}, f)
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write("{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>"
                    "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")
    params = jax.tree_util.tree_unflatten(treedef, leaves) if keep_params else None
    return c, params, total


def approx_bytes(raw: dict) -> int:
    """Bytes of the parameters a config implies (bf16 weights, MXFP4 experts packed)."""
    c = parse(raw)
    return sum(math.prod(l.shape) * (1 if l.kind.startswith("mx") else 4 if l.kind in
               ("A_log", "dt_bias", "router", "zeros32") else 2)
               for l in jax.tree_util.tree_leaves(param_spec(c), is_leaf=is_leaf))
