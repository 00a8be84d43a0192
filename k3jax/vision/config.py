"""Vision tower + projector configuration (MoonViT as in Kimi K2.5 / K3).

`VisionConfig.from_dict` reads a checkpoint's `vision_config` in either spelling:
- transformers' `kimi_k25` (`hidden_size`, `num_hidden_layers`, `num_attention_heads`,
  `intermediate_size`, `pos_emb_height/width/time`, `rope_parameters`), with the projector fields
  (`projection_hidden_size`, `projection_layer_norm_eps`) at the top level of the config;
- Moonshot's remote code (`vt_hidden_size`, `vt_num_hidden_layers`, `vt_num_attention_heads`,
  `vt_intermediate_size`, `init_pos_emb_height/width/time`, `mm_hidden_size`, `text_hidden_size`,
  `projector_ln_eps`, `mm_projector_type`, and K3's `qkv_hidden_size`, `norm_type`, `attn_bias`,
  `linear_bias`, `patch_embed_proj_bias`, `pos_emb_interpolation_mode`).

Missing fields take transformers' `Kimi_K25VisionConfig` defaults (patch 14, hidden 1152, 27 layers,
16 heads, MLP 4304, gelu-tanh, 64x64 position table, 4 frames, 2x2 merge, rope theta 1e4, biases,
LayerNorm eps 1e-5, bicubic resampling, LayerNorm->Linear->GELU->Linear projector), which are also
what Moonshot's K2.5 code falls back to. The K3 release sets the Moonshot K3 fields (RMSNorm, no
biases, qkv width != hidden, "patchmergerv2" projector with a post-RMSNorm): those are supported too.
Unknown fields warn; unsupported values raise ValueError naming the field.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

log = logging.getLogger(__name__)

# Fields that carry nothing the tower needs (HF bookkeeping; attention backends).
_IGNORED = {
    "model_type", "architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
    "_attn_implementation", "_attn_implementation_autoset", "kimi_attn_implementation",
    "initializer_range", "return_dict", "output_hidden_states", "output_attentions",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "tie_word_embeddings", "use_deterministic_attn", "in_channels", "num_channels",
    "max_pos_emb_height", "max_pos_emb_width", "rope_max_size",
}

# (ours, transformers kimi_k25 name, Moonshot name): both spellings of the same field.
_ALIASES = (
    ("hidden_size", "hidden_size", "vt_hidden_size"),
    ("num_layers", "num_hidden_layers", "vt_num_hidden_layers"),
    ("num_heads", "num_attention_heads", "vt_num_attention_heads"),
    ("intermediate_size", "intermediate_size", "vt_intermediate_size"),
    ("pos_emb_height", "pos_emb_height", "init_pos_emb_height"),
    ("pos_emb_width", "pos_emb_width", "init_pos_emb_width"),
    ("pos_emb_time", "pos_emb_time", "init_pos_emb_time"),
    ("hidden_act", "hidden_act", "activation_func"),
)

# Moonshot fields whose only implemented value is fixed here.
_ONLY = {
    "pos_emb_type": "divided_fixed",
    "merge_type": "sd2_tpool",
    "mlp_type": "mlp2",
    "video_attn_type": "spatial_temporal",
}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Everything the vision tower and projector compute with (defaults: transformers kimi_k25)."""

    patch_size: int = 14
    hidden_size: int = 1152
    num_layers: int = 27
    num_heads: int = 16
    intermediate_size: int = 4304
    qkv_hidden_size: int | None = None       # attention width (K3: 1536 != hidden); None: hidden_size
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4                     # frames with a temporal embedding (video)
    pos_interp: str = "bicubic"               # "bicubic" | "bilinear" (align_corners=False)
    merge_kernel: tuple[int, int] = (2, 2)
    hidden_act: str = "gelu_pytorch_tanh"     # "gelu_pytorch_tanh" | "gelu"
    rope_theta: float = 10000.0
    norm: str = "layernorm"                   # "layernorm" | "rmsnorm" (K3)
    norm_eps: float | None = 1e-5             # None: torch RMSNorm's default, finfo(fp32 compute).eps = 1.19e-7
    attn_bias: bool = True
    mlp_bias: bool = True
    patch_bias: bool = True
    projector: str = "patchmerger"            # "patchmerger" (pre-LayerNorm, biases) | "patchmergerv2" (post-RMSNorm)
    projector_eps: float = 1e-5
    projector_act: str = "gelu"               # exact erf GELU ("gelu_pytorch_tanh" accepted)
    text_hidden_size: int | None = None       # projector output width (the text model's hidden size)

    def __post_init__(self):
        _validate(self)

    @property
    def qkv_dim(self) -> int:
        return self.qkv_hidden_size or self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.qkv_dim // self.num_heads

    @property
    def merge_size(self) -> int:
        return self.merge_kernel[0] * self.merge_kernel[1]

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size

    def replace(self, **kw) -> "VisionConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_dict(cls, vision_config: Mapping[str, Any] | None, top: Mapping[str, Any] | None = None,
                  *, text_hidden_size: int | None = None) -> "VisionConfig":
        """Parse a `vision_config` dict; `top` is the whole config.json (projector fields, text width)."""
        return _parse(dict(vision_config or {}), dict(top or {}), text_hidden_size)


