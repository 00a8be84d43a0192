"""HF -> k3jax conversion of a synthetic K3-format checkpoint (Moonshot names, MXFP4 experts):
values, logits against the float64 numpy model, --dequantize, and every input error leaving
no output behind."""
import json
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import jax

from tests.support import numpy_model
from tools import synthetic_k3
from k3jax import load_model
from k3jax.checkpoint import convert_stream, orbax_io
from k3jax.convert import main
from k3jax.params import is_leaf, param_spec

REPO = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """A synthetic K3 checkpoint (several shards + vision tensors + tokenizer files) and its params."""
    src = tmp_path_factory.mktemp("k3") / "hf"
    cfg, params, _ = synthetic_k3.write_checkpoint(src, seed=7, shard_bytes=1 << 20)
    return src, cfg, params


@pytest.fixture(scope="module")
def converted(k3, tmp_path_factory):
    src, _, _ = k3
    out = tmp_path_factory.mktemp("out")
    dsts = {}
    for name, extra in [("fp32", ["--dtype", "float32"]), ("bf16", []), ("deq", ["--dequantize"])]:
        dsts[name] = out / name
        assert main(["--src", str(src), "--dst", str(dsts[name]), "--no-progress"] + extra) == 0
    return dsts


def _flat(tree):
    return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): v
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_layout_and_aux_files(k3, converted):
    src, cfg, _ = k3
    dst = converted["bf16"]
    assert sorted(os.listdir(dst)) == ["chat_template.jinja", "config.json", "k3jax_params", "k3jax_vision.safetensors",
                                       "tiktoken.model", "tokenizer_config.json"]
    assert (dst / "tiktoken.model").read_bytes() == (src / "tiktoken.model").read_bytes()
    index = orbax_io.read_index(dst)
    assert index["expert_format"] == "mxfp4" and not index["dequantized"]
    spec_keys = set(_flat(jax.tree_util.tree_map(lambda l: 0, param_spec(cfg), is_leaf=is_leaf)))
    assert set(index["leaves"]) == spec_keys
    assert not [n for n in os.listdir(dst.parent) if n.startswith(".")]


def test_bf16_conversion_is_bit_exact(k3, converted):
    """Every leaf restored from the default (bf16) conversion equals the generated k3jax value."""
    _, cfg, params = k3
    got = _flat(orbax_io.restore_params(converted["bf16"], cfg, ml_dtypes.bfloat16))
    want = _flat(params)
    assert set(got) == set(want)
    for k, v in want.items():
        g = np.asarray(got[k])
        assert g.shape == v.shape, k
        assert g.dtype == (v.dtype if v.dtype in (np.uint8, np.float32) else ml_dtypes.bfloat16), k
        np.testing.assert_array_equal(g.astype(np.float64), v.astype(np.float64), err_msg=k)


def test_converted_and_hf_logits_match_numpy_float64(k3, converted):
    src, cfg, params = k3
    tokens = np.random.RandomState(3).randint(0, cfg.vocab_size, 24).astype(np.int32)
    ref = numpy_model.forward(params, cfg, tokens)
    m = load_model(str(converted["fp32"]), dtype="float32")
    assert m.tokenizer is not None and m.tokenizer.vocab_size == cfg.vocab_size
    ours = m.logits(tokens[None])[0]
    per_token = np.abs(ours - ref).max(-1) / np.abs(ref).max()
    assert np.median(per_token) <= 5e-5 and per_token.max() <= 2e-3, per_token
    # The in-memory HF path reads the same checkpoint into the same fp32 values.
    hf = load_model(str(src), dtype="float32")
    np.testing.assert_array_equal(hf.logits(tokens[None])[0], ours)


def test_dequantize_equals_packed_dequantized(k3, converted):
    _, cfg, _ = k3
    raw = json.loads((converted["deq"] / "config.json").read_text())
    assert "quantization_config" not in raw and "quantization_config" not in raw["text_config"]
    deq = _flat(load_model(str(converted["deq"]), dtype="bfloat16").checkpoint_params())
    packed = _flat(orbax_io.restore_params(converted["bf16"], cfg, ml_dtypes.bfloat16))
    n = 0
    for k, v in deq.items():
        if k.split(".")[-1] in ("w1", "w2", "w3"):
            p, s = np.asarray(packed[k + "_packed"]), np.asarray(packed[k + "_scale"])
            want = np.swapaxes(numpy_model.mxfp4_dequant(p, s), -1, -2)        # [E, out, in] -> [E, in, out]
            assert v.dtype == ml_dtypes.bfloat16 and v.shape == want.shape
            np.testing.assert_array_equal(np.asarray(v).astype(np.float64), want, err_msg=k)
            n += 1
        else:
            np.testing.assert_array_equal(np.asarray(v), np.asarray(packed[k]), err_msg=k)
    assert n == 3 * cfg.mlp_types.count("moe")


