"""Images through the engine (tiny model with its tiny tower, CPU, float64).

The reference is independent of the engine: the tower called directly, its rows written over
the placeholder embeddings, and a full forward pass (no cache, no chunking) per generated token.
"""
import jax
import numpy as np
import pytest
from PIL import Image

from k3jax import load_model
from k3jax.model import K3Model
from k3jax.vision.positions import prepare_vision_batch
from k3jax.vision.tower import encode_images
from serving.engine import LLMEngine
from serving.engine_args import EngineArgs
from serving.image_inputs import ImageLoader
from serving.multimodal import expand_image_placeholders
from serving.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="module")
def model(x64):
    return load_model("tiny-random", dtype="float64")


def picture(seed, w, h):
    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8))


def image_input(model, seed, w, h):
    img = picture(seed, w, h)
    from k3jax.vision.media import image_digest
    return ImageLoader(model.vision).from_pil(img, image_digest(img))


def engine(model, tmp_path_factory, **kw):
    args = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, page_size=16, prefix_match_unit=16,
                state_block_size=64, num_pages=200, num_slots=32, token_buckets=(32, 256), seq_buckets=(8,),
                forbid_compile_after_warmup=True, compilation_cache_dir=str(tmp_path_factory.getbasetemp() / "xla"))
    args.update(kw)
    return LLMEngine(model, EngineArgs(**args))


def chat_ids(model, n_images, text="What is in the picture?"):
    parts = [{"type": "image_url", "image_url": {"url": "x"}}] * n_images + [{"type": "text", "text": text}]
    return model.tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=True,
                                               add_generation_prompt=True)


def run(eng, prompts, max_tokens=4):
    """prompts: {name: (ids, images)} -> {name: (tokens, logprobs, cached)}"""
    for name, (ids, images) in prompts.items():
        eng.add_request(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0), request_id=name,
                        images=images)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, [lp for lp, _ in c.logprobs], out.num_cached_tokens)
    return done


