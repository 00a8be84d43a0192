"""Speculative verification on a GPU (compiled kernels): the pieces a verify step runs that plain decode and
prefill do not, each against its reference, then the engine end to end. Skipped without a GPU:

  JAX_PLATFORMS=cuda timeout 900 python -m pytest -m gpu -n 0 -q tests/serving/test_spec_gpu.py

A verify step feeds a sequence's last token and its K drafts (K + 1 tokens) over the sequence's paged cache:
- MLA: a verify chunk's tokens run as decode rows of their own (token_rows: bitwise the decode step's stages,
  test_mla_layer_verify_rows_bitwise); longer chunks in the same step take the absorbed ragged kernel over a long
  context, where each row must see only the keys up to its own position (the first row not the drafts' keys);
- KDA: write_position_states, the decode kernel run K + 1 times on a per-sequence state array (not the pool)
  and each position's state and conv window written to its own slot;
- the engine: greedy output with oracle drafts (the off run's own continuation) equal to off, acceptance 1.0;
  wrong drafts: equal to off, acceptance 0.0 (the interpret-mode CPU run of the same engine passes:
  tests/serving/test_spec_engine.py::test_gpu_kernels_interpret).
"""
import numpy as np
import pytest

from benchmarks.bench_spec import Oracle
from tests.support.spec_steps import decode_logits, spec_model as _model, verify_vs_decode

from tests.support.gpu_marks import GPU_ONLY

pytestmark = GPU_ONLY

K = 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_len", [133, 2053, 2048 + 64 + 3])
def test_mla_verify_chunk_kernel(dtype, kv_len):
    """Kimi-Linear's MLA shape (32 heads, 512 + 64 latent), a verify chunk of K + 1 tokens beside a decode row,
    block tables 4,096 keys wide (bench_spec's max_model_len): the Triton kernel equals the reference."""
    import jax.numpy as jnp
    from pallas_kernels.mla.paged import ragged_paged_mla
    from pallas_kernels.mla.reference import ragged_paged_mla_reference
    H, L, R, ps, width = 32, 512, 64, 16, 256
    rng = np.random.default_rng(kv_len)
    dt = jnp.dtype(dtype)
    kv = jnp.asarray(rng.standard_normal((width + 8, ps, L + R)), dt)
    bt = np.zeros((4, width), np.int32)
    bt[0] = rng.permutation(np.arange(1, width + 8))[:width]
    bt[1] = np.arange(1, width + 1)
    T = 16
    q = jnp.asarray(rng.standard_normal((T, H, L)), dt)
    qr = jnp.asarray(rng.standard_normal((T, H, R)), dt)
    cu = jnp.asarray([0, K + 1, K + 2, K + 2, K + 2], jnp.int32)
    kl = jnp.asarray([kv_len, 300, 0, 0], jnp.int32)
    scale = 192 ** -0.5
    ref = ragged_paged_mla_reference(q.astype(jnp.float32), qr.astype(jnp.float32), kv.astype(jnp.float32),
                                     jnp.asarray(bt), cu, kl, scale=scale)
    got = ragged_paged_mla(q, qr, kv, jnp.asarray(bt), cu, kl, scale=scale)
    tol = 2e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(got[:K + 2], np.float32), np.asarray(ref[:K + 2]), atol=tol, rtol=tol)
    # row j sees keys up to kv_len - (K + 1) + j only: the first row equals a decode query at that position
    dec = ragged_paged_mla_reference(q[:1].astype(jnp.float32), qr[:1].astype(jnp.float32), kv.astype(jnp.float32),
                                     jnp.asarray(bt[:1]), jnp.asarray([0, 1], jnp.int32),
                                     jnp.asarray([kv_len - K], jnp.int32), scale=scale)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(dec[0]), atol=tol, rtol=tol)


