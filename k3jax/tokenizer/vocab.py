"""Kimi vocabulary facts: the split pattern, the special-token layout, the tiktoken file format.

The pattern and the reserved-name rule are those of Moonshot's `tokenization_kimi.py`
(Kimi K2 / Kimi Linear): a leading `[\\p{Han}]+` branch, Han subtracted from the letter
branches (`&&` class intersection, supported by tiktoken's fancy-regex and by the `regex`
module in V1 mode), and every unnamed id among the 256 special ids called
`<|reserved_token_{id}|>` with its absolute id.

Special tokens are found by name. A checkpoint's `tokenizer_config.json` declares them
(`added_tokens_decoder`, id -> name); when it declares any, those names are the whole table
(the rest are reserved), so a K3 checkpoint that puts `<|open|>` where K2 had `<|im_user|>`
never answers to K2 names. A bare `tiktoken.model` gets the K2 / Kimi Linear layout below,
relative to the number of ordinary tokens (163584 for real Kimi, 768 for the tiny one).
K3_SPECIAL_OFFSETS is the K3 layout the tiny K3-format tokenizer declares (spec 8b).
"""

from __future__ import annotations

import base64
import os
from typing import Mapping

PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NUM_SPECIAL = 256

# Offset from num_ordinary of every special id the spec names (spec ids minus 163584).
SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<think>": 22,
    "</think>": 23,
    "[UNK]": 254,
    "[PAD]": 255,
}

# The K3 tagged format's structural tokens (spec 8b) and the K3 layout used by the tiny
# K3-format tokenizer: K2's ids 2..5 carry the four structural tokens, the chat-role and
# tool-call markers and <think> are gone, [BOS]/[EOS]/[EOT]/media/[UNK]/[PAD] stay.
K3_STRUCTURAL = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
K3_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|end_of_msg|>": 2,
    "<|open|>": 3,
    "<|close|>": 4,
    "<|sep|>": 5,
    "[EOT]": 9,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "[UNK]": 254,
    "[PAD]": 255,
}



def k3_added_tokens(num_ordinary: int) -> dict[int, str]:
    """The K3 layout as `added_tokens_decoder` would declare it: absolute id -> name."""
    return {num_ordinary + off: name for name, off in K3_SPECIAL_OFFSETS.items()}


# Kimi's encode() cuts text into pieces before tiktoken (tiktoken panics on huge inputs and
# is quadratic on very long runs); we cut at the same places so ids match the reference.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000


def special_names(num_ordinary: int, declared: Mapping[int, str] | None = None) -> dict[int, str]:
    """id -> token string for the 256 special ids [num_ordinary, num_ordinary + 256).

    declared (absolute id -> name, e.g. a checkpoint's `added_tokens_decoder`): when it names
    any special id, it is the table; when empty or None, the K2 layout (SPECIAL_OFFSETS) is.
    Unnamed ids are `<|reserved_token_{id}|>`, as in Moonshot's tokenizer.
    """
    names = {int(t): n for t, n in (declared or {}).items() if num_ordinary <= int(t) < num_ordinary + NUM_SPECIAL}
    if not names:
        names = {num_ordinary + off: name for name, off in SPECIAL_OFFSETS.items()}
    out = {}
    for tid in range(num_ordinary, num_ordinary + NUM_SPECIAL):
        out[tid] = names.get(tid, f"<|reserved_token_{tid}|>")
    if len(set(out.values())) != NUM_SPECIAL:
        raise ValueError("special token names must be unique")
    return out


def parse_tiktoken_bpe(data: bytes) -> dict[bytes, int]:
    """Parse the tiktoken file format (`base64(token) rank` per line) into {bytes: rank}.

    Ranks must be dense 0..n-1: the rank is the token id.
    """
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except ValueError:          # (binascii.Error is one)
            raise ValueError(f"line {number} is not 'base64-token rank': {line[:60]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("tiktoken ranks are not dense from 0")
    return ranks


def load_tiktoken_bpe(path: str | os.PathLike) -> dict[bytes, int]:
    """Read a tiktoken BPE file from disk (no network, no cache side effects)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return parse_tiktoken_bpe(data)
    except ValueError as e:
        raise ValueError(f"{path}: not a tiktoken BPE file ({e})") from None


def dump_tiktoken_bpe(ranks: Mapping[bytes, int]) -> bytes:
    """Serialize {bytes: rank} in the tiktoken file format, ordered by rank."""
    lines = [base64.b64encode(tok) + b" " + str(rank).encode() for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    return b"\n".join(lines) + b"\n"


def split_long_runs(s: str, max_run: int = MAX_RUN_CHARS):
    """Cut `s` so that no piece holds more than `max_run` consecutive (non-)whitespace chars.

    Same cut points as `_split_whitespaces_or_nonwhitespaces` in Kimi's tokenizer.
    """
    if len(s) <= max_run:  # fast path: no run can be longer than the string
        yield s
        return
    run_len = 0
    run_is_space = s[0].isspace()
    start = 0
    for i, ch in enumerate(s):
        is_space = ch.isspace()
        if run_is_space ^ is_space:
            run_len = 1
            run_is_space = is_space
        else:
            run_len += 1
            if run_len > max_run:
                yield s[start:i]
                start = i
                run_len = 1
    yield s[start:]


def encode_pieces(text: str):
    """The substrings Kimi's encode() hands to tiktoken one by one."""
    for i in range(0, len(text), MAX_ENCODE_CHARS):
        yield from split_long_runs(text[i : i + MAX_ENCODE_CHARS])
