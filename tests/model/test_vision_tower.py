"""Vision tower + projector parity with transformers' kimi_k25 (every tensor randomized), both
checkpoint spellings, packing / padding / video, the K3 variant (RMSNorm, no biases, qkv width !=
hidden, bilinear table, post-RMSNorm projector), config parsing."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
k25 = pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
from transformers.core_model_loading import PermuteForRope  # noqa: E402
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig  # noqa: E402
from transformers.vision_utils import get_vision_interpolation_indices_and_weights  # noqa: E402

from k3jax.checkpoint.convert_stream import _dry_shape  # noqa: E402
from k3jax.checkpoint.hf_names import Source, path_str  # noqa: E402
from k3jax.vision import (VisionConfig, encode_images, load_vision_params, pad_pixel_values,  # noqa: E402
                          prepare_vision_batch, stack_blocks, tokens_per_image, vision_param_spec,
                          vision_sources)
from k3jax.vision.positions import interpolation_taps  # noqa: E402
from tests.support.tiers import slow_case  # noqa: E402

torch.set_num_threads(2)

TEXT = 48
HF_VISION = dict(patch_size=14, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                 intermediate_size=96, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4,
                 merge_kernel_size=[2, 2], rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
# The same tower in Moonshot's remote-code spelling.
MOON_VISION = dict(patch_size=14, vt_hidden_size=64, vt_num_attention_heads=4, vt_num_hidden_layers=2,
                   vt_intermediate_size=96, init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4,
                   merge_kernel_size=[2, 2], mm_hidden_size=64, text_hidden_size=TEXT, projector_ln_eps=1e-5,
                   mm_projector_type="patchmerger", pos_emb_type="divided_fixed", merge_type="sd2_tpool",
                   video_attn_type="spatial_temporal", projector_hidden_act="gelu")
GRID_A, GRID_B, CLIP = [1, 6, 8], [1, 10, 4], [2, 4, 6]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _randomize(module, seed):
    """Every tensor random: norms near 1, biases and the position table non-zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * r)
            elif name.endswith("bias"):
                p.copy_(0.2 * r)
            elif p.ndim >= 2 and "position_embeddings" not in name:
                p.copy_(r * p[0].numel() ** -0.5)
            else:
                p.copy_(0.5 * r)


class _ProjV2(torch.nn.Module):
    """K3's patchmergerv2, written from its description: concat -> Linear -> GELU -> Linear -> RMSNorm."""

    def __init__(self, d_in, d_out, eps):
        super().__init__()
        self.proj0 = torch.nn.Linear(d_in, d_in, bias=False)
        self.proj2 = torch.nn.Linear(d_in, d_out, bias=False)
        self.post_norm = torch.nn.RMSNorm(d_out, eps=eps)

    def forward(self, pooled):
        x = pooled.reshape(pooled.shape[0], -1)
        return self.post_norm(self.proj2(torch.nn.functional.gelu(self.proj0(x))))


def _k3ify(tower, qkv):
    """Turn transformers' tower into the K3 variant: RMSNorm (torch default eps), no biases,
    attention width `qkv` (head_dim from the config), bilinear position table."""
    D = tower.config.hidden_size
    tower.patch_embed.proj.bias = None
    tower.patch_embed.pos_emb.interpolation_mode = "bilinear"
    for layer in tower.layers:
        layer.norm1, layer.norm2 = torch.nn.RMSNorm(D), torch.nn.RMSNorm(D)
        a = layer.attn
        a.q_proj, a.k_proj, a.v_proj = (torch.nn.Linear(D, qkv, bias=False) for _ in range(3))
        a.proj = torch.nn.Linear(qkv, D, bias=False)
        a.head_dim = qkv // a.num_heads
        a.scaling = a.head_dim ** -0.5
        layer.mlp.fc1.bias = None
        layer.mlp.fc2.bias = None
    tower.final_layernorm = torch.nn.RMSNorm(D)


