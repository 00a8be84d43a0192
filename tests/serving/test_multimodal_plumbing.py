"""Host-side multimodal plumbing: placeholder expansion, cache keys, chunk rows, step batch,
encoder-output cache and the scheduler's encoder budget (no tower needed)."""
import numpy as np
import pytest

from k3jax.cache import SeqChunk, make_step_batch
from serving.encoder_cache import EncoderCache
from serving.hashing import chain_hashes
from serving.multimodal import ImageInput, chunk_rows, expand_image_placeholders, image_extra_keys
from serving.request import Request
from serving.sampling_params import SamplingParams
from serving.scheduler import Scheduler, SchedulerConfig

PAD = 99


def img(digest, n, offset=-1):
    return ImageInput(digest=digest, pixel_values=np.zeros((4 * n, 3, 2, 2), np.float32), grid_thw=(1, 2, 2 * n),
                      num_tokens=n, offset=offset)


def test_expand_widens_each_pad_in_order():
    ids, placed = expand_image_placeholders([1, PAD, 2, 3, PAD, 4], [img("a", 3), img("b", 2)], PAD)
    assert ids == [1, PAD, PAD, PAD, 2, 3, PAD, PAD, 4]
    assert [(p.offset, p.end) for p in placed] == [(1, 4), (6, 8)]


def test_expand_rejects_count_mismatch():
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        expand_image_placeholders([PAD, 1, PAD], [img("a", 2)], PAD)
    with pytest.raises(ValueError, match="0 image placeholders"):
        expand_image_placeholders([1, 2], [img("a", 2)], PAD)


def test_extra_keys_cover_every_unit_the_image_touches():
    keys = image_extra_keys([img("a", 10, offset=6), img("b", 1, offset=20)], unit=4)
    assert sorted(keys) == [1, 2, 3, 5]        # positions 6..15 -> units 1..3; 20 -> unit 5
    assert all(k[0].startswith("img:a:") for u, k in keys.items() if u < 4)
    assert keys[5] == ("img:b:20",)


def test_different_images_change_the_hash_chain_from_the_image_on():
    toks = [5] * 6 + [PAD] * 4 + [7] * 6
    ha = chain_hashes(toks, 4, image_extra_keys([img("a", 4, offset=6)], 4))
    hb = chain_hashes(toks, 4, image_extra_keys([img("b", 4, offset=6)], 4))
    assert ha[0] == hb[0]                       # unit 0 is text only
    assert all(x != y for x, y in zip(ha[1:], hb[1:]))


def test_chunk_rows_slice_images_across_chunk_boundaries():
    a, b = img("a", 5, offset=2), img("b", 3, offset=9)
    emb = {"a": np.arange(5)[:, None] * np.ones((1, 4)), "b": 10 + np.arange(3)[:, None] * np.ones((1, 4))}
    rows = chunk_rows([a, b], 4, 10, lambda i: emb[i.digest])
    assert [(off, r[:, 0].tolist()) for off, r in rows] == [(0, [2, 3, 4]), (5, [10])]
    assert chunk_rows([a, b], 12, 20, lambda i: emb[i.digest]) == []
    with pytest.raises(ValueError, match="placeholders"):
        chunk_rows([a], 0, 4, lambda i: np.zeros((4, 4)))


def test_step_batch_places_rows_at_flat_positions():
    D = 3
    chunks = [SeqChunk([1, 2, 3], 0, [1], -1, 1, mm=[(1, np.full((2, D), 7.0, np.float32))]),
              SeqChunk([4, 5], 0, [2], -1, 2, mm=[(0, np.full((1, D), 9.0, np.float32))])]
    b = make_step_batch(chunks, 16, num_tokens=8, num_seqs=4)
    assert b.mm_mask.tolist() == [False, True, True, True, False, False, False, False]
    assert b.mm_embeds[:, 0].tolist() == [0, 7, 7, 9, 0, 0, 0, 0]
    assert not b.decode_only
    plain = make_step_batch([SeqChunk([1], 0, [1], -1, 1)], 16, num_tokens=8, num_seqs=4)
    assert plain.mm_embeds is None and plain.mm_mask is None
    with pytest.raises(ValueError, match="outside their chunk"):
        make_step_batch([SeqChunk([1, 2], 0, [1], -1, 1, mm=[(1, np.zeros((2, D)))])], 16)


def test_encoder_cache_is_lru_and_bounded():
    c = EncoderCache(max_bytes=3 * 80)
    for d in "abc":
        c.put(d, np.zeros(10))               # 80 bytes each
    assert c.get("a") is not None            # a is now most recent
    c.put("d", np.zeros(10))                 # evicts b
    assert "b" not in c and all(x in c for x in "acd") and c.bytes == 240
    c.put("huge", np.zeros(100))             # larger than the budget: not kept, nothing evicted
    assert "huge" not in c and len(c) == 3
    assert c.get("zz") is None and c.misses == 1


def _request(rid, n_text, images):
    ids = [1] * n_text + [PAD] + [2] * 4
    ids, placed = expand_image_placeholders(ids, images, PAD)
    return Request(rid, ids, SamplingParams(max_tokens=1), seed=0, images=placed)


def test_scheduler_encoder_budget_cuts_chunks_before_unencoded_images():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=16, max_model_len=256,
                          prefix_match_unit=16, enable_prefix_caching=False, encoder_budget=10)
    s = Scheduler(cfg, num_pages=64, num_slots=8)
    encoded = set()
    s.is_encoded = encoded.__contains__
    r1, r2 = _request("r1", 3, [img("a", 8)]), _request("r2", 5, [img("b", 8)])
    s.add(r1)
    s.add(r2)
    out = s.schedule()
    # r1's image fits the budget; r2's would exceed it, so r2 stops right before its image
    assert [(c.req.request_id, c.start, c.end) for c in out.chunks] == [("r1", 0, 15), ("r2", 0, 5)]
    assert [i.digest for i in out.encode] == ["a"]
    encoded.add("a")
    s.after_step(out)
    out = s.schedule()
    assert [i.digest for i in out.encode] == ["b"]
    assert ("r2", 5, 17) in [(c.req.request_id, c.start, c.end) for c in out.chunks]


def test_scheduler_first_image_always_fits_and_cached_images_cost_nothing():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=16, max_model_len=256,
                          prefix_match_unit=16, enable_prefix_caching=False, encoder_budget=4)
    s = Scheduler(cfg, num_pages=64, num_slots=8)
    s.is_encoded = {"b"}.__contains__
    s.add(_request("big", 0, [img("a", 20)]))       # larger than the whole budget: still progresses
    s.add(_request("hit", 0, [img("b", 20)]))       # already encoded: no budget used
    out = s.schedule()
    assert [(c.req.request_id, c.start, c.end) for c in out.chunks] == [("big", 0, 24), ("hit", 0, 24)]
    assert [i.digest for i in out.encode] == ["a"]