def reference(model, forward, ids, images, generated, padded_len=64):
    """Teacher forcing: the tower + one full forward pass (no cache) over the prompt and the engine's
    `generated` tokens -> (the greedy token at each generated position, the logprob there of the
    generated token). Greedy decoding yields `generated` iff every greedy token matches it."""
    ids, placed = expand_image_placeholders(ids, images, model.vision.pad_id)
    vb = prepare_vision_batch(model.vision.config, [im.grid_thw for im in placed])
    px = np.concatenate([im.pixel_values for im in placed])
    rows = np.asarray(encode_images(model.vision.params, model.vision.config, px, vb))
    # right padding to one length (one compile): a causal model's earlier logits ignore it
    assert len(ids) + len(generated) <= padded_len
    toks = np.full(padded_len, model.config.pad_token_id)
    toks[:len(ids) + len(generated)] = list(ids) + list(generated)
    emb = np.zeros((padded_len, model.config.hidden_size))
    mask = np.zeros(padded_len, bool)
    for im, at in zip(placed, vb.token_offsets):
        emb[im.offset:im.end] = rows[at:at + im.num_tokens]
        mask[im.offset:im.end] = True
    logits = np.asarray(forward(model.params, toks[None], emb[None], mask[None]))[0]
    logits = logits[len(ids) - 1:len(ids) - 1 + len(generated)]
    logprobs = logits - logits.max(-1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
    return [int(t) for t in logits.argmax(-1)], [float(lp[t]) for lp, t in zip(logprobs, generated)]


@pytest.fixture(scope="module")
def eng(model, tmp_path_factory):
    """One engine for most tests (prefix caching on, 256-token steps), compiling only the steps they run (a
    warm-up of every step shape in float64 is ~90 s on 2 cores: test_warmup_covers_image_steps)."""
    return engine(model, tmp_path_factory, warmup=False, forbid_compile_after_warmup=False)


@pytest.mark.slow
def test_warmup_covers_image_steps(model, tmp_path_factory):
    """After warm-up, image requests (one tower call per step, images split over chunks) compile nothing."""
    warm = engine(model, tmp_path_factory)
    got = run(warm, {"one": (chat_ids(model, 1), [image_input(model, 0, 90, 60)]),
                     "two": (chat_ids(model, 2, "Compare them."), [image_input(model, 1, 40, 130)] * 2)})
    assert {k: len(v[0]) for k, v in got.items()} == {"one": 4, "two": 4}


def _two_image_prompts(model):
    a, b = image_input(model, 0, 90, 60), image_input(model, 1, 40, 130)
    assert a.num_tokens != b.num_tokens
    return {"one": (chat_ids(model, 1), [a]), "two": (chat_ids(model, 2, "Compare them."), [b, a])}


def _assert_matches_reference(model, e, prompts):
    before = e.stats()["encoded_images"]
    got = run(e, prompts)
    assert e.stats()["encoded_images"] - before == 2          # `a` encoded once for both requests
    forward = jax.jit(lambda params, t, e, m: K3Model(model.config, params)(t, mm_embeds=e, mm_mask=m))
    for name, (ids, imgs) in prompts.items():
        toks = got[name][0]
        assert len(toks) == 4, name
        greedy, lps = reference(model, forward, ids, imgs, toks)
        assert toks == greedy, name
        np.testing.assert_allclose(got[name][1], lps, rtol=0, atol=2e-6)   # the sampler reports fp32


@pytest.mark.slow     # CI's time budget (a float64 full forward per prompt); the tower's parity runs by default
def test_engine_with_images_matches_tower_plus_full_forward(model, eng):
    """256-token steps pack both requests' images into one tower call."""
    _assert_matches_reference(model, eng, _two_image_prompts(model))


@pytest.mark.slow     # CI's time budget (an engine of its own step shapes)
def test_images_split_over_small_prefill_chunks_match_the_reference(model, tmp_path_factory):
    """32-token steps split the images over several prefill chunks."""
    small = engine(model, tmp_path_factory, max_num_batched_tokens=32, token_buckets=(32,), warmup=False,
                   forbid_compile_after_warmup=False, enable_prefix_caching=False)
    _assert_matches_reference(model, small, _two_image_prompts(model))


def test_images_change_the_output(model, eng):
    ids = chat_ids(model, 1, "Another question about it?")
    got = run(eng, {"a": (ids, [image_input(model, 10, 90, 60)]), "c": (ids, [image_input(model, 12, 90, 60)])},
              max_tokens=2)
    assert got["a"][1] != got["c"][1]


def test_prefix_cache_hits_only_with_the_same_image(model, eng):
    text = "Describe the image in detail, please, with every colour and shape you can find in it. " * 3
    ids = chat_ids(model, 1, text)
    a, a2, c = image_input(model, 20, 90, 60), image_input(model, 20, 90, 60), image_input(model, 23, 90, 60)
    assert a.digest == a2.digest and a.digest != c.digest
    before = eng.stats()["encoded_images"]
    first = run(eng, {"first": (ids, [a])})
    _, placed = expand_image_placeholders(ids, [a], model.vision.pad_id)
    img_start = placed[0].offset
    same = run(eng, {"same": (ids, [a2])})
    other = run(eng, {"other": (ids, [c])})
    assert same["same"][0] == first["first"][0]
    assert same["same"][2] > placed[0].end                 # the hit reaches past the image
    assert other["other"][2] <= img_start                   # never past the first differing image token
    assert eng.stats()["encoded_images"] - before == 2     # `same` needed no encoding at all


def test_text_requests_and_bad_image_requests(model, eng):
    ids = chat_ids(model, 1)
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        eng.add_request(ids, SamplingParams(max_tokens=2), images=[image_input(model, 0, 30, 30)] * 2)
    got = run(eng, {"text": (model.tokenizer.encode("plain text"), ())}, max_tokens=3)
    assert len(got["text"][0]) == 3