@pytest.fixture(scope="module")
def k25_ref():
    torch.manual_seed(0)
    cfg = Kimi_K25Config(vision_config=dict(HF_VISION), text_config={"model_type": "deepseek_v3", "hidden_size": TEXT},
                         projection_hidden_size=64, projection_layer_norm_eps=1e-5)
    cfg.vision_config._attn_implementation = "eager"
    tower = k25.Kimi_K25VisionModel(cfg.vision_config).eval()
    proj = k25.Kimi_K25MultimodalProjection(cfg).eval()
    _randomize(tower, 1)
    _randomize(proj, 2)
    sd = {f"model.vision_tower.{k}": v.numpy() for k, v in tower.state_dict().items()}
    sd.update({f"model.mm_projector.{k}": v.numpy() for k, v in proj.state_dict().items()})
    vcfg = VisionConfig.from_dict(cfg.vision_config.to_dict(), cfg.to_dict())
    return tower, proj, sd, vcfg


@pytest.fixture(scope="module")
def k3_ref():
    torch.manual_seed(0)
    qkv = 96                                                 # 4 heads x 24 != hidden 64, like K3's 1536 vs 1024
    vc = Kimi_K25VisionConfig(**HF_VISION, head_dim=qkv // 4)
    vc._attn_implementation = "eager"
    tower = k25.Kimi_K25VisionModel(vc).eval()
    _k3ify(tower, qkv)
    proj = _ProjV2(4 * 64, TEXT, 1e-5).eval()
    _randomize(tower, 3)
    _randomize(proj, 4)
    sd = {f"model.vision_tower.{k}": v.numpy() for k, v in tower.state_dict().items()}
    sd.update({f"mm_projector.{k.replace('proj0', 'proj.0').replace('proj2', 'proj.2')}": v.numpy()
               for k, v in proj.state_dict().items()})
    vcfg = VisionConfig.from_dict({**MOON_VISION, "qkv_hidden_size": qkv, "norm_type": "rmsnorm", "attn_bias": False,
                                   "linear_bias": False, "patch_embed_proj_bias": False,
                                   "pos_emb_interpolation_mode": "bilinear", "mm_projector_type": "patchmergerv2"})
    return tower, proj, sd, vcfg


def _pixels(n, seed):
    return np.random.default_rng(seed).standard_normal((n, 3, 14, 14)).astype(np.float32)


def _reference(tower, proj, px, grid):
    with torch.no_grad():
        pooled = tower(torch.from_numpy(px), torch.tensor(grid)).pooler_output
        return proj(pooled).reshape(pooled.shape[0], -1).numpy()


def _ours(params, vcfg, px, grid, pad=None, q_block=1024, jit=False):
    vb = prepare_vision_batch(vcfg, grid, pad)
    fn = jax.jit(encode_images, static_argnums=1, static_argnames="q_block") if jit else encode_images
    out = np.asarray(fn(params, vcfg, pad_pixel_values(px, vb), vb, q_block=q_block))
    assert out.shape == (vb.padded_patches // vcfg.merge_size, TEXT)
    return out[: vb.num_tokens], vb


CASES = {  # name: (grids, pad_patches_to, q_block, jit)
    "6x8": ([GRID_A], None, 1024, False),
    "10x4": ([GRID_B], None, 1024, False),
    "packed": ([GRID_A, GRID_B], None, 1024, True),
    "packed+bucket": ([GRID_B, GRID_A], 128, 1024, True),
    "packed+bucket+qblocks": ([GRID_A, GRID_B], 120, 32, False),
    "video+image": ([CLIP, GRID_A], 112, 1024, False),
}


@pytest.mark.parametrize("case", [slow_case(c) if c in ("10x4", "packed", "packed+bucket+qblocks") else c
                                  for c in CASES])
def test_parity_kimi_k25(k25_ref, case):
    tower, proj, sd, vcfg = k25_ref
    grids, pad, q_block, jit = CASES[case]
    params = load_vision_params(sd, vcfg, dtype=np.float32)
    n = sum(math.prod(g) for g in grids)
    px = _pixels(n, 5)
    ref = _reference(tower, proj, px, grids)
    out, vb = _ours(params, vcfg, px, grids, pad, q_block, jit)
    assert vb.tokens_per_image == tuple(tokens_per_image(vcfg, grids))
    assert out.shape == ref.shape
    err = _rel(out, ref)
    print(f"kimi_k25 {case}: max rel err {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("case", ["packed+bucket+qblocks", slow_case("video+image")])
def test_parity_k3_variant(k3_ref, case):
    tower, proj, sd, vcfg = k3_ref
    grids, pad, q_block, jit = CASES[case]
    params = load_vision_params(sd, vcfg, dtype=np.float32)
    assert "b" not in params["blocks"][0]["wqkv"] and "post_norm" in params["projector"]
    px = _pixels(sum(math.prod(g) for g in grids), 6)
    err = _rel(_ours(params, vcfg, px, grids, pad, q_block)[0], _reference(tower, proj, px, grids))
    print(f"k3 variant {case}: max rel err {err:.2e}")
    assert err <= 1e-4


def test_padding_and_packing_do_not_leak(k25_ref):
    """Real rows are the same whatever the padding holds, and an image packed with another gives
    the same tokens as alone (block-diagonal attention)."""
    _, _, sd, vcfg = k25_ref
    params = stack_blocks(load_vision_params(sd, vcfg, dtype=np.float32))   # also covers the scan path
    px = _pixels(88, 7)
    vb = prepare_vision_batch(vcfg, [GRID_A, GRID_B], 128)
    zeros = np.asarray(encode_images(params, vcfg, pad_pixel_values(px, vb), vb))[:vb.num_tokens]
    junk = np.concatenate([px, 1e3 * _pixels(40, 8)])
    noisy = np.asarray(encode_images(params, vcfg, junk, vb))[:vb.num_tokens]
    np.testing.assert_array_equal(zeros, noisy)
    alone_b, _ = _ours(params, vcfg, px[48:], [GRID_B])
    assert _rel(zeros[vb.token_offsets[1]:], alone_b) <= 1e-5


def test_moonshot_spelling_loads_the_same_tree(k25_ref):
    """Rename transformers' weights to Moonshot's, fusing wqkv and undoing transformers' rope
    permutation with transformers' own PermuteForRope (inverse): same parameters."""
    tower, _, sd, vcfg = k25_ref
    unperm = PermuteForRope(inverse=True)
    moon = {}
    for k, v in sd.items():
        k = k.replace("model.vision_tower.", "vision_tower.").replace("model.mm_projector.", "mm_projector.")
        k = k.replace("pos_emb.position_embeddings", "pos_emb.weight")
        k = k.replace("final_layernorm", "encoder.final_layernorm")
        k = k.replace("in_proj", "proj.0").replace("out_proj", "proj.2")
        for a, b in (("norm1", "norm0"), ("norm2", "norm1"), ("mlp.fc1", "mlp.fc0"), ("mlp.fc2", "mlp.fc1"),
                     ("attn.proj", "wo")):
            if f".{a}." in k and "layers." in k:
                k = k.replace(f".{a}.", f".{b}.")
                break
        moon[k.replace("vision_tower.layers.", "vision_tower.encoder.blocks.")] = v
    for i in range(vcfg.num_layers):
        for s in ("weight", "bias"):
            q, kk, v = (moon.pop(f"vision_tower.encoder.blocks.{i}.attn.{n}_proj.{s}") for n in "qkv")
            q, kk = (unperm._permute_for_rope(torch.from_numpy(t), tower.config).numpy() for t in (q, kk))
            moon[f"vision_tower.encoder.blocks.{i}.wqkv.{s}"] = np.concatenate([q, kk, v])
    assert not [k for k in moon if "attn." in k or "layers." in k]
    a = load_vision_params(sd, vcfg, dtype=np.float32)
    b = load_vision_params(moon, VisionConfig.from_dict(MOON_VISION), dtype=np.float32)
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
    # Kimi-VL's projector spelling reads the same weights.
    vl = {k.replace("mm_projector.", "multi_modal_projector.").replace("proj.0", "linear_1")
          .replace("proj.2", "linear_2"): v for k, v in moon.items()}
    assert "multi_modal_projector.linear_2.weight" in vl
    c = load_vision_params(vl, VisionConfig.from_dict(MOON_VISION), dtype=np.float32)
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, c)


def test_sources_dry_run_shapes(k25_ref):
    """The converter checks shapes by running each Source on zero-byte arrays: every vision
    Source must produce exactly the spec's shape that way."""
    _, _, sd, vcfg = k25_ref
    flat, _ = vision_sources(vcfg, sd.keys())
    for path, src, leaf in flat:
        assert isinstance(src, Source), path_str(path)
        assert _dry_shape(src, [sd[n].shape for n in src.names]) == leaf.shape, path_str(path)
    with pytest.raises(ValueError, match="missing vision tensors"):
        load_vision_params({k: v for k, v in sd.items() if "layers.1.attn.k_proj" not in k}, vcfg)


@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
def test_interpolation_matches_transformers_and_interpolate(mode):
    grid = np.array([[1, 6, 8], [1, 10, 4], [2, 3, 9], [1, 64, 64], [1, 20, 70]])
    counts = grid.prod(1)
    img = np.repeat(np.arange(len(grid)), counts)
    local = np.arange(counts.sum()) - np.repeat(np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    within = local % (grid[img, 1] * grid[img, 2])
    row, col = within // grid[img, 2], within % grid[img, 2]
    idx, w = interpolation_taps(row, col, grid[img, 1], grid[img, 2], (32, 32), mode)
    ti, tw = get_vision_interpolation_indices_and_weights(torch.tensor(grid), 32, mode=mode)
    np.testing.assert_array_equal(idx, ti.numpy())
    np.testing.assert_allclose(w, tw.numpy(), rtol=0, atol=2e-7)
    # Non-square table (transformers' helper assumes square): against F.interpolate itself.
    table = np.random.default_rng(0).standard_normal((5, 7, 3)).astype(np.float32)
    for h, wd in ((6, 8), (10, 4), (5, 7), (3, 2)):
        r, c = np.divmod(np.arange(h * wd), wd)
        i, ww = interpolation_taps(r, c, np.full(h * wd, h), np.full(h * wd, wd), (5, 7), mode)
        ours = np.einsum("nt,ntd->nd", ww, table.reshape(-1, 3)[i])
        ref = torch.nn.functional.interpolate(torch.from_numpy(table).permute(2, 0, 1)[None], size=(h, wd),
                                              mode=mode, align_corners=False)[0].permute(1, 2, 0).reshape(-1, 3)
        np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-5, atol=1e-5)


def test_config_spellings_and_errors():
    hf = VisionConfig.from_dict(HF_VISION, {"projection_hidden_size": 64, "projection_layer_norm_eps": 1e-5,
                                            "text_config": {"hidden_size": TEXT}})
    moon = VisionConfig.from_dict(MOON_VISION)
    assert hf == moon
    assert (moon.hidden_size, moon.num_layers, moon.num_heads, moon.intermediate_size, moon.text_hidden_size,
            moon.pos_emb_height, moon.merge_kernel, moon.norm, moon.projector) == (
        64, 2, 4, 96, TEXT, 8, (2, 2), "layernorm", "patchmerger")
    # The shipped K3 config's two fields; everything else takes transformers' kimi_k25 defaults.
    k3 = VisionConfig.from_dict({"patch_size": 14, "vt_hidden_size": 1152}, {"text_config": {"hidden_size": 7168}})
    assert k3 == VisionConfig(text_hidden_size=7168)
    assert (k3.num_layers, k3.num_heads, k3.intermediate_size, k3.pos_emb_height, k3.head_dim) == (27, 16, 4304, 64, 72)
    assert jax.tree_util.tree_leaves(vision_param_spec(k3), is_leaf=lambda x: hasattr(x, "kind"))
    v2 = VisionConfig.from_dict({**MOON_VISION, "norm_type": "rmsnorm", "qkv_hidden_size": 96})
    assert (v2.norm, v2.norm_eps, v2.qkv_dim, v2.head_dim) == ("rmsnorm", None, 96, 24)
    bad = [
        ({**MOON_VISION, "norm_type": "groupnorm"}, "norm_type"),
        ({**MOON_VISION, "pos_emb_type": "learned"}, "pos_emb_type"),
        ({**MOON_VISION, "mm_projector_type": "identity"}, "mm_projector_type"),
        ({**MOON_VISION, "mm_hidden_size": 32}, "mm_hidden_size"),
        ({**MOON_VISION, "hidden_size": 128}, "vt_hidden_size"),
        ({**MOON_VISION, "vt_num_attention_heads": 5}, "num_attention_heads"),
        ({**MOON_VISION, "pos_emb_interpolation_mode": "nearest"}, "pos_emb_interpolation_mode"),
        ({**HF_VISION, "rope_parameters": {"rope_type": "yarn"}}, "rope_type"),
        ({**HF_VISION, "patch_size": [14, 16]}, "patch_size"),
        ({**HF_VISION, "hidden_act": "relu"}, "hidden_act"),
    ]
    for raw, field in bad:
        with pytest.raises(ValueError, match=field):
            VisionConfig.from_dict(raw)
    with pytest.raises(ValueError, match="text_hidden_size"):
        VisionConfig.from_dict(MOON_VISION, {"text_config": {"hidden_size": 99}})
    with pytest.raises(ValueError, match="merge kernel"):
        prepare_vision_batch(moon, [[1, 5, 4]])
    with pytest.raises(ValueError, match="frames"):
        prepare_vision_batch(moon, [[5, 4, 4]])
    with pytest.raises(ValueError, match="pad_patches_to"):
        prepare_vision_batch(moon, [[1, 4, 4]], pad_patches_to=8)


def test_bf16_params_and_rmsnorm_dtype_eps(k25_ref):
    """bf16 params run end to end close to the fp32 reference. K3's RMSNorm is torch.nn.RMSNorm(eps=None):
    torch then adds the eps of its fp32 compute type even for bf16 inputs (not bf16's 2^-7, which
    the docs suggest and which would change small activations a lot)."""
    from k3jax.vision.tower import _norm_apply

    tower, proj, sd, vcfg = k25_ref
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), load_vision_params(sd, vcfg))
    px = _pixels(48, 9)
    out, _ = _ours(params, vcfg, px, [GRID_A], jit=True)
    err = _rel(out.astype(np.float32), _reference(tower, proj, px, [GRID_A]))
    print(f"bf16 params vs fp32 reference: max rel err {err:.2e}")
    assert np.isfinite(out.astype(np.float32)).all() and err <= 5e-2

    g = torch.Generator().manual_seed(0)
    x = (0.05 * torch.randn(8, 64, generator=g)).to(torch.bfloat16)
    norm = torch.nn.RMSNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(64, generator=g))
        ref = norm(x).float().numpy()
    rms = VisionConfig.from_dict({**MOON_VISION, "norm_type": "rmsnorm"})
    p = {"w": jnp.asarray(norm.weight.detach().float().numpy(), jnp.bfloat16)}
    xj = jnp.asarray(x.float().numpy(), jnp.bfloat16)
    ours = np.asarray(_norm_apply(p, xj, rms.norm_eps), np.float32)
    assert _rel(ours, ref) <= 1e-2
    assert _rel(np.asarray(_norm_apply(p, xj, 2.0 ** -7), np.float32), ref) > 0.5


