#!/usr/bin/env python3
"""Build k3jax/assets/tiny.tiktoken: the tiny model's byte-level BPE vocabulary.

768 ordinary tokens: the 256 single bytes (rank = byte value) then 512 merges learned by a
plain byte-level BPE trainer on the small multilingual text below (English, Chinese, code,
JSON), pre-split with Kimi's own pattern. Deterministic: ties go to the pair whose merged
bytes sort first. The 256 special ids (768..1023) are added by KimiTokenizer, not stored.

    python -m tools.make_tiny_tokenizer            # (re)write the asset
    python -m tools.make_tiny_tokenizer --check    # exit 1 if the asset is stale

`--english` builds k3jax/assets/tiny-en.tiktoken instead, the trained tiny model's vocabulary:
3584 merges (4096 ids with the 256 specials) learned on the English corpus that
tools/build_tiny_corpus.py writes to data/tiny_corpus/train.
"""

from __future__ import annotations

import argparse
import collections
import heapq
from pathlib import Path

import regex

ROOT = Path(__file__).resolve().parent.parent
from k3jax.tokenizer.vocab import PAT_STR, dump_tiktoken_bpe

ASSET = ROOT / "k3jax" / "assets" / "tiny.tiktoken"
NUM_MERGES = 512
ENGLISH_ASSET = ROOT / "k3jax" / "assets" / "tiny-en.tiktoken"
ENGLISH_MERGES = 3584
ENGLISH_CORPUS = ROOT / "data" / "tiny_corpus" / "train"

CORPUS = r'''
The tiny model exists so that every part of the serving stack can be tested on a laptop.
It has a small vocabulary, a few layers, and random weights; what it says is nonsense,
but the shapes, the cache, the scheduler and the streaming path are all the real ones.
When a request arrives, the server renders the chat template, encodes the prompt, and
hands the token ids to the scheduler. The scheduler packs many requests into one batch,
the model runs one step, the sampler picks the next token for every sequence, and the
detokenizer turns the new ids back into text that is streamed to the client.
A good tokenizer never splits a special token, never loses a byte, and never prints half
of a character: an emoji such as 🙂 or 🚀 takes four bytes, a Chinese character three.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
She said: "It's not what you think, and they're not coming back; we'll see what I'd do."
Numbers matter too: 1, 22, 333, 4444, 55555, 3.14159, 2.71828, 1024, 65536, 163584.
Prices rose 12% in 2024, then fell by 7.5% before the end of the year.
Attention is computed over the whole sequence, while the linear layers keep a fixed state.
The delta rule updates the state with a gated correction, one chunk of tokens at a time.

人工智能正在改变我们的生活方式。这个小模型只用于测试，它的权重是随机的。
今天天气很好，我们去公园散步吧。北京是中国的首都，上海是一个国际化的大城市。
模型把文本切分成词元，再把词元转换成向量，最后预测下一个词元。
我们需要一个能够正确处理中文、英文、代码和表情符号的分词器。
你好，世界！请问你叫什么名字？我是一个语言模型，我可以回答问题、写代码、翻译文本。
流式输出的时候，不能把一个汉字切成两半，也不能把特殊标记拆开。
注意力机制和线性注意力各有优点：前者精确，后者在长文本上更快。

def softmax(x):
    """Numerically stable softmax over the last axis."""
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


class Scheduler:
    def __init__(self, max_batch: int = 8, max_tokens: int = 2048):
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def step(self) -> list[Request]:
        batch = []
        budget = self.max_tokens
        for req in self.waiting:
            if len(batch) >= self.max_batch or req.num_tokens > budget:
                break
            batch.append(req)
            budget -= req.num_tokens
        return batch


for i in range(10):
    if i % 2 == 0:
        print(f"even: {i}")
    else:
        print(f"odd: {i}")

import json
import numpy as np
from typing import Optional

def load_config(path: str) -> dict:
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)

{"model": "kimi-tiny", "messages": [{"role": "system", "content": "You are a helpful assistant."},
 {"role": "user", "content": "What is the weather in Beijing today?"}], "stream": true, "max_tokens": 128}
{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a city",
 "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
{"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Beijing\"}"}}
{"city": "Beijing", "temperature": 21, "condition": "sunny", "humidity": 0.35, "wind": null, "ok": false}
{"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": null}], "usage": {"prompt_tokens": 12}}

const add = (a, b) => a + b;
function greet(name) { return `Hello, ${name}!`; }
SELECT id, name FROM users WHERE age > 30 ORDER BY name;
<div class="message"><p>Hello world</p></div>
$ pip install -e . && python -m pytest tests -q
Bonjour le monde, ça va? Ünïcödé façade naïve café. Привет, мир! こんにちは世界。안녕하세요.
'''