def test_kda_position_states_kernel():
    """write_position_states with the GPU decode kernel equals it with the reference ops: every position's
    state and conv window in its slot, the outputs at every kept position."""
    import jax
    import jax.numpy as jnp
    from k3jax.layers.kda_positions import write_position_states
    from pallas_kernels.backend import Backend, detect
    N, W, H, Dk, Dv, C, Kc, S = 3, K + 1, 32, 128, 128, 64, 4, 24
    T = 16
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    lens = [W, 1, 3]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    dst = np.full((N, W), -1, np.int32)
    dst[0] = [5, 6, 7, 8, 9]
    dst[2, :3] = [11, 12, 13]
    meta = {"spec_dst": jnp.asarray(dst), "cu_seqlens": jnp.asarray(cu)}
    k = f(T, H, Dk)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    q = f(T, H, Dk)
    args = (jnp.zeros((S, H, Dk, Dv), jnp.float32), jnp.zeros((S, Kc - 1, C), jnp.float32), f(T, H, Dv),
            f(N, H, Dk, Dv) * 0.1, f(N, Kc - 1, C), f(T, C), q, k, f(T, H, Dv),
            -jnp.abs(f(T, H, Dk)) * 0.5, jax.nn.sigmoid(f(T, H)))
    run = lambda b: jax.jit(lambda *a: write_position_states(*a, meta, scale=Dk ** -0.5, backend=b,  # noqa: E731
                                                             act_dtype=jnp.float32))(*args)
    got = run(detect("auto"))
    ref = run(Backend(device="gpu"))
    assert detect("auto").kernels
    for g, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-4, rtol=1e-4)


def oracle_runs(model, args):
    """bench_spec's c1 rows, small, on one engine: a 2,100-token prompt's 40 greedy tokens with speculation
    off (twice), then with oracle drafts (the off run's tokens) and wrong drafts. Returns (off, off again,
    [(output, speculation metrics)] for oracle and wrong drafts)."""
    from serving.engine import LLMEngine
    from serving.sampling_params import SamplingParams
    from serving.spec import make_speculator
    eng = LLMEngine(model, args)
    eng.wait_for_compiles()
    vocab = model.config.vocab_size
    prompt = np.random.default_rng(0).integers(0, vocab - 16, 2100).tolist()

    def run():
        eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), request_id="r0")
        out = None
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    out = o.outputs[0].token_ids
        return {"r0": list(out)}

    eng.spec = None
    ref, again, spec = run(), run(), []
    for wrong in (False, True):
        eng.spec = make_speculator(args, model, eng.max_model_len)
        eng.spec.drafter = Oracle(ref, wrong, vocab)
        spec.append((run(), eng.spec.metrics()))
    return ref, again, spec


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("name", ["tiny-random", "tiny-linear"])
def test_engine_greedy_spec_equals_off(name, kernels, tmp_path):
    """bench_spec's c1 rows, small: a 2,100-token prompt (block tables of 4,096 keys), warm-up and the
    accelerator's defaults (async scheduling, several decode steps per launch, background compile)."""
    from serving.engine_args import EngineArgs
    model = _model(name, kernels)
    args = EngineArgs(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=1024, speculative="ngram",
                      num_speculative_tokens=K, enable_prefix_caching=False, compilation_cache_dir=str(tmp_path),
                      vision=False, token_buckets=(16, 64, 1024), seq_buckets=(1, 4), speculative_on_gpu=True)
    ref, _, spec = oracle_runs(model, args)
    for (out, m), wrong, rate in zip(spec, (False, True), (1.0, 0.0)):
        assert m["spec_drafted_tokens"] > 0
        assert out == ref, (wrong, m)
        assert m["spec_acceptance_rate"] == rate, (wrong, m)


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("name", ["tiny-random", "tiny-linear"])
def test_verify_step_logits_equal_decode(name, kernels):
    """A verify step's logits and per-position KDA states equal K + 1 decode steps' (fp32). On failure the message
    says how far (max |diff| against the logits' scale, and the decode rows' top-1 / top-2 margins): a diff
    at rounding level with small margins is numerics; one of the logits' own scale is a wrong verify path."""
    import jax.numpy as jnp
    m = _model(name, kernels)
    dec, ver, ds, vs = verify_vs_decode(m.config, m.params, m.backend, jnp.float32)
    top2 = np.sort(dec, axis=-1)[:, -2:]
    msg = (f"max|logit diff| per row {np.abs(dec - ver).max(-1)}, logits' std {dec.std():.3g}, top1-top2 margins "
           f"{top2[:, 1] - top2[:, 0]}, argmax dec {dec.argmax(-1)} ver {ver.argmax(-1)}, max|state diff| per "
           f"position {np.abs(ds - vs).reshape(len(ds), -1).max(-1)}")
    print(msg)
    np.testing.assert_allclose(vs, ds, atol=1e-4, rtol=1e-4, err_msg=msg)
    np.testing.assert_allclose(ver, dec, atol=2e-3 * max(1.0, float(np.abs(dec).max())), rtol=0, err_msg=msg)
    assert (ver.argmax(-1) == dec.argmax(-1)).all(), msg


