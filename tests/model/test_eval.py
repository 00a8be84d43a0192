"""Perplexity (python -m k3jax.eval), its grain text pipeline, and the one-file weights the trained
tiny ships in: checked against a direct numpy computation over the model's logits."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.eval import main as eval_main
from k3jax.eval import nll_function, perplexity
from k3jax.text_data import eval_batches, piece_offsets, read_piece, token_stream

DOCS = {"a.txt": "The quick brown fox jumps over the lazy dog.\n\nIt was not amused.\n",
        "sub/b.txt": "Numbers: 1, 22, 333. A cache keeps pages; the scheduler packs requests into one step.\n" * 3,
        "skip.md": "not a .txt file"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for name, text in DOCS.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    return d


@pytest.fixture(scope="module")
def model():
    from k3jax import load_model
    return load_model("tiny-random", dtype="float32")


def _direct_nll(model, text: str, seq_len: int) -> tuple[float, int]:
    """[EOS] + tokens scored in windows of seq_len + 1 (overlapping by one), from Model.logits."""
    ids = [model.tokenizer.eos_id] + model.tokenizer.encode(text)
    total, count = 0.0, 0
    for s in range(0, len(ids) - 1, seq_len):
        w = ids[s:s + seq_len + 1]
        padded = w[:-1] + [0] * (seq_len + 1 - len(w))        # one shape (one compile); causal: pads come last
        logits = model.logits([padded])[0].astype(np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        total -= sum(logp[j, w[j + 1]] for j in range(len(w) - 1))
        count += len(w) - 1
    return total, count


def test_perplexity_matches_direct_scoring(model, corpus, seq_len=16):
    nll = nll_function(model.config)
    got = perplexity(model.params, model.config, model.tokenizer, corpus, seq_len=seq_len, batch_size=3, nll_fn=nll)
    parts = [_direct_nll(model, DOCS[n], seq_len) for n in ("a.txt", "sub/b.txt")]
    total, count = sum(p[0] for p in parts), sum(p[1] for p in parts)
    assert got["tokens"] == count == sum(len(model.tokenizer.encode(DOCS[n])) for n in ("a.txt", "sub/b.txt"))
    np.testing.assert_allclose(got["nll_per_token"], total / count, rtol=1e-5)
    again = perplexity(model.params, model.config, model.tokenizer, corpus, seq_len=seq_len, batch_size=3, nll_fn=nll)
    assert again["perplexity"] == got["perplexity"]                       # deterministic


def test_pieces_cut_at_lines_and_cover_the_file(tmp_path):
    f = tmp_path / "big.txt"
    text = "".join(f"line {i} é\n" for i in range(300)) + "x" * 700 + "\nend"
    f.write_text(text)
    offs = piece_offsets(f, piece_bytes=256)
    assert len(offs) > 5 and offs[0][0] == 0 and offs[-1][1] == f.stat().st_size
    assert all(a[1] == b[0] for a, b in zip(offs, offs[1:]))
    assert "".join(read_piece(f, a, b) for a, b in offs) == text
    pieces = [read_piece(f, a, b) for a, b in offs]
    assert all(p.endswith("\n") for p in pieces[:-1] if "xx" not in p)     # only an over-long line is cut inside


def test_windows_and_training_stream(model, corpus):
    tok = model.tokenizer
    rows = [r for b in eval_batches(tok, corpus, 8, 4) for r, n in zip(b["tokens"], b["length"]) for r in [r[:n]]]
    assert all(1 < len(r) <= 9 for r in rows)
    doc_a = [tok.eos_id] + tok.encode(DOCS["a.txt"])
    first = [list(r) for r in rows[:-(-(len(doc_a) - 1) // 8)]]
    assert [t for r in first for t in r[:-1]] + [first[-1][-1]] == doc_a      # windows overlap by one token
    stream = token_stream(tok, sorted(corpus.rglob("*.txt")))
    assert stream[0] == tok.eos_id and list(stream[1:len(doc_a)]) == doc_a[1:] and stream[len(doc_a)] == tok.eos_id


def test_cli_json_and_errors(corpus, capsys):
    assert eval_main(["--model", "tiny-random", "--data", str(corpus / "a.txt"), "--json", "--seq-len", "16",
                      "--batch-size", "3", "--dtype", "float32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "tiny-random" and out["tokens"] > 10 and out["perplexity"] > 1
    assert eval_main(["--model", "tiny-random", "--data", str(corpus / "missing")]) == 2
    err = capsys.readouterr().err      # one line: the progress bar had started (after loading the model)
    assert err.startswith("error: ") and "no such file" in err and err.count("\n") == 1 and "\r" not in err


def test_flat_file_round_trip_with_mxfp4_export(model, tmp_path):
    import dataclasses
    from k3jax.checkpoint.flat_file import load_flat, quantize_experts, save_flat
    from k3jax.params import init_params_numpy
    from pallas_kernels.moe.mxfp4 import dequantize_mxfp4
    c_mx = model.config
    c_bf16 = dataclasses.replace(c_mx, expert_format="bf16")
    trained = init_params_numpy(c_bf16, 3, jnp.bfloat16)
    exported = quantize_experts(trained)
    save_flat(tmp_path / "w.safetensors", exported)
    loaded = load_flat(tmp_path / "w.safetensors", c_mx, jnp.bfloat16)
    for a, b in zip(*(map(np.asarray, t) for t in (jax_leaves(exported), jax_leaves(loaded)))):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    ex, w1 = loaded["layers"][1]["mlp"]["experts"], np.asarray(trained["layers"][1]["mlp"]["experts"]["w1"], np.float32)
    deq = np.swapaxes(np.asarray(dequantize_mxfp4(ex["w1_packed"], ex["w1_scale"], jnp.float32)), -1, -2)
    assert np.abs(deq - w1).max() <= 0.25 * np.abs(w1).max()              # MXFP4: a coarse copy, right layout
    assert np.corrcoef(deq.ravel(), w1.ravel())[0, 1] > 0.98
    with pytest.raises(ValueError, match="does not match the config"):
        load_flat(tmp_path / "w.safetensors", c_bf16, jnp.bfloat16)


def jax_leaves(tree):
    import jax
    return jax.tree_util.tree_leaves(tree)


def test_training_windows_shard_shuffle_and_resume():
    from k3jax.text_data import train_windows
    stream = np.arange(1 + 20 * 8, dtype=np.int32)               # 20 windows of 8 (+1 shifted target)
    it = iter(train_windows(stream, 8, 2, seed=0))
    first_epoch = np.concatenate([next(it) for _ in range(10)])
    assert sorted(first_epoch[:, 0] // 8) == list(range(20))       # every window once per epoch, shuffled
    assert not np.array_equal(first_epoch[:, 0], np.arange(0, 160, 8))
    assert all(np.array_equal(w, np.arange(w[0], w[0] + 9)) for w in first_epoch)
    state = it.get_state()
    ahead = [next(it) for _ in range(3)]
    again = iter(train_windows(stream, 8, 2, seed=0))
    again.set_state(state)                                         # a restored checkpoint
    assert all(np.array_equal(a, b) for a, b in zip(ahead, [next(again) for _ in range(3)]))
    shards = [np.concatenate([next(s) for _ in range(5)])[:, 0] for s in
              (iter(train_windows(stream, 8, 2, seed=0, shard_index=i, shard_count=2)) for i in range(2))]
    assert sorted(np.concatenate(shards) // 8) == list(range(20))  # two processes: disjoint, covering
