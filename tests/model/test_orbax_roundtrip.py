"""Converted checkpoints: transformers -> convert -> load_model logits parity, and the orbax
streaming save / sharded restore (grouped items, target shardings, dtype casts, errors)."""
import json
import os

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tests.support.hf_reference import tiny_kimi_linear_model
from k3jax import load_model
from k3jax.checkpoint import orbax_io
from k3jax.convert import main
from tools import synthetic_k3
from k3jax.params import is_leaf, param_spec
from k3jax.presets import preset_config


def _max_rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("spelling", ["save_pretrained", "transformers-in-memory"])
def test_transformers_round_trip_logits(tmp_path, spelling):
    """KimiLinearForCausalLM -> save -> python -m k3jax.convert -> load_model(OUT_DIR): same logits."""
    model = tiny_kimi_linear_model(seed=4, q_lora_rank=24 if spelling == "save_pretrained" else None)
    src, dst = tmp_path / "hf", tmp_path / "out"
    model.save_pretrained(src)
    if spelling != "save_pretrained":   # transformers' own names: packed conv1d, forget_gate.*, gate_up_proj
        from safetensors.torch import save_file
        for f in src.glob("*.safetensors*"):
            f.unlink()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src / "model.safetensors"))
    assert main(["--src", str(src), "--dst", str(dst), "--dtype", "float32", "--no-progress"]) == 0
    assert not (dst / "model.safetensors").exists() and (dst / "k3jax_params" / "index.json").exists()
    tokens = np.random.RandomState(0).randint(0, 256, (2, 100)).astype(np.int32)
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
    m = load_model(str(dst), dtype="float32")
    assert m.params["embed"].dtype == jnp.float32
    assert _max_rel(m.logits(tokens), ref) <= 1e-4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = preset_config("tiny-random")
    rng = np.random.default_rng(11)          # numpy values: init_params is slow with 8 fake devices
    params = jax.tree_util.tree_map(lambda l: synthetic_k3.random_leaf("", l, rng).astype(
        np.uint8 if l.kind.startswith("mx") else np.float32), param_spec(cfg), is_leaf=is_leaf)
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    path = tmp_path_factory.mktemp("ck") / "k3jax_params"
    index = orbax_io.save_params_streaming(path, ((orbax_io.leaf_key(p), np.asarray(v)) for p, v in flat),
                                           group_bytes=1 << 20, chunk_bytes=256 << 10, progress=False)
    return cfg, params, path, index


def _pairs(a, b):
    fa, fb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)
    assert len(fa) == len(fb)
    return [(orbax_io.leaf_key(p), x, y) for (p, x), y in zip(fa, fb)]


def test_grouped_items_and_expert_chunks(saved):
    import tensorstore as ts
    _, params, path, index = saved
    assert len(index["items"]) > 3                  # several orbax items, each a group of leaves
    assert sorted(os.listdir(path / "items")) == index["items"]
    key = "layers.1.mlp.experts.w1_packed"
    item = path / "items" / index["leaves"][key]["item"]
    arr = None
    for driver in ("zarr", "zarr3"):
        try:
            arr = ts.open({"driver": driver, "kvstore": {"driver": "ocdbt", "base": f"file://{item}",
                                                         "path": key.replace(".", "__")}}).result()
            break
        except ValueError:
            continue
    assert arr is not None
    # One expert per chunk: an expert-parallel shard reads only its own experts' bytes.
    assert arr.chunk_layout.read_chunk.shape[0] == 1 and tuple(arr.shape) == params["layers"][1]["mlp"]["experts"]["w1_packed"].shape
    np.testing.assert_array_equal(arr.read().result(), params["layers"][1]["mlp"]["experts"]["w1_packed"])