@pytest.mark.parametrize("name", ["tiny", "tiny-linear"])
def test_verify_step_logits_bf16(name):
    """The same in bf16 (bench_spec's dtype) with the GPU kernels: the trained tiny (real top-1 margins) and the
    Kimi-Linear-shaped random model. Rounding differs between a K + 1-token chunk and decode rows, so the logits
    agree to bf16 tolerance and the argmax wherever its margin exceeds twice the row's difference."""
    import jax.numpy as jnp
    from k3jax import api
    if name == "tiny" and not __import__("os").path.exists(api.TINY_WEIGHTS):
        pytest.skip(f"{api.TINY_WEIGHTS} is missing")
    m = _model(name, "auto", "bfloat16")
    dec, ver, ds, vs = verify_vs_decode(m.config, m.params, m.backend, jnp.bfloat16)
    top2 = np.sort(dec, axis=-1)[:, -2:]
    margin, diff = top2[:, 1] - top2[:, 0], np.abs(dec - ver).max(-1)
    msg = (f"max|logit diff| per row {diff}, max|logit| {np.abs(dec).max():.3g}, top1-top2 margins {margin}, "
           f"argmax dec {dec.argmax(-1)} ver {ver.argmax(-1)}, max|state diff| per position "
           f"{np.abs(ds - vs).reshape(len(ds), -1).max(-1)} (states' max {np.abs(ds).max():.3g})")
    print(msg)
    assert diff.max() <= 0.05 * np.abs(dec).max(), msg
    sure = margin > 2 * diff
    assert (ver.argmax(-1) == dec.argmax(-1))[sure].all(), msg
    np.testing.assert_allclose(vs, ds, atol=0.05 * max(1.0, float(np.abs(ds).max())), rtol=0, err_msg=msg)


