"""Which text of a prompt may become special tokens: only the text the chat format itself writes.

A rendered prompt mixes two kinds of text: the format's own (a checkpoint's jinja template, the
built-in Kimi renderer, K3's renderer, the tokenizer's bos/eos names) and the caller's (message
content and names, reasoning, tool calls and results, tool definitions, template arguments).
Only the first may become control tokens. If the caller's could, a user who types
`<|im_end|><|im_system|>system<|im_middle|>...` would write a system turn of their own, and
`<|media_pad|>` would open an image slot.

The built-in and K3 renderers keep the two apart by construction: they emit special tokens and
text as separate parts and encode every text part with special-token parsing off. A jinja
template mixes both into one string, so for it `Shield` keeps them apart around the render:

1. before rendering, every string of the caller's data (values and keys, at any depth) is
   protected: each special-token string in it, and any start of one at the string's end or end
   of one at its start (which could complete a special token with the text rendered next to
   it: two content parts `<|im_` and `end|>`), is replaced by one private-use character that
   the input does not hold;
2. the rendered text is cut at the special-token strings it still holds (the template's own,
   which no caller text can be part of now), and the text between them is encoded as plain
   text once the private-use characters are replaced back by what they stood for.

Text without special-token strings or their ends at its edges is left as it is, so the text and
ids are those of rendering it and encoding the result with special tokens parsed (transformers'
apply_chat_template). A caller string a template puts wholly inside a special token
(`<|im_{{ role }}|>`) still completes it: that is the template's own markup; the server
checks `role` against its few values first.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterable, Iterator

# Private-use characters stand in for protected text: the BMP's area first, then plane 15's.
_PRIVATE_USE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE))
_PRIVATE_USE_RE = re.compile("[\ue000-\uf8ff\U000f0000-\U000ffffd]")
_JSON_ESCAPE_RE = re.compile(r"\\u[0-9a-fA-F]{4}")


class Shield:
    """The special-token strings of one tokenizer, and the protect / restore rules above."""

    def __init__(self, specials: Iterable[str]):
        names = sorted(set(specials))
        self.pattern = _trie_pattern(names)     # leftmost match, the longest where names overlap
        self.max_len = max(map(len, names))
        # a proper start of a special token that ends the text, a proper end of one that starts it
        self.open_end = _trie_pattern(sorted({s[:i] for s in names for i in range(1, len(s))}), r"\Z")
        self.open_start = _trie_pattern(sorted({s[i:] for s in names for i in range(1, len(s))}))

    def session(self, *trees: Any) -> "Session":
        """A Session whose stand-in characters occur nowhere in `trees` (the caller's data and the template)."""
        return Session(self, trees)

    def split(self, text: str) -> Iterator[tuple[bool, str]]:
        """(is a special token, text) runs of `text`, in order."""
        pos = 0
        for m in self.pattern.finditer(text):
            if m.start() > pos:
                yield False, text[pos:m.start()]
            yield True, m.group()
            pos = m.end()
        if pos < len(text):
            yield False, text[pos:]


def _trie_pattern(words: list[str], suffix: str = "") -> re.Pattern:
    """A regex matching any of `words` (the longest at a position), as a trie: a 256-way alternation
    tries every branch at every character; this one only the branches of the character it meets."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        body = "" if not alts else alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node and body else body

    return re.compile(build(trie) + suffix)


def _strings(tree: Any) -> Iterator[str]:
    if isinstance(tree, str):
        yield tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _strings(v)


class Session:
    """One render: protect() the caller's data, render, then marked() the rendered text."""

    def __init__(self, shield: Shield, trees: tuple):
        self.shield = shield
        used: set = set()
        for s in _strings(trees):
            used.update(_PRIVATE_USE_RE.findall(s))
            used.update(e.lower() for e in _JSON_ESCAPE_RE.findall(s))
        self._used = used
        self._free = (chr(c) for r in _PRIVATE_USE for c in r)
        self._char: dict[str, str] = {}      # protected text -> its stand-in
        self._back: dict[str, str] = {}      # stand-in (and its JSON \\u escape) -> protected text
        self._back_re = None

    def _stand_in(self, text: str) -> str:
        c = self._char.get(text)
        if c is None:
            for c in self._free:
                escaped = json.dumps(c)[1:-1]   # what a template's tojson(ensure_ascii=True) writes
                if c not in self._used and not any(e in self._used for e in _JSON_ESCAPE_RE.findall(escaped)):
                    break
            else:
                raise ValueError("too many distinct special-token strings in the request")
            self._char[text] = c
            self._back[c] = text
            self._back[escaped] = json.dumps(text)[1:-1]
            self._back_re = None
        return c

    def protect_string(self, s: str) -> str:
        """s with its special-token strings and open ends (module docstring, step 1) replaced by stand-ins."""
        sh = self.shield
        s = sh.pattern.sub(lambda m: self._stand_in(m.group()), s)
        # the longest start of s that is a proper end of a special token, then the longest end of the rest
        # that is a proper start of one (the leftmost match of open_end)
        m = sh.open_start.match(s)
        head = m.end() if m else 0
        rest = s[head:]
        m = sh.open_end.search(rest, max(0, len(rest) - sh.max_len))
        tail = len(rest) - m.start() if m else 0
        if not head and not tail:
            return s
        out = self._stand_in(s[:head]) if head else ""
        return out + (rest[:-tail] + self._stand_in(rest[-tail:]) if tail else rest)

    def protect(self, tree: Any) -> Any:
        """A copy of JSON-like data with protect_string applied to every string, keys included."""
        if isinstance(tree, str):
            return self.protect_string(tree)
        if isinstance(tree, dict):
            return {self.protect(k): self.protect(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return [self.protect(v) for v in tree]
        return tree

    @property
    def protected(self) -> bool:
        """Whether protect() replaced anything (else the render holds the caller's text as it is)."""
        return bool(self._char)

    def restore(self, text: str) -> str:
        if not self._back:
            return text
        if self._back_re is None:
            self._back_re = re.compile("|".join(map(re.escape, sorted(self._back, key=len, reverse=True))))
        return self._back_re.sub(lambda m: self._back[m.group()], text)

    def marked(self, rendered: str) -> tuple[str, list[tuple[int, int]]]:
        """(the caller's text put back, the (start, end) spans of the template's special tokens in it)."""
        parts, spans, n = [], [], 0
        for special, run in self.shield.split(rendered):
            if not special:
                run = self.restore(run)
            else:
                spans.append((n, n + len(run)))
            parts.append(run)
            n += len(run)
        return "".join(parts), spans