def _fail(field: str, value: Any, why: str):
    raise ValueError(f"vision config field {field!r} = {value!r}: {why}")


def _validate(c: VisionConfig):
    for name in ("patch_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                 "pos_emb_height", "pos_emb_width", "pos_emb_time"):
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            _fail(name, v, "must be a positive integer")
    if c.qkv_hidden_size is not None and (not isinstance(c.qkv_hidden_size, int) or c.qkv_hidden_size <= 0):
        _fail("qkv_hidden_size", c.qkv_hidden_size, "must be a positive integer")
    if c.qkv_dim % c.num_heads:
        _fail("num_attention_heads", c.num_heads, f"must divide the attention width {c.qkv_dim}")
    if c.head_dim % 4:
        _fail("num_attention_heads", c.num_heads, f"head dim {c.head_dim} must be divisible by 4 (2D rope)")
    if (len(c.merge_kernel) != 2 or any(not isinstance(k, int) or k <= 0 for k in c.merge_kernel)):
        _fail("merge_kernel_size", c.merge_kernel, "must be two positive integers")
    if c.pos_interp not in ("bicubic", "bilinear"):
        _fail("pos_emb_interpolation_mode", c.pos_interp, "supported: 'bicubic', 'bilinear'")
    if c.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
        _fail("hidden_act", c.hidden_act, "supported: 'gelu_pytorch_tanh', 'gelu'")
    if c.projector_act not in ("gelu", "gelu_pytorch_tanh"):
        _fail("projector_hidden_act", c.projector_act, "supported: 'gelu', 'gelu_pytorch_tanh'")
    if c.norm not in ("layernorm", "rmsnorm"):
        _fail("norm_type", c.norm, "supported: 'layernorm', 'rmsnorm'")
    if c.norm_eps is not None and not c.norm_eps > 0:
        _fail("norm_eps", c.norm_eps, "must be positive (or None for torch RMSNorm's default)")
    if c.projector not in ("patchmerger", "patchmergerv2"):
        _fail("mm_projector_type", c.projector, "supported: 'patchmerger', 'patchmergerv2'")
    if not c.projector_eps > 0:
        _fail("projector_ln_eps", c.projector_eps, "must be positive")
    if not c.rope_theta > 0:
        _fail("rope_theta", c.rope_theta, "must be positive")
    if c.text_hidden_size is not None and (not isinstance(c.text_hidden_size, int) or c.text_hidden_size <= 0):
        _fail("text_hidden_size", c.text_hidden_size, "must be a positive integer")


def _int_pair(field: str, v) -> tuple[int, int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v)
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) for x in v):
        return (int(v[0]), int(v[1]))
    _fail(field, v, "must be an integer or a pair of integers")


