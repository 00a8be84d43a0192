"""Kimi tokenizer: vocabulary layout, encode/decode, special tokens, streaming detokenizer."""

import os
import random

import pytest
import regex

from k3jax.tokenizer import IncrementalDetokenizer, KimiTokenizer
from k3jax.tokenizer.kimi import TINY_ASSET
from k3jax.tokenizer.vocab import PAT_STR, SPECIAL_OFFSETS, load_tiktoken_bpe, split_long_runs

REAL_TIKTOKEN = os.environ.get("K3JAX_KIMI_TIKTOKEN", "")

MULTILINGUAL = [
    "Hello, world! It's a test: don't panic.",
    "人工智能正在改变世界。北京市 Pascal 中文English混合",
    "Emoji: 🙂🚀👩‍👩‍👧 and flags 🇫🇷🇯🇵, skin 👍🏽",
    "Привет, мир! こんにちは世界。안녕하세요. Ünïcödé façade naïve café",
    'def f(x):\n    return {"a": [1, 2, 3], "b": None}\n\n\n\tindent\r\n',
    "Numbers 1234567890 3.14159 ١٢٣ and   multiple   spaces   ",
    "",
    " ",
    "\x00\x01\x7f control bytes \u200b zero-width \ufeff bom",
]

# Spec section 8, absolute ids for the real vocabulary (163584 ordinary tokens).
SPEC_IDS = {
    "[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
    "<|im_assistant|>": 163588, "[EOT]": 163593, "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595, "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597, "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601, "<|media_begin|>": 163602, "<|media_content|>": 163603,
    "<|media_end|>": 163604, "<|media_pad|>": 163605, "<think>": 163606, "</think>": 163607,
    "[UNK]": 163838, "[PAD]": 163839,
}


@pytest.fixture(scope="module")
def tiny():
    return KimiTokenizer.tiny()


@pytest.fixture(scope="module")
def big():
    """A 163584-ordinary-token tokenizer: tiny's ranks padded with unreachable filler tokens,
    so the special ids land where the spec puts them for real Kimi."""
    ranks = load_tiktoken_bpe(TINY_ASSET)
    for i in range(len(ranks), 163584):
        ranks[b"\xff\xfe" + i.to_bytes(3, "big")] = i
    return KimiTokenizer(ranks)


def reference_bpe_encode(text, ranks):
    """Independent pure-Python byte-level BPE: split with the `regex` module, then merge the
    lowest-ranked adjacent pair until none is in the vocabulary."""
    out = []
    for chunk in regex.findall(PAT_STR, text, flags=regex.V1):
        parts = [bytes([b]) for b in chunk.encode("utf-8")]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], 1 << 60))
            if parts[best] + parts[best + 1] not in ranks:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        out.extend(ranks[p] for p in parts)
    return out


# ---- vocabulary -----------------------------------------------------------------------------


def test_tiny_vocab_layout(tiny):
    ranks = load_tiktoken_bpe(TINY_ASSET)
    assert len(ranks) == 768 and tiny.num_ordinary == 768 and tiny.vocab_size == 1024
    by_rank = sorted(ranks, key=ranks.get)
    assert by_rank[:256] == [bytes([i]) for i in range(256)]
    # every merge is the concatenation of two earlier tokens (a valid BPE merge list)
    for rank, tok in enumerate(by_rank[256:], start=256):
        assert any(tok[:k] in ranks and tok[k:] in ranks and max(ranks[tok[:k]], ranks[tok[k:]]) < rank
                   for k in range(1, len(tok))), tok
    assert len(tiny.special_ids) == 256
    assert sorted(tiny.special_ids.values()) == list(range(768, 1024))
    for name, off in SPECIAL_OFFSETS.items():
        assert tiny.special_ids[name] == 768 + off
    assert tiny.special_ids["<|reserved_token_773|>"] == 773  # unnamed ids: absolute id in the name
    assert (tiny.bos_id, tiny.eos_id, tiny.im_end_id) == (768, 769, 770)
    assert tiny.stop_ids == (769, 770, 777)


def test_tiny_asset_is_reproducible():
    from tools import make_tiny_tokenizer
    assert make_tiny_tokenizer.build() == TINY_ASSET.read_bytes()


def test_spec_special_ids_at_real_vocab_size(big):
    assert big.vocab_size == 163840
    for name, tid in SPEC_IDS.items():
        assert big.special_ids[name] == tid
        assert big.encode(name, allow_special=True) == [tid]
    assert big.stop_ids == (163585, 163586, 163593)
    assert big.special_ids["<|reserved_token_163589|>"] == 163589