def test_restore_into_target_shardings(saved):
    cfg, params, path, _ = saved
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("ep", "tp"))
    spec = param_spec(cfg)

    def rule(p, leaf):
        k = orbax_io.leaf_key(p)
        if ".experts." in k:
            return NamedSharding(mesh, P("ep"))                  # experts split over E
        if k.endswith("q_proj") and len(leaf.shape) == 2:
            return NamedSharding(mesh, P(None, "tp"))            # output columns split
        return NamedSharding(mesh, P())

    shardings = jax.tree_util.tree_map_with_path(rule, spec, is_leaf=is_leaf)
    got = orbax_io.restore_params(path.parent, cfg, jnp.bfloat16, shardings=shardings)
    n_split = 0
    flat_spec = jax.tree_util.tree_leaves(spec, is_leaf=is_leaf)
    flat_sh = jax.tree_util.tree_leaves(shardings)
    for (k, g, want), leaf, sh in zip(_pairs(got, params), flat_spec, flat_sh):
        dt = leaf.dtype(jnp.bfloat16)          # float weights cast to bf16 on read; fp32 kinds, uint8 kept
        assert g.dtype == dt and g.sharding == sh, k
        np.testing.assert_array_equal(np.asarray(g), np.asarray(jnp.asarray(want).astype(dt)), err_msg=k)
        if ".experts." in k:
            assert g.addressable_shards[0].data.shape == (want.shape[0] // 4,) + want.shape[1:]
            n_split += 1
        elif k.endswith("attn.q_proj"):
            assert g.addressable_shards[0].data.shape == (want.shape[0], want.shape[1] // 2)
            n_split += 1
    assert n_split > 10


def test_restore_with_mesh_default_shardings(saved):
    """The partition rules' shardings when given (k3jax.load_model gives them); a mesh alone: replicated."""
    cfg, params, path, _ = saved
    from sharding.mesh import make_mesh
    from sharding.rules import param_shardings
    mesh = make_mesh({"expert": 2, "tensor": 2}, jax.devices()[:4])
    got = orbax_io.restore_params(path, cfg, jnp.float32, shardings=param_shardings(cfg, mesh))
    want_sh = jax.tree_util.tree_leaves(param_shardings(cfg, mesh))
    assert any(not s.is_fully_replicated for s in want_sh)
    for (k, g, want), sh in zip(_pairs(got, params), want_sh):
        assert g.sharding == sh, k
        np.testing.assert_array_equal(np.asarray(g), want, err_msg=k)
    flat = Mesh(np.array(jax.devices()[:4]), ("x",))
    got = orbax_io.restore_params(path, cfg, jnp.float32, mesh=flat)
    for k, g, want in _pairs(got, params):
        assert g.sharding == NamedSharding(flat, P()), k
        np.testing.assert_array_equal(np.asarray(g), want, err_msg=k)


def test_load_model_converted_dir(saved, tmp_path):
    cfg, params, path, _ = saved
    # A converted dir (config.json + k3jax_params) loads through load_model, no mesh: first device.
    os.symlink(path, tmp_path / "k3jax_params")
    from k3jax.presets import preset_config_dict
    (tmp_path / "config.json").write_text(json.dumps(preset_config_dict("tiny-random")))
    m = load_model(str(tmp_path), dtype="float32")
    assert m.tokenizer is None
    for k, g, want in _pairs(m.checkpoint_params(), params):
        assert g.sharding.device_set == {jax.devices()[0]}
        np.testing.assert_array_equal(np.asarray(g), want, err_msg=k)


def test_restore_errors(saved, tmp_path):
    cfg, _, path, _ = saved
    with pytest.raises(ValueError, match=r"does not match config.json: missing .*experts.w1"):
        orbax_io.restore_params(path, cfg.replace(expert_format="bf16"), jnp.float32)
    with pytest.raises(ValueError, match="shape"):
        orbax_io.restore_params(path, cfg.replace(vocab_size=2048), jnp.float32)
    # A save that stops half way has no index.json, and is refused.
    part = tmp_path / "partial"

    def leaves():
        yield "embed", np.zeros((4, 4), np.float32)
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        orbax_io.save_params_streaming(part, leaves(), group_bytes=1, progress=False)
    assert (part / "items" / "00000").exists()
    with pytest.raises(ValueError, match="did not finish"):
        orbax_io.restore_params(part, cfg, jnp.float32)
