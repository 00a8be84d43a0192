"""KimiTokenizer: tiktoken BPE with Kimi's split pattern, 256 special ids, and the chat format."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import tiktoken

from k3jax.tokenizer import chat as _chat
from k3jax.tokenizer import vocab as _vocab

TINY_ASSET = Path(__file__).resolve().parent.parent / "assets" / "tiny.tiktoken"
TINY_EN_ASSET = TINY_ASSET.with_name("tiny-en.tiktoken")


ROLE_TOKENS = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}


def _role_tokens(config: Mapping) -> dict:
    out = {}
    for key in ROLE_TOKENS:
        val = config.get(key)
        val = val.get("content") if isinstance(val, Mapping) else val
        if isinstance(val, str):
            out[key] = val
    return out


def _config_dict(tokenizer_config: Any) -> tuple[dict, Path | None]:
    if tokenizer_config is None:
        return {}, None
    if isinstance(tokenizer_config, Mapping):
        return dict(tokenizer_config), None
    path = Path(tokenizer_config)
    with open(path, encoding="utf-8") as f:
        return json.load(f), path.parent


class KimiTokenizer:
    """Kimi tokenizer: `num_ordinary` BPE ids, then 256 special ids found by name.

    Attributes:
      num_ordinary: number of BPE tokens (163584 for real Kimi, 768 for tiny).
      vocab_size: num_ordinary + 256.
      special_ids: {token string: id} for all 256 special ids (reserved ones included).
      message_format: "k3" when the declared names hold K3's four structural tokens (the tagged
        format of spec 8b, k3jax.tokenizer.k3_format), else "kimi" (K2 / Kimi Linear, spec 8).
      bos_id, eos_id, eot_id, pad_id, unk_id: ids of those names, None where undeclared.
      im_end_id: the id that ends a message: `<|im_end|>` (kimi) or `<|end_of_msg|>` (k3).
      stop_ids: the declared ones of [EOS], the end-of-message id, [EOT].
      chat_template: the checkpoint's jinja template, or None (built-in renderer).
    """

    def __init__(self, mergeable_ranks: Mapping[bytes, int], *, special_names: Mapping[int, str] | None = None,
                 chat_template: str | None = None, name: str = "kimi", role_tokens: Mapping[str, str] | None = None):
        ranks = dict(mergeable_ranks)
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise ValueError("mergeable ranks must be dense 0..n-1")
        self.num_ordinary = len(ranks)
        self.vocab_size = self.num_ordinary + _vocab.NUM_SPECIAL
        self._id_to_special = _vocab.special_names(self.num_ordinary, special_names)
        self.special_ids = {tok: tid for tid, tok in self._id_to_special.items()}
        self._enc = tiktoken.Encoding(name, pat_str=_vocab.PAT_STR, mergeable_ranks=ranks,
                                      special_tokens=self.special_ids)
        self.message_format = "k3" if all(t in self.special_ids for t in _vocab.K3_STRUCTURAL) else "kimi"
        # bos/eos/unk/pad token names: the config's `bos_token` etc., else Kimi's defaults
        self.role_tokens = {**ROLE_TOKENS, **(role_tokens or {})}
        get = self.special_ids.get
        self.bos_id, self.eos_id = get(self.role_tokens["bos_token"]), get(self.role_tokens["eos_token"])
        self.pad_id, self.unk_id = get(self.role_tokens["pad_token"]), get(self.role_tokens["unk_token"])
        self.eot_id = get("[EOT]")
        self.im_end_id = get("<|end_of_msg|>") if self.message_format == "k3" else get("<|im_end|>")
        self.stop_ids = tuple(t for t in (self.eos_id, self.im_end_id, self.eot_id) if t is not None)
        self.chat_template = chat_template

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike, tokenizer_config: Any = None) -> "KimiTokenizer":
        """Load a `tiktoken.model` file (or a directory holding one).

        tokenizer_config: None, a dict, or a path to `tokenizer_config.json`. Its
        `added_tokens_decoder` names special ids (ids keep the spec layout); its
        `chat_template` (or a `chat_template.jinja` beside it) switches
        apply_chat_template to jinja rendering. With a directory and no config given,
        `tokenizer_config.json` in that directory is used if present.
        """
        path = Path(path)
        if path.is_dir():
            if tokenizer_config is None and (path / "tokenizer_config.json").exists():
                tokenizer_config = path / "tokenizer_config.json"
            path = path / "tiktoken.model"
        config, config_dir = _config_dict(tokenizer_config)
        names = {}
        for tid, entry in (config.get("added_tokens_decoder") or {}).items():
            content = entry.get("content") if isinstance(entry, Mapping) else entry
            if isinstance(content, str):
                names[int(tid)] = content
        from k3jax.tokenizer.jinja_chat import template_from_config

        template = template_from_config(config)
        if template is None and config_dir is not None and (config_dir / "chat_template.jinja").exists():
            template = (config_dir / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(_vocab.load_tiktoken_bpe(path), special_names=names, chat_template=template,
                   name=path.name, role_tokens=_role_tokens(config))

    @classmethod
    def tiny(cls, message_format: str = "kimi") -> "KimiTokenizer":
        """The embedded tiny tokenizer: 768 ordinary ids + 256 specials (vocab_size 1024).

        message_format="k3": the same BPE with K3's special names declared (K3_SPECIAL_OFFSETS),
        so it speaks the tagged K3 format, as a K3 checkpoint's tokenizer files make it.
        """
        if message_format == "kimi":
            return cls(_vocab.load_tiktoken_bpe(TINY_ASSET), name="kimi-tiny")
        if message_format != "k3":
            raise ValueError(f"unknown message format {message_format!r}")
        ranks = _vocab.load_tiktoken_bpe(TINY_ASSET)
        return cls(ranks, special_names=_vocab.k3_added_tokens(len(ranks)), name="kimi-k3-tiny")

    @classmethod
    def tiny_english(cls) -> "KimiTokenizer":
        """The trained tiny model's tokenizer: a 3840-token English BPE + 256 specials (vocab 4096),
        Kimi's layout (tools/make_tiny_tokenizer.py --english)."""
        return cls(_vocab.load_tiktoken_bpe(TINY_EN_ASSET), name="kimi-tiny-en")

    # ---- ids ----------------------------------------------------------------------------

    def id_of(self, name: str) -> int:
        """Id of a special token by name; KeyError when this tokenizer does not declare it."""
        try:
            return self.special_ids[name]
        except KeyError:
            raise KeyError(f"special token {name!r} is not declared by this tokenizer "
                           f"(message format {self.message_format!r})") from None

    def has_special(self, name: str) -> bool:
        return name in self.special_ids

    def token_str(self, name: str) -> str:
        """The token string of a declared special token (checks that it is declared)."""
        return self._id_to_special[self.id_of(name)]

    def is_special(self, token_id: int) -> bool:
        return self.num_ordinary <= token_id < self.vocab_size

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one id (a special id gives its token string in UTF-8)."""
        self._check_ids((token_id,))
        return self._enc.decode_single_token_bytes(token_id)

    def _check_ids(self, ids: Iterable[int]) -> None:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t} out of range [0, {self.vocab_size})")

    # ---- text ---------------------------------------------------------------------------

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Text -> ids. allow_special=True parses special-token strings ("<|im_end|>") into
        their ids; otherwise they are encoded as ordinary text."""
        out: list[int] = []
        for piece in _vocab.encode_pieces(text):
            if not allow_special:
                out.extend(self._enc.encode_ordinary(piece))
            elif len(piece) > 512:
                out.extend(self._enc.encode(piece, allowed_special="all"))
            else:   # (the same cuts: tiktoken's costs ~0.2 ms a call, its set of 256 names crossing into Rust)
                out.extend(self._encode_with_specials(piece))
        return out

    def _encode_with_specials(self, text: str) -> list[int]:
        out: list[int] = []
        for special, run in self.shield.split(text):
            if special:
                out.append(self.special_ids[run])
            else:
                out.extend(self._enc.encode_ordinary(run))
        return out

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Ids -> text (invalid UTF-8 becomes U+FFFD). skip_special drops special ids."""
        ids = [int(t) for t in ids]
        self._check_ids(ids)
        if skip_special:
            ids = [t for t in ids if t < self.num_ordinary]
        return self._enc.decode(ids)

    # ---- chat ---------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
                            thinking: bool | None = None, tokenize: bool = False, **template_kwargs: Any):
        """Render a conversation (OpenAI-style dicts) into a prompt string, or ids if tokenize.

        Only the format's own markup becomes special tokens; every string the caller passes
        (messages, tools, template_kwargs) is text, even where it spells a special token
        (k3jax.tokenizer.client_text says why and how). The string form shows the prompt; its ids
        come from tokenize=True, never from encoding that string with special tokens parsed.

        A K3-format tokenizer renders K3's tagged format (k3jax.tokenizer.k3_format; template_kwargs
        are its options: thinking_effort, reasoning_effort, tool_choice, response_format,
        image_prompts).

        With a checkpoint jinja template, it is rendered like transformers does (template_kwargs
        are passed to it, beside the tokenizer's bos_token / eos_token / unk_token / pad_token);
        the ids are those of encoding the result with special tokens parsed, for input that spells
        none. Otherwise the built-in Kimi renderer is used (see k3jax.tokenizer.chat).
        """
        if self.message_format == "k3":
            from k3jax.tokenizer import k3_format

            segments = k3_format.render(messages, tools, add_generation_prompt=add_generation_prompt,
                                        thinking=thinking, **template_kwargs)
            return k3_format.encode(self, segments) if tokenize else k3_format.join(segments)
        thinking = True if thinking is None else thinking   # (K3 also reads enable_thinking / efforts)
        if self.chat_template is not None:
            from k3jax.tokenizer.jinja_chat import render_jinja

            specials = {key: name for key, name in self.role_tokens.items() if self.has_special(name)}
            session = self.shield.session(messages, tools, template_kwargs, self.chat_template)
            rendered = render_jinja(self.chat_template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    protect=session.protect, trusted=specials, thinking=thinking, **template_kwargs)
            if not session.protected:      # all special tokens in the text are the template's
                return self.encode(rendered, allow_special=True) if tokenize else rendered
            text, spans = session.marked(rendered)
            return self.encode_marked(text, spans) if tokenize else text
        if template_kwargs:
            raise TypeError(f"unexpected arguments for the built-in template: {sorted(template_kwargs)}")
        parts = _chat.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  thinking=thinking)
        return self.encode_parts(parts) if tokenize else self.join_parts(parts)

    @functools.cached_property
    def shield(self):
        """client_text.Shield of this tokenizer's special-token strings."""
        from k3jax.tokenizer.client_text import Shield

        return Shield(self.special_ids)

    def encode_marked(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """Text -> ids with special tokens exactly at `spans` ((start, end), ordered; a renderer's
        own markup) and everything else plain text. Cut into pieces as encode() is, so that with
        `spans` = every special-token string of `text` this is encode(text, allow_special=True)."""
        out: list[int] = []
        start, i = 0, 0
        for piece in _vocab.encode_pieces(text):
            end = start + len(piece)
            pos = start
            while i < len(spans) and spans[i][0] < end:
                a, b = spans[i]
                if a >= pos and b <= end:      # (one cut by a piece boundary is text, as in encode)
                    out.extend(self.encode(text[pos:a]))
                    out.append(self.special_ids[text[a:b]])
                    pos = b
                if b > end:
                    break
                i += 1
            out.extend(self.encode(text[pos:end]))
            start = end
        return out

    def join_parts(self, parts: list[tuple[str, str]]) -> str:
        """Parts from the built-in renderer -> prompt string."""
        return "".join(self.token_str(v) if kind == "special" else v for kind, v in parts)

    def encode_parts(self, parts: list[tuple[str, str]]) -> list[int]:
        """Parts -> ids: special parts by id, each text run between them encoded as plain text."""
        ids: list[int] = []
        run: list[str] = []
        for kind, v in parts:
            if kind == "special":
                if run:
                    ids.extend(self.encode("".join(run)))
                    run = []
                ids.append(self.id_of(v))
            else:
                run.append(v)
        if run:
            ids.extend(self.encode("".join(run)))
        return ids