# ---- encode / decode ------------------------------------------------------------------------


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_round_trip(tiny, big, text):
    for tok in (tiny, big):
        ids = tok.encode(text)
        assert all(0 <= t < tok.num_ordinary for t in ids)
        assert tok.decode(ids) == text


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_encode_matches_reference_bpe(tiny, text):
    ranks = load_tiktoken_bpe(TINY_ASSET)
    assert tiny.encode(text) == reference_bpe_encode(text, ranks)


def test_pattern_splits_han_runs():
    # Kimi's distinctive first branch: Han runs are their own pre-tokens.
    assert regex.findall(PAT_STR, "中文English混合 北京市 Pascal", flags=regex.V1) == [
        "中文", "English", "混合", " ", "北京市", " Pascal"]
    assert regex.findall(PAT_STR, "HELLO's don't 12345", flags=regex.V1) == ["HELLO's", " don't", " ", "123", "45"]


def test_tiny_compresses(tiny):
    text = "The scheduler packs many requests into one batch. 模型把文本切分成词元。"
    assert len(tiny.encode(text)) < 0.6 * len(text.encode("utf-8"))


def test_long_runs_are_cut_like_kimi(tiny):
    assert [len(p) for p in split_long_runs("a" * 60000)] == [25000, 25000, 10000]
    pieces = list(split_long_runs("xy" + " " * 30000 + "z"))
    assert "".join(pieces) == "xy" + " " * 30000 + "z"
    assert [len(p) for p in pieces] == [25002, 5001]
    text = "ab" * 20000 + " " * 26000 + "end"
    assert tiny.decode(tiny.encode(text)) == text


# ---- special tokens -------------------------------------------------------------------------


def test_special_tokens_parsed_only_when_allowed(tiny):
    text = "a<|im_end|>b<think>c</think>"
    plain = tiny.encode(text)
    assert not any(tiny.is_special(t) for t in plain)
    assert tiny.decode(plain) == text
    ids = tiny.encode(text, allow_special=True)
    assert ids == tiny.encode("a") + [770] + tiny.encode("b") + [768 + 22] + tiny.encode("c") + [768 + 23]
    assert tiny.decode(ids) == text
    assert tiny.decode(ids, skip_special=True) == "abc"


def test_every_special_token_is_one_id(tiny):
    for name, tid in tiny.special_ids.items():
        assert tiny.encode(name, allow_special=True) == [tid]
        assert tiny.encode("x" + name + "y", allow_special=True) == tiny.encode("x") + [tid] + tiny.encode("y")
        assert tiny.decode([tid]) == name


def test_partial_special_strings_are_text(tiny):
    for text in ("<|im_end", "im_end|>", "<|im_end |>", "<think", "[EOS"):
        ids = tiny.encode(text, allow_special=True)
        assert not any(tiny.is_special(t) for t in ids) and tiny.decode(ids) == text


def test_out_of_range_ids_raise(tiny):
    with pytest.raises(ValueError):
        tiny.decode([1024])
    with pytest.raises(ValueError):
        tiny.decode([-1])


def test_declared_names_are_the_special_table(tiny):
    # A config that declares names replaces the K2 layout: ids answer to the declared names only.
    tok = KimiTokenizer.from_file(TINY_ASSET, tokenizer_config={
        "added_tokens_decoder": {"769": {"content": "[EOS]"}, "770": {"content": "<|end_of_msg|>"},
                                 "773": {"content": "<|start_header_id|>"}}})
    assert tok.encode("<|end_of_msg|><|start_header_id|>", allow_special=True) == [770, 773]
    assert "<|im_end|>" not in tok.special_ids and "<|im_user|>" not in tok.special_ids
    assert tok.special_ids["<|reserved_token_771|>"] == 771
    assert tok.bos_id is None and tok.eos_id == 769
    with pytest.raises(KeyError, match="not declared"):
        tok.id_of("<|im_user|>")
    assert tok.message_format == "kimi"  # no <|open|> / <|close|> / <|sep|>: not the K3 format
    assert tok.stop_ids == (769,)        # <|end_of_msg|> ends a message only in the K3 format