def test_top_level_quantization_config_and_overwrite(tmp_path):
    """HF usually writes quantization_config at the top level: it still selects MXFP4 experts."""
    src, dst = tmp_path / "hf", tmp_path / "out"
    raw = synthetic_k3.k3_config_dict(top_level_quant=True)
    cfg, params, _ = synthetic_k3.write_checkpoint(src, raw, seed=2, vision=False, tokenizer=False)
    dst.mkdir()
    (dst / "old.txt").write_text("x")
    assert main(["--src", str(src), "--dst", str(dst), "--no-progress"]) == 2     # exists: refused, untouched
    assert (dst / "old.txt").exists()
    assert main(["--src", str(src), "--dst", str(dst), "--no-progress", "--overwrite"]) == 0
    assert not (dst / "old.txt").exists() and sorted(os.listdir(tmp_path)) == ["hf", "out"]
    written = json.loads((dst / "config.json").read_text())
    assert written["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    got = _flat(load_model(str(dst), dtype="float32").checkpoint_params())
    for k, v in _flat(params).items():
        np.testing.assert_array_equal(np.asarray(got[k]).astype(np.float64), v.astype(np.float64), err_msg=k)


# ---- input errors: exit 2, one line naming the problem, nothing written --------------------------------------------

def _shard_of(src, name):
    return json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]


def _rewrite(src, name, fn):
    """Apply fn(dict of the shard's tensors) to the shard holding `name`; keep the index in sync."""
    from safetensors.numpy import load_file, save_file
    fname = _shard_of(src, name)
    tensors = load_file(str(src / fname))
    fn(tensors)
    save_file(tensors, str(src / fname))
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != fname or k in tensors}
    idx["weight_map"].update({k: fname for k in tensors})
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))


EXPERT = "language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight_packed"
QPROJ = "language_model.model.layers.1.self_attn.q_proj.weight"


def _truncate(src):
    f = src / _shard_of(src, QPROJ)
    f.write_bytes(f.read_bytes()[:-1000])


def _set_config(src, fn):
    raw = json.loads((src / "config.json").read_text())
    fn(raw)
    (src / "config.json").write_text(json.dumps(raw))


CASES = {
    "truncated-shard": (_truncate, "truncated"),
    "missing-tensor": (lambda s: _rewrite(s, EXPERT, lambda t: t.pop(EXPERT)), "missing tensors (1): " + EXPERT),
    "wrong-shape": (lambda s: _rewrite(s, QPROJ, lambda t: t.update({QPROJ: t[QPROJ][:, :-1].copy()})),
                    QPROJ + ": shape (128, 127) gives layers.1.attn.q_proj shape (127, 128), expected (128, 128)"),
    "wrong-dtype": (lambda s: _rewrite(s, EXPERT, lambda t: t.update({EXPERT: t[EXPERT].astype(np.int32)})),
                    EXPERT + ": dtype I32"),
    "unexpected-tensor": (lambda s: _rewrite(s, QPROJ, lambda t: t.update({"language_model.model.extra.weight": t[QPROJ]})),
                          "unexpected tensors (1; --allow-unexpected ignores them): language_model.model.extra.weight"),
    "bad-config-json": (lambda s: (s / "config.json").write_text("{not json"), "config.json: not valid JSON"),
    "bad-index-json": (lambda s: (s / "model.safetensors.index.json").write_text("{\"weight_map\": "), "malformed index"),
    "unknown-quant": (lambda s: _set_config(s, lambda r: r["text_config"].update(
        quantization_config={"quant_method": "fp8", "format": "float-quantized"})), "quantization_config"),
    "index-names-absent-tensor": (lambda s: _set_index_extra(s), "not in that file"),
    "missing-shard": (lambda s: (s / _shard_of(s, QPROJ)).unlink(), "shard named in the index does not exist"),
}