def _kimi_config(kinds):
    from k3jax.config import ModelConfig
    from k3jax.presets import preset_config_dict
    d = preset_config_dict("kimi-linear-48b-a3b")
    d.update(num_hidden_layers=len(kinds), num_experts=64, linear_attn_config={**d["linear_attn_config"],
             "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "M"],
             "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "K"]})
    return ModelConfig.from_dict(d)


def _kimi_slice(dtype="bfloat16", kinds="KKKMK"):
    """Kimi-Linear-48B's full widths (hidden 2304; MLA 32 heads x 512 + 64 latent: the Mosaic decode kernel on
    Hopper; KDA 32 x 128; its vocabulary) in 5 layers (dense, KDA, KDA, MLA, KDA) with 64 of its 256 experts:
    the kernels bench_spec's model runs, at every shape it runs them. kinds: the layers' attention, K (KDA) or M
    (MLA), the first with a dense MLP."""
    import jax
    import jax.numpy as jnp
    from k3jax.api import Model
    from k3jax.params import init_params_by_leaf
    from pallas_kernels.backend import detect
    c = _kimi_config(kinds)
    params = init_params_by_leaf(c, jax.random.key(0), dtype=jnp.dtype(dtype), stacked=True)
    return Model(c, params, None, name="kimi-slice", backend=detect())


KIMI_BACKENDS = {   # name -> (kernels, mla_decode, dense_in_place): the engine's default on an H200 first
    "engine": ("auto", "auto", True), "triton-decode": ("auto", "triton", True),
    "no-in-place": ("auto", "auto", False), "reference": ("reference", "auto", False)}


def _kimi_backend(model, name):
    from pallas_kernels.backend import detect
    kernels, mla_decode, in_place = KIMI_BACKENDS[name]
    b = detect(kernels, mla_decode=mla_decode).replace(mxfp4_decoder=model.backend.mxfp4_decoder)
    return b.replace(dense_in_place=in_place and b.kernels)


@pytest.fixture(scope="module")
def kimi():
    return _kimi_slice()


def _bitwise_report(backend, dec, ver, ds, vs):
    """Where a verification step's rows differ from decode's: per row max |logit diff| and per [position, KDA
    layer] max |state diff| (0 everywhere when they round alike)."""
    return (f"{backend}: max|logit diff| per row {np.abs(dec - ver).max(-1)} (max|logit| {np.abs(dec).max():.3g}), "
            f"argmax dec {dec.argmax(-1)} ver {ver.argmax(-1)}; max|state diff| [position, KDA layer]\n"
            f"{np.abs(ds - vs).reshape(ds.shape[0], ds.shape[1], -1).max(-1)}")


@pytest.mark.parametrize("kinds,backend", [("KKKMK", "engine"), ("KKKMK", "triton-decode"),
                                           ("KKKMK", "no-in-place"), ("MK", "engine"), ("KMK", "engine")])
def test_verify_step_kimi_widths(kinds, backend):
    """verify_vs_decode at Kimi-Linear's widths, bf16, on the engine's H200 backend and its variants, and on
    shorter slices (an MLA layer with a dense MLP, then with an MoE, each before a KDA layer whose states show
    what reached it). Verification rows run as decode rows, so they round alike wherever the step programs'
    GEMMs do; XLA autotunes each program's GEMMs on its own, so a run may still see rounding-level differences
    (the report prints them). Asserted: the argmax and logits to bf16 tolerance, KDA states likewise."""
    import jax.numpy as jnp
    m = _kimi_slice(kinds=kinds)
    dec, ver, ds, vs = verify_vs_decode(m.config, m.params, _kimi_backend(m, backend), jnp.bfloat16)
    msg = _bitwise_report(f"{kinds} {backend}", dec, ver, ds, vs)
    print(msg, "\nbitwise:", bool((vs == ds).all() and (ver == dec).all()))
    assert (ver.argmax(-1) == dec.argmax(-1)).all(), msg
    assert np.abs(dec - ver).max() <= 0.05 * np.abs(dec).max(), msg
    np.testing.assert_allclose(vs, ds, atol=0.05 * max(1.0, float(np.abs(ds).max())), rtol=0, err_msg=msg)


def test_engine_oracle_kimi_widths(kimi, tmp_path):
    """bench_spec's c1 rows at Kimi-Linear's widths (bf16), on the engine's backend and defaults (async
    scheduling, several decode steps per launch): oracle drafts from the off run accepted (all of them on the
    H200 once verification rows ran as decode rows) and the output equal to off; wrong drafts all rejected."""
    from serving.engine_args import EngineArgs
    kimi.backend = _kimi_backend(kimi, "engine")
    args = EngineArgs(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=1024, speculative="ngram",
                      num_speculative_tokens=K, enable_prefix_caching=False, compilation_cache_dir=str(tmp_path),
                      vision=False, token_buckets=(16, 64, 1024), seq_buckets=(1, 4), warmup=False,
                      background_compile=False, speculative_on_gpu=True)
    ref, again, spec = oracle_runs(kimi, args)
    for (out, m), wrong in zip(spec, (False, True)):
        first = next((i for i, (a, b) in enumerate(zip(ref["r0"], out["r0"])) if a != b), None)
        print(f"wrong={wrong}: off twice equal {again == ref}, equal {out == ref}, first diff at {first}, "
              f"{ {k: v for k, v in m.items() if k.startswith('spec_')} }")
    assert again == ref and spec[0][0] == ref
    rates = [m["spec_acceptance_rate"] for _, m in spec]
    assert rates[0] >= 0.8 and rates[1] == 0.0, rates


def test_verify_step_kimi_widths_fp32():
    """The same in fp32 (the GPU kernels' fp32 paths): a verification step's logits and states equal decode's
    to fp32 rounding."""
    import jax.numpy as jnp
    m = _kimi_slice("float32")
    dec, ver, ds, vs = verify_vs_decode(m.config, m.params, _kimi_backend(m, "engine"), jnp.float32)
    top2 = np.sort(dec, axis=-1)[:, -2:]
    msg = (f"fp32: max|logit diff| per row {np.abs(dec - ver).max(-1)}, max|logit| {np.abs(dec).max():.3g}, margins "
           f"{top2[:, 1] - top2[:, 0]}, max|state diff| [position, KDA layer]\n"
           f"{np.abs(ds - vs).reshape(ds.shape[0], ds.shape[1], -1).max(-1)}")
    print(msg)
    np.testing.assert_allclose(ver, dec, atol=2e-3 * max(1.0, float(np.abs(dec).max())), rtol=0, err_msg=msg)


def test_decode_kernels_kimi_widths_fp32():
    """Prefill and decode logits at Kimi-Linear's widths in fp32: the GPU kernels against the jnp references
    (run at HIGHEST matmul precision: TF32 would be the larger error)."""
    import jax
    import jax.numpy as jnp
    m = _kimi_slice("float32")
    with jax.default_matmul_precision("highest"):
        ref = decode_logits(m.config, m.params, _kimi_backend(m, "reference"), [], jnp.float32)
        feed = [int(ref[0].argmax())] * 3
        ref = decode_logits(m.config, m.params, _kimi_backend(m, "reference"), feed, jnp.float32)
    got = decode_logits(m.config, m.params, _kimi_backend(m, "engine"), feed, jnp.float32)
    msg = (f"fp32 kernels vs references: max|diff| per row {np.abs(got - ref).max(-1)}, "
           f"max|logit| {np.abs(ref).max():.3g}")
    print(msg)
    np.testing.assert_allclose(got, ref, atol=2e-3 * max(1.0, float(np.abs(ref).max())), rtol=0, err_msg=msg)


def test_mla_layer_verify_rows_bitwise():
    """One MLA layer at Kimi-Linear's widths (bf16, the engine's H200 backend), stage by stage: a verification
    chunk's 5 tokens (rows 0-4 of a 16-row step) against 5 decode steps feeding each alone (row 0), over a
    600-token cache. Every stage's rows must have the decode steps' bits; the message names the first that
    does not (projections, the cache rows they write, attention, the layer's output)."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from k3jax.layers.mla import MLA
    from pallas_kernels import ops
    from pallas_kernels.backend import detect
    c = _kimi_config("M")
    backend = detect("auto").replace(dense_in_place=False)
    vals = MLA(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)).tree()
    rng = np.random.default_rng(0)
    ps, max_pages, ctx, T, W = 16, 256, 600, 16, K + 1
    width = c.kv_lora_rank + c.qk_rope_head_dim
    pages = jnp.asarray(rng.standard_normal((max_pages + 1, ps, width)) * 0.5, jnp.bfloat16)
    bt = jnp.arange(1, max_pages + 1, dtype=jnp.int32)[None]
    xs = jnp.asarray(rng.standard_normal((W, c.hidden_size)), jnp.bfloat16)

    @functools.partial(jax.jit, static_argnames="decode")
    def run(vals, x, pages, meta, decode):
        meta = dict(meta, decode_only=decode)
        m = MLA.of(c, vals)
        q, kv = m.projections(x, c)
        pages = ops.write_kv_pages(pages, kv.astype(pages.dtype), meta["slot_mapping"])
        o = m._absorbed(c, q, pages, meta, x.dtype, backend)
        return dict(q=q, kv=kv, o=o, out=m.output(x, o, c)), pages

    def meta(n, pos, spec):
        slots = np.full(T, -1, np.int32)
        slots[:n] = ps + np.arange(pos, pos + n)                 # page 1 holds position 0
        m = dict(slot_mapping=jnp.asarray(slots), block_tables=bt, cu_seqlens=jnp.asarray([0, n], jnp.int32),
                 kv_lens=jnp.asarray([pos + n], jnp.int32), token_seq=jnp.zeros(T, jnp.int32))
        return m | ({"spec_dst": jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)} if spec else {})
    dec, dp = [], pages
    for j in range(W):
        x = jnp.zeros((T, c.hidden_size), jnp.bfloat16).at[0].set(xs[j])
        got, dp = run(vals, x, dp, meta(1, ctx + j, False), True)
        dec.append({k: np.asarray(v[0], np.float32) for k, v in got.items()})
    ver, vp = run(vals, jnp.zeros((T, c.hidden_size), jnp.bfloat16).at[:W].set(xs), pages, meta(W, ctx, True), False)
    report = []
    for k in ("q", "kv", "o", "out"):
        diff = [float(np.abs(np.asarray(ver[k][j], np.float32) - dec[j][k]).max()) for j in range(W)]
        report.append(f"{k}: max|diff| per row {diff}")
    report.append(f"cache rows equal {np.array_equal(np.asarray(vp, np.float32), np.asarray(dp, np.float32))}")
    print("\n".join(report))
    assert all("[0.0, 0.0, 0.0, 0.0, 0.0]" in r for r in report[:4]) and report[4].endswith("True"), report
