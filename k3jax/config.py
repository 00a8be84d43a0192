"""Model configuration: one frozen, validated dataclass for Kimi K3 and Kimi Linear.

Parsed from a checkpoint's `config.json` (Kimi-Linear layout at top level, K3 layout under
`text_config`) or built from a preset. Unknown fields warn; unsupported values raise
ValueError naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Mapping

from k3jax.quantization import is_quantized, scheme_of

log = logging.getLogger(__name__)

# Fields of HF configs that carry no information the model needs.
_IGNORED_FIELDS = {
    "architectures", "model_type", "k3jax_thinks_by_default", "torch_dtype", "dtype", "transformers_version", "auto_map",
    "initializer_range", "use_cache", "pretraining_tp", "attention_bias", "attention_dropout",
    "output_router_logits", "router_aux_loss_coef", "num_key_value_heads", "rope_theta",
    "rope_scaling", "rope_parameters", "use_grouped_topk", "moe_layer_freq", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id",
    "num_nextn_predict_layers", "model_max_length", "layer_types", "mlp_layer_types",
    "head_dim", "qk_head_dim", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "tie_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class",
    "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "n_routed_experts",
    "scoring_func", "topk_method", "norm_topk_prob", "num_experts_per_tok", "n_shared_experts",
    "num_local_experts", "n_group", "ep_size", "aux_loss_alpha", "seq_aux",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs. Layer indices are 0-based here."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]          # "kda" | "mla" per layer
    mlp_types: tuple[str, ...]            # "dense" | "moe" per layer
    rms_norm_eps: float = 1e-5
    # KDA
    kda_num_heads: int = 32
    kda_head_dim: int = 128
    conv_kernel: int = 4
    gate_lower_bound: float | None = None  # None: softplus gate; else safe gate bound
    kda_full_rank_gate: bool = False
    # MLA
    mla_num_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_output_gate: bool = False
    # MLP / MoE
    intermediate_size: int = 9216
    moe_intermediate_size: int = 1024
    num_experts: int = 256
    num_experts_per_token: int = 8
    num_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    routed_expert_hidden_size: int | None = None  # latent MoE width (K3)
    latent_moe_norm: bool = False
    hidden_act: str = "silu"              # "silu" (SwiGLU) | "situ" (SiTU-GLU)
    # Defaults when a config omits them are the K3 modeling code's (beta 1.0, no linear clamp);
    # the K3 release config sets 4.0 / 25.0 explicitly.
    situ_beta: float = 1.0
    situ_linear_beta: float | None = None
    expert_format: str = "bf16"           # "bf16" | "mxfp4" (the routed experts as the model keeps them)
    # compressed-tensors MXFP4 scheme of the checkpoint (k3jax.checkpoint.quant_scheme): which
    # modules it stores packed; packed modules other than the routed experts load dequantized
    quant_targets: tuple = ()
    quant_ignore: tuple = ()
    # Attention residuals (K3)
    attn_res_block_size: int | None = None
    # Misc
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1_048_576
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    vision: Mapping[str, Any] | None = None
    model_type: str = ""                  # "kimi_k3" (a thinking model) | "kimi_linear" | ...
    # Does a chat answer start inside reasoning? None: by model_type. Set by config.json's
    # "k3jax_thinks_by_default" (the embedded `tiny` was trained on plain text, never on thinking).
    thinks: bool | None = None

    def __post_init__(self):
        _validate(self)

    # ---- derived quantities -------------------------------------------------
    @property
    def thinks_by_default(self) -> bool:
        """K3 starts its answer with reasoning; Kimi Linear (Instruct) answers directly."""
        return self.model_type == "kimi_k3" if self.thinks is None else self.thinks

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mla")

    @property
    def expert_hidden(self) -> int:
        """Width the routed experts see: the latent width for K3, else hidden_size."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def mla_cache_dim(self) -> int:
        """Values cached per token per MLA layer: normalized latent + shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- parsing ------------------------------------------------------------
    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        try:
            with open(path) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        return _parse(raw)


def _fail(field: str, value: Any, why: str):
    raise ValueError(f"config field {field!r} = {value!r}: {why}")


def _validate(c: ModelConfig):
    if len(c.layer_types) != c.num_layers or len(c.mlp_types) != c.num_layers:
        _fail("layer_types", c.layer_types, f"needs {c.num_layers} entries")
    for t in c.layer_types:
        if t not in ("kda", "mla"):
            _fail("layer_types", t, "each entry must be 'kda' or 'mla'")
    for t in c.mlp_types:
        if t not in ("dense", "moe"):
            _fail("mlp_types", t, "each entry must be 'dense' or 'moe'")
    if c.hidden_act not in ("silu", "situ"):
        _fail("hidden_act", c.hidden_act, "supported: 'silu', 'situ'")
    if c.expert_format not in ("bf16", "mxfp4"):
        _fail("quantization_config", c.expert_format, "only compressed-tensors mxfp4-pack-quantized is supported")
    if c.expert_format == "mxfp4":
        for name in ("expert_hidden", "moe_intermediate_size"):
            if getattr(c, name) % 32:
                _fail(name, getattr(c, name), "MXFP4 needs input dims divisible by 32")
    if c.num_experts_per_token > c.num_experts:
        _fail("num_experts_per_token", c.num_experts_per_token, "more than num_experts")
    if c.num_experts % c.num_expert_group:
        _fail("num_expert_group", c.num_expert_group, "must divide num_experts")
    if c.attn_res_block_size is not None and c.attn_res_block_size < 1:
        _fail("attn_res_block_size", c.attn_res_block_size, "must be >= 1")
    for name in ("vocab_size", "hidden_size", "num_layers", "kda_num_heads", "kda_head_dim",
                 "mla_num_heads", "kv_lora_rank"):
        if getattr(c, name) <= 0:
            _fail(name, getattr(c, name), "must be positive")


def _layer_types(lac: Mapping[str, Any], n: int) -> tuple[str, ...]:
    full = lac.get("full_attn_layers")
    kda = lac.get("kda_layers")
    types = [None] * n
    if full is None and kda is None:
        _fail("linear_attn_config", lac, "needs full_attn_layers or kda_layers")
    for i in full or []:
        if not 1 <= i <= n:
            _fail("full_attn_layers", i, f"1-indexed layer out of range 1..{n}")
        types[i - 1] = "mla"
    for i in kda or []:
        if not 1 <= i <= n:
            _fail("kda_layers", i, f"1-indexed layer out of range 1..{n}")
        if types[i - 1] == "mla":
            _fail("kda_layers", i, "layer listed as both KDA and full attention")
        types[i - 1] = "kda"
    default = "kda" if full is not None else "mla"
    return tuple(t or default for t in types)


def _parse(raw: Mapping[str, Any]) -> ModelConfig:
    top = dict(raw)
    text = dict(top.get("text_config") or top)
    vision = top.get("vision_config")
    used = set()

    def get(key, default=None):
        used.add(key)
        return text.get(key, default)

    if text.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        _fail("moe_router_activation_func", text["moe_router_activation_func"], "only 'sigmoid' routing is supported")
    if not text.get("mla_use_nope", True):
        _fail("mla_use_nope", False, "rotary MLA is not supported (Kimi models use NoPE)")
    used |= {"moe_router_activation_func", "mla_use_nope"}

    n = int(get("num_hidden_layers"))
    lac = dict(get("linear_attn_config") or {})
    layer_types = _layer_types(lac, n)
    first_dense = int(get("first_k_dense_replace", 1))
    mlp_types = tuple("dense" if i < first_dense else "moe" for i in range(n))

    q = get("quantization_config") or top.get("quantization_config")
    expert_format, quant_targets, quant_ignore = "bf16", (), ()
    if q:
        fmt = q.get("format") or _first_group_format(q)
        if q.get("quant_method") != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
            _fail("quantization_config", {k: q.get(k) for k in ("quant_method", "format")},
                  "only compressed-tensors 'mxfp4-pack-quantized' is supported")
        quant_targets, quant_ignore = scheme_of(q)
        # the routed experts stay MXFP4 when the scheme packs them (the names of a K3 release)
        moe_layer = int(get("first_k_dense_replace", 1))
        probe = f"language_model.model.layers.{moe_layer}.block_sparse_moe.experts.0.w1"
        if is_quantized(quant_targets, quant_ignore, probe):
            expert_format = "mxfp4"

    num_experts = get("num_experts", text.get("num_local_experts", text.get("n_routed_experts", 256)))
    top_k = get("num_experts_per_token", text.get("num_experts_per_tok", 8))
    shared = get("num_shared_experts", text.get("n_shared_experts", 1))
    n_group = get("num_expert_group", text.get("n_group", 1))
    eos = get("eos_token_id", top.get("eos_token_id"))
    if isinstance(eos, list):
        eos = eos[0] if eos else None

    cfg = ModelConfig(
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        num_layers=n,
        layer_types=layer_types,
        mlp_types=mlp_types,
        rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
        kda_num_heads=int(lac.get("num_heads", 32)),
        kda_head_dim=int(lac.get("head_dim", 128)),
        conv_kernel=int(lac.get("short_conv_kernel_size", 4)),
        gate_lower_bound=lac.get("gate_lower_bound"),
        kda_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
        mla_num_heads=int(get("num_attention_heads")),
        q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=int(get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(get("qk_rope_head_dim", 64)),
        v_head_dim=int(get("v_head_dim", 128)),
        mla_output_gate=bool(get("mla_use_output_gate", False)),
        intermediate_size=int(get("intermediate_size")),
        moe_intermediate_size=int(get("moe_intermediate_size")),
        num_experts=int(num_experts),
        num_experts_per_token=int(top_k),
        num_shared_experts=int(shared),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        moe_renormalize=bool(get("moe_renormalize", text.get("norm_topk_prob", True))),
        num_expert_group=int(n_group),
        topk_group=int(get("topk_group", 1) or 1),
        routed_expert_hidden_size=get("routed_expert_hidden_size"),
        latent_moe_norm=bool(get("latent_moe_use_norm", False)),
        hidden_act=get("hidden_act", "silu"),
        situ_beta=float(get("activation_situ_beta", None) or 1.0),   # null counts as absent, as in K3's code
        situ_linear_beta=get("activation_situ_linear_beta", None),
        expert_format=expert_format, quant_targets=quant_targets, quant_ignore=quant_ignore,
        attn_res_block_size=get("attn_res_block_size"),
        tie_word_embeddings=bool(get("tie_word_embeddings", top.get("tie_word_embeddings", False))),
        max_position_embeddings=int(get("max_position_embeddings", 1_048_576)),
        bos_token_id=get("bos_token_id", top.get("bos_token_id")),
        eos_token_id=eos,
        pad_token_id=get("pad_token_id", top.get("pad_token_id")),
        vision=dict(vision) if vision else None,
        model_type=str(top.get("model_type", "")),
        thinks=_optional_bool(top, "k3jax_thinks_by_default"),
    )
    unknown = sorted(set(text) - used - _IGNORED_FIELDS - {"text_config", "vision_config"})
    if unknown:
        log.warning("config.json: ignoring unknown fields %s", ", ".join(unknown))
    return cfg


def _optional_bool(d: Mapping[str, Any], key: str) -> bool | None:
    v = d.get(key)
    if v is not None and not isinstance(v, bool):
        raise ValueError(f"config.json: {key} must be true, false or absent, got {v!r}")
    return v


def _first_group_format(q: Mapping[str, Any]) -> str | None:
    groups = q.get("config_groups") or {}
    for g in groups.values():
        if isinstance(g, Mapping) and g.get("format"):
            return g["format"]
    return None