def _set_index_extra(src):
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"]["language_model.model.layers.1.self_attn.q_proj.weight"] = _shard_of(src, EXPERT)
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_cleanly(k3, tmp_path, capsys, case):
    src = tmp_path / "hf"
    shutil.copytree(k3[0], src)
    corrupt, expect = CASES[case]
    corrupt(src)
    dst = tmp_path / "out"
    rc = main(["--src", str(src), "--dst", str(dst), "--no-progress"])
    err = [l for l in capsys.readouterr().err.splitlines() if "error" in l]
    assert rc == 2 and len(err) == 1 and expect in err[0], err
    assert case == "unexpected-tensor" or "unexpected" not in err[0], err
    assert sorted(os.listdir(tmp_path)) == ["hf"]                     # no OUT_DIR, no temporary
    if case == "unexpected-tensor":
        assert main(["--src", str(src), "--dst", str(dst), "--no-progress", "--allow-unexpected"]) == 0


def test_failure_while_streaming_leaves_nothing(k3, tmp_path, monkeypatch):
    """A read error after some parameters were written removes the partial output."""
    real, calls = convert_stream.build_leaf, []

    def flaky(ckpt, plan):
        calls.append(plan.key)
        if len(calls) == 60:
            raise convert_stream.ConversionError(f"{plan.key}: simulated read error")
        return real(ckpt, plan)

    monkeypatch.setattr(convert_stream, "build_leaf", flaky)
    from k3jax.convert import convert
    with pytest.raises(convert_stream.ConversionError, match="simulated"):
        convert(str(k3[0]), str(tmp_path / "out"), progress=False, group_bytes=1)   # one orbax item per leaf
    assert len(calls) == 60 and os.listdir(tmp_path) == []


def _cli(args):
    return subprocess.run([sys.executable, "-m", "k3jax.convert"] + [str(a) for a in args], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=REPO)


def test_cli_entry_points_and_bounded_memory(k3, tmp_path):
    """`python -m k3jax.convert` exits 0, or 2 with one line; converting a
    checkpoint 10x larger than its largest tensor costs well under that much extra memory (streaming)."""
    dst = tmp_path / "out"
    ok = _cli(["--src", k3[0], "--dst", dst, "--summary-json", tmp_path / "tiny.json"])
    assert ok.returncode == 0, ok.stderr
    assert "converting" in ok.stderr and "B/s" in ok.stderr          # tqdm progress with bytes
    bad = _cli(["--src", k3[0], "--dst", dst])
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"k3jax.convert: error: --dst {dst} already exists "
                                               "(pass --overwrite to replace it)"]
    src = tmp_path / "medium"
    synthetic_k3.write_checkpoint(src, synthetic_k3.wide_config(4, 512, 64, 1024, 1024), shard_bytes=64 << 20,
                                  keep_params=False, tokenizer=False)
    ok = _cli(["--src", src, "--dst", tmp_path / "medium-out", "--no-progress", "--summary-json", tmp_path / "m.json"])
    assert ok.returncode == 0, ok.stderr
    tiny, med = (json.loads((tmp_path / f).read_text()) for f in ("tiny.json", "m.json"))
    assert med["largest_bytes"] == 32 << 20 and med["bytes"] > 8 * med["largest_bytes"]
    extra = med["peak_rss_bytes"] - tiny["peak_rss_bytes"]
    # Measured ~2.9x here (the leaf, tensorstore's write buffer, allocator slack); holding the whole
    # checkpoint would need > 10x.
    assert extra < 5 * med["largest_bytes"], (extra, med)


def test_hf_and_converted_load_onto_one_shardings_tree(k3, converted):
    """One shardings tree (sharding.rules.param_shardings) serves orbax restore and Hugging Face
    loading: each leaf arrives on it (no second placement) with the same values either way."""
    from k3jax.checkpoint.hf_load import load_hf_params
    from sharding.mesh import make_mesh
    from sharding.rules import param_shardings
    src, cfg, _ = k3
    mesh = make_mesh("expert=4,tensor=2")
    shardings = param_shardings(cfg, mesh)
    hf = _flat(load_hf_params(src, cfg, np.float32, shardings=shardings))
    restored = _flat(orbax_io.restore_params(converted["fp32"], cfg, np.float32, shardings=shardings))
    want = _flat(shardings)
    assert set(hf) == set(restored) == set(want)
    assert any(len(s.device_set) > 1 and not s.is_fully_replicated for s in want.values())
    for k, s in want.items():
        assert hf[k].sharding.is_equivalent_to(s, hf[k].ndim) and restored[k].sharding.is_equivalent_to(s, hf[k].ndim), k
        np.testing.assert_array_equal(np.asarray(hf[k]), np.asarray(restored[k]), err_msg=k)