def pretokenize(text: str) -> collections.Counter:
    """Kimi's pattern splits text into chunks; BPE never merges across chunks."""
    pat = regex.compile(PAT_STR, flags=regex.V1)  # V1: `&&` is class intersection
    return collections.Counter(m.encode("utf-8") for m in pat.findall(text))


def train_bpe(text: str | collections.Counter, num_merges: int) -> dict[bytes, int]:
    """Byte-level BPE: start from 256 bytes, repeatedly merge the most frequent adjacent pair.

    text: the corpus, or its pretokenized word counts. Incremental: pair counts and the words
    holding each pair are kept up to date, and a lazy heap gives the next pair (the same merges
    as recounting every pair each round, in a fraction of the time on megabytes of text).
    """
    counts = text if isinstance(text, collections.Counter) else pretokenize(text)
    vocab = [bytes([i]) for i in range(256)]
    known = set(vocab)
    words = [list(w) for w in counts]
    freq = list(counts.values())
    pairs: collections.Counter = collections.Counter()
    where: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pairs[p] += freq[i]
            where[p].add(i)
    # Most frequent first; ties broken by the merged bytes, then the pair (deterministic).
    heap = [(-n, vocab[a] + vocab[b], a, b) for (a, b), n in pairs.items()]
    heapq.heapify(heap)
    while len(vocab) < 256 + num_merges:
        while heap:
            neg, merged, a, b = heapq.heappop(heap)
            # stale entry, or a pair whose bytes are already a token (it would duplicate a rank)
            if pairs.get((a, b), 0) == -neg and neg < 0 and merged not in known:
                break
        else:
            raise SystemExit(f"corpus too small: only {len(vocab) - 256} merges possible")
        new_id = len(vocab)
        vocab.append(merged)
        known.add(merged)
        changed = set()
        for i in where.pop((a, b)):
            w, n = words[i], freq[i]
            for p in zip(w, w[1:]):
                pairs[p] -= n
                changed.add(p)
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(new_id)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for p in zip(out, out[1:]):
                pairs[p] += n
                where[p].add(i)
                changed.add(p)
        for p in changed:
            n = pairs[p]
            if n > 0:
                heapq.heappush(heap, (-n, vocab[p[0]] + vocab[p[1]], p[0], p[1]))
            else:
                del pairs[p]
                where.pop(p, None)
    return {tok: rank for rank, tok in enumerate(vocab)}


def build(english: bool = False) -> bytes:
    """The asset's bytes (tiktoken file format)."""
    if not english:
        return dump_tiktoken_bpe(train_bpe(CORPUS, NUM_MERGES))
    files = sorted(ENGLISH_CORPUS.glob("*.txt"))
    if not files:
        raise SystemExit(f"no corpus in {ENGLISH_CORPUS}: run tools/build_tiny_corpus.py first")
    counts: collections.Counter = collections.Counter()
    for f in files:
        counts.update(pretokenize(f.read_text(encoding="utf-8")))
    return dump_tiktoken_bpe(train_bpe(counts, ENGLISH_MERGES))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify the asset instead of writing it")
    ap.add_argument("--english", action="store_true", help="the trained tiny model's English vocabulary")
    args = ap.parse_args()
    data = build(args.english)
    asset = ENGLISH_ASSET if args.english else ASSET
    if args.check:
        ok = asset.exists() and asset.read_bytes() == data
        print(f"{asset.name} is up to date" if ok else f"{asset.name} is stale: rerun this script")
        return 0 if ok else 1
    asset.parent.mkdir(parents=True, exist_ok=True)
    asset.write_bytes(data)
    print(f"wrote {asset} ({len(data.splitlines())} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
