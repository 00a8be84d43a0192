"""Kimi tokenizer (tiktoken BPE + 256 special ids), streaming detokenizer, chat format.

    from k3jax.tokenizer import KimiTokenizer, IncrementalDetokenizer
    tok = KimiTokenizer.from_file("tiktoken.model", tokenizer_config=None)
    tok = KimiTokenizer.tiny()
"""

from k3jax.tokenizer.detokenizer import IncrementalDetokenizer
from k3jax.tokenizer.kimi import KimiTokenizer
from k3jax.tokenizer.vocab import NUM_SPECIAL, PAT_STR, SPECIAL_OFFSETS

__all__ = ["KimiTokenizer", "IncrementalDetokenizer", "PAT_STR", "SPECIAL_OFFSETS", "NUM_SPECIAL"]