def test_k3_layout_is_chosen_by_declared_names():
    k3 = KimiTokenizer.tiny("k3")
    assert k3.message_format == "k3"
    # K3 reuses K2's ids 770..773 for other tokens; lookups go by name, never by offset.
    assert [k3.id_of(n) for n in ("<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>")] == [770, 771, 772, 773]
    assert k3.im_end_id == 770 and k3.stop_ids == (769, 770, 777)
    assert not k3.has_special("<|im_user|>") and not k3.has_special("<think>")
    assert k3.id_of("<|media_pad|>") == 768 + 21
    assert KimiTokenizer.tiny().message_format == "kimi"


# ---- incremental detokenizer ----------------------------------------------------------------


def _stream(tok, ids, skip_special=False):
    det = IncrementalDetokenizer(tok, skip_special=skip_special)
    pieces = [det.push(t) for t in ids]
    return pieces, det.flush()


@pytest.mark.parametrize("text", ["🙂🚀👩‍👩‍👧", "今天天气很好，我们去公园散步吧。", "mixed 混合 🙂 text é"])
def test_detokenizer_split_characters(tiny, text):
    ids = tiny.encode(text)
    # the test is only meaningful if some token ends mid-character
    broken = []
    for t in ids:
        try:
            tiny.token_bytes(t).decode("utf-8")
        except UnicodeDecodeError:
            broken.append(t)
    assert broken
    pieces, tail = _stream(tiny, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + tail == tiny.decode(ids) == text
    assert tail == ""
    # every emitted prefix is a prefix of the full text made of whole characters
    acc = ""
    for p in pieces:
        acc += p
        assert text.startswith(acc)


def test_detokenizer_with_specials(tiny):
    ids = tiny.encode("<think>思考🙂</think>答案<|im_end|>", allow_special=True)
    pieces, tail = _stream(tiny, ids)
    assert "".join(pieces) + tail == tiny.decode(ids)
    pieces, tail = _stream(tiny, ids, skip_special=True)
    assert "".join(pieces) + tail == tiny.decode(ids, skip_special=True) == "思考🙂答案"


def test_detokenizer_matches_decode_on_random_bytes(tiny):
    # Arbitrary byte tokens (including invalid UTF-8) and specials: streaming == one-shot decode.
    rng = random.Random(0)
    pool = list(range(256)) + tiny.encode("你好🙂é") + [770, 790]
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 12))]
        pieces, tail = _stream(tiny, ids)
        assert "".join(pieces) + tail == tiny.decode(ids)


def test_detokenizer_holds_incomplete_tail(tiny):
    smile = "🙂".encode()  # 4 bytes, fed one byte-token at a time
    det = IncrementalDetokenizer(tiny)
    assert [det.push(b) for b in smile[:3]] == ["", "", ""]
    assert det.pending_bytes == 3
    assert det.push(smile[3]) == "🙂"
    det.push(smile[0])
    assert det.flush() == "\ufffd"  # an unfinished character at the end, as decode() does
    assert det.flush() == ""


# ---- real Kimi vocabulary (no file in this environment) --------------------------------------


@pytest.mark.skipif(not os.path.isfile(REAL_TIKTOKEN), reason="set K3JAX_KIMI_TIKTOKEN to a Kimi tiktoken.model")
def test_real_kimi_tiktoken():
    tok = KimiTokenizer.from_file(REAL_TIKTOKEN)
    assert tok.num_ordinary == 163584 and tok.vocab_size == 163840
    for name, tid in SPEC_IDS.items():
        assert tok.encode(name, allow_special=True) == [tid]
    # Reference ids published for the K2/K3 vocabulary.
    assert tok.encode("Hello world") == [19180, 2695]
    assert tok.encode("Hello, world!") == [19180, 11, 2695, 0]
    assert tok.encode("你好世界") == [33845, 2243]
    assert tok.encode("1234567890") == [6694, 12972, 16242, 15]
    for text in MULTILINGUAL:
        assert tok.decode(tok.encode(text)) == text
        pieces, tail = _stream(tok, tok.encode(text))
        assert "".join(pieces) + tail == text


@pytest.mark.parametrize("content", [b"garbage\n", b"YQ== 0\nnot-base64! 1\n", b"YQ== zero\n"])
def test_corrupt_tiktoken_file_names_the_file_and_line(tmp_path, content):
    """A corrupt tiktoken.model in a checkpoint was "error: not enough values to unpack (expected 2, got 1)"."""
    path = tmp_path / "tiktoken.model"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"tiktoken.model: not a tiktoken BPE file \(line \d is not"):
        KimiTokenizer.from_file(path)
