"""Chained prefix hashes over fixed token units (stable across processes and machines).

h_0 = blake2b(namespace); h_i = blake2b(h_{i-1} || tokens of unit i as little-endian u32 ||
encoded extra keys of unit i). A hash therefore names the whole prefix up to the end of
unit i, never just its tail. Extra keys (e.g. the hash of an image whose placeholder tokens
fall in the unit, a LoRA name) make identical token ids with different content differ.
"""
from __future__ import annotations

import hashlib
from typing import List, Mapping, Optional, Sequence, Union

import numpy as np

DIGEST_SIZE = 16
ExtraKeys = Union[None, Mapping[int, Sequence], Sequence]


def root_hash(namespace: Union[str, bytes] = b"") -> bytes:
    """h_0 for a namespace (model id, cache salt); different namespaces never share hits."""
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    return hashlib.blake2b(b"k3jax-prefix-v1\0" + ns, digest_size=DIGEST_SIZE).digest()


def _encode_key(k) -> bytes:
    # Type-tagged and length-prefixed so ("ab",) and ("a", "b") or 1 and "1" differ.
    if isinstance(k, bytes):
        tag, b = b"b", k
    elif isinstance(k, str):
        tag, b = b"s", k.encode()
    elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
        tag, b = b"i", str(int(k)).encode()
    else:
        raise TypeError(f"extra key must be bytes, str or int, got {type(k).__name__}")
    return tag + len(b).to_bytes(4, "little") + b


def _keys_for(extra: ExtraKeys, unit: int):
    if extra is None:
        return ()
    if isinstance(extra, Mapping):
        return extra.get(unit, ()) or ()
    return (extra[unit] or ()) if unit < len(extra) else ()


def chain_hashes(token_ids, unit: int, extra_keys: ExtraKeys = None,
                 parent: Optional[bytes] = None, start_unit: int = 0,
                 namespace: Union[str, bytes] = b"") -> List[bytes]:
    """Hashes of every complete unit of token_ids.

    token_ids: the tokens from unit `start_unit` on (the whole sequence when start_unit=0);
    unit: tokens per unit; extra_keys: per-unit keys, indexed by absolute unit index, as a
    mapping {unit_index: keys} or a sequence (None / () = no keys); parent: the hash of unit
    start_unit-1 (to extend an existing chain), else the namespace root. Returns
    [h_{start_unit+1}, ...], one per complete unit; a trailing partial unit is not hashed.
    """
    toks = np.asarray(token_ids, dtype="<u4").reshape(-1)
    h = root_hash(namespace) if parent is None else parent
    if parent is None and start_unit != 0:
        raise ValueError("parent: required when start_unit > 0")
    out = []
    for j in range(len(toks) // unit):
        m = hashlib.blake2b(h, digest_size=DIGEST_SIZE)
        m.update(toks[j * unit:(j + 1) * unit].tobytes())
        keys = _keys_for(extra_keys, start_unit + j)
        if keys:
            m.update(b"\xffx")  # separates "no keys" from any key encoding
            for k in keys:
                m.update(_encode_key(k))
        h = m.digest()
        out.append(h)
    return out


def tail_hash(parent: bytes, tokens) -> bytes:
    """Key of a prefix that ends inside a unit: the chain hash of its complete units (`parent`)
    plus its remaining 1..unit-1 tokens. Distinct from every unit hash (its own tag)."""
    m = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    m.update(b"\xfet")
    m.update(np.asarray(tokens, dtype="<u4").reshape(-1).tobytes())
    return m.digest()