def _parse(raw: dict, top: dict, text_hidden_arg: int | None) -> VisionConfig:
    used: set[str] = set()
    kw: dict[str, Any] = {}

    def take(key):
        used.add(key)
        return raw[key]

    for ours, hf, moon in _ALIASES:
        vals = {k: raw[k] for k in (hf, moon) if k in raw}
        used.update(vals)
        if len(set(map(repr, vals.values()))) > 1:
            _fail(moon, raw[moon], f"disagrees with {hf!r} = {raw[hf]!r}")
        if vals:
            kw[ours] = next(iter(vals.values()))

    if "patch_size" in raw:
        p = _int_pair("patch_size", take("patch_size"))
        if p[0] != p[1]:
            _fail("patch_size", raw["patch_size"], "only square patches are supported")
        kw["patch_size"] = p[0]
    if "merge_kernel_size" in raw:
        kw["merge_kernel"] = _int_pair("merge_kernel_size", take("merge_kernel_size"))
    if "qkv_hidden_size" in raw:
        kw["qkv_hidden_size"] = take("qkv_hidden_size")
    if "pos_emb_interpolation_mode" in raw:
        kw["pos_interp"] = take("pos_emb_interpolation_mode")
    if "norm_type" in raw:
        kw["norm"] = take("norm_type")
        # Moonshot's tower builds nn.LayerNorm(D) (eps 1e-5) or nn.RMSNorm(D) (eps None); torch
        # then uses the eps of its compute type (fp32 for bf16 inputs), not the 2^-7 of bf16.
        kw["norm_eps"] = 1e-5 if kw["norm"] == "layernorm" else None
    for key, ours in (("attn_bias", "attn_bias"), ("linear_bias", "mlp_bias"),
                      ("patch_embed_proj_bias", "patch_bias")):
        if key in raw:
            v = take(key)
            if not isinstance(v, bool):
                _fail(key, v, "must be true or false")
            kw[ours] = v
    for key, only in _ONLY.items():
        if key in raw and take(key) != only:
            _fail(key, raw[key], f"only {only!r} is implemented")

    rp = raw.get("rope_parameters")
    used.update({"rope_parameters", "rope_theta"})
    if rp is not None:
        if not isinstance(rp, Mapping):
            _fail("rope_parameters", rp, "must be a mapping")
        if rp.get("rope_type", "axial") not in ("axial", "default"):
            _fail("rope_parameters.rope_type", rp.get("rope_type"), "only axial 2D rope is implemented")
        if "rope_theta" in rp:
            kw["rope_theta"] = float(rp["rope_theta"])
    if "rope_theta" in raw:
        kw["rope_theta"] = float(raw["rope_theta"])

    # Projector: kimi_k25 keeps its fields at the top level, Moonshot inside vision_config.
    if "mm_projector_type" in raw:
        kw["projector"] = take("mm_projector_type")
    if "projector_hidden_act" in raw:
        kw["projector_act"] = take("projector_hidden_act")
    eps = {k: v for k, v in (("projector_ln_eps", raw.get("projector_ln_eps")),
                             ("projection_layer_norm_eps", top.get("projection_layer_norm_eps"))) if v is not None}
    used.add("projector_ln_eps")
    if len(set(eps.values())) > 1:
        _fail("projector_ln_eps", eps["projector_ln_eps"],
              f"disagrees with projection_layer_norm_eps = {eps['projection_layer_norm_eps']!r}")
    if eps:
        kw["projector_eps"] = float(next(iter(eps.values())))

    text = _text_hidden(raw, top, text_hidden_arg)
    used.add("text_hidden_size")
    if text is not None:
        kw["text_hidden_size"] = text

    cfg = VisionConfig(**kw)

    # The projector's input norm runs over one patch: its width must be the tower's.
    for key, val in (("mm_hidden_size", raw.get("mm_hidden_size")),
                     ("projection_hidden_size", top.get("projection_hidden_size"))):
        used.add(key)
        if val is not None and val != cfg.hidden_size:
            _fail(key, val, f"must equal the tower hidden size {cfg.hidden_size}")

    unknown = sorted(set(raw) - used - _IGNORED)
    if unknown:
        log.warning("vision_config: ignoring unknown fields %s", ", ".join(unknown))
    return cfg


def _text_hidden(raw: dict, top: dict, arg: int | None) -> int | None:
    tc = top.get("text_config")
    found = {
        "text_hidden_size (argument)": arg,
        "vision_config.text_hidden_size": raw.get("text_hidden_size"),
        "text_config.hidden_size": tc.get("hidden_size") if isinstance(tc, Mapping) else None,
        # Kimi-Linear-style configs keep the text fields at the top level.
        "hidden_size": top.get("hidden_size") if not isinstance(tc, Mapping) else None,
    }
    found = {k: v for k, v in found.items() if v is not None}
    if len(set(found.values())) > 1:
        _fail("text_hidden_size", found, "sources disagree")
    return int(next(iter(found.values()))) if found else None