def test_tower_modules_declare_their_parameters():
    """VisionTower declares every parameter (random from nnx.Rngs, abstract without); the stacked
    tower (one block scanned) computes what the per-layer one does over the same weights."""
    from flax import nnx
    from k3jax.params import is_leaf
    from k3jax.presets import preset_config
    from k3jax.vision.tower import VisionTower, tower_of
    c = preset_config("tiny-random")
    vc = VisionConfig.from_dict(c.vision, text_hidden_size=c.hidden_size)
    spec = vision_param_spec(vc, c.hidden_size)
    assert VisionTower(vc, c.hidden_size).spec() == spec
    # random parameters made by the modules' own __init__ (one jitted program)
    params = jax.jit(lambda: VisionTower(vc, c.hidden_size, dtype=jnp.float32, rngs=nnx.Rngs(0)).tree())()
    for leaf, x in zip(jax.tree_util.tree_leaves(spec, is_leaf=is_leaf), jax.tree_util.tree_leaves(params)):
        assert x.shape == leaf.shape and leaf.axes == (None,) * len(leaf.shape)
    assert len({float(jnp.sum(x)) for x in jax.tree_util.tree_leaves(params)}) > len(jax.tree_util.tree_leaves(params)) // 2
    stacked = tower_of(stack_blocks(params), vc)
    assert stacked.stacked and stacked.blocks.wqkv.w.logical_axes[0] == "layers"
    px = np.random.RandomState(0).randn(48, 3, vc.patch_size, vc.patch_size).astype(np.float32)
    vb = prepare_vision_batch(vc, [GRID_A])
    run = jax.jit(lambda p, x: tower_of(p, vc)(x, vb))
    a, b = (np.asarray(run(p, pad_pixel_values(px, vb)))[:vb.num_tokens] for p in (params, stack_blocks(params)))
    assert np.abs(a).max() > 0 and np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
