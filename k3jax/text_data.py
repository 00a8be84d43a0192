"""Plain text -> fixed-length token windows, through grain pipelines (training and evaluation).

Documents are files (`*.txt` under a folder, or one file); a file larger than PIECE_BYTES is read
in pieces cut at line ends, so memory stays bounded whatever the input. Every document is scored
or trained on as `[EOS] + tokens`: the EOS that ends one document in the training stream is the
context that starts the next. (Evaluation scores each piece on its own: a file over a MiB loses
one target and the context across each cut.)

Training: `train_windows` packs all documents into one token stream cut into [T+1] windows
(a random-access source, so grain shuffles, shards and checkpoints it by index).
Evaluation: `eval_batches` tokenizes document by document and yields [B, T+1] windows padded with a
length, every document token predicted exactly once (consecutive windows overlap by one token).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterator, Sequence

import grain
import numpy as np

PIECE_BYTES = 1 << 20


def text_files(path: str | os.PathLike) -> list[Path]:
    """A file, or the `*.txt` files under a folder (recursively), sorted by path."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")
    files = sorted(f for f in p.rglob("*.txt") if f.is_file())
    if not files:
        raise FileNotFoundError(f"{path}: no *.txt files")
    return files


def piece_offsets(path: Path, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """Byte ranges that cut one file into pieces of about `piece_bytes`, at line ends (a line
    longer than that is cut inside): a huge file is never read into memory whole."""
    out, start, pos = [], 0, 0
    with open(path, "rb") as f:
        for line in iter(lambda: f.readline(piece_bytes), b""):
            pos += len(line)
            if pos - start >= piece_bytes:
                out.append((start, pos))
                start = pos
    if pos > start or not out:
        out.append((start, pos))
    return out


def read_piece(path: Path, start: int, end: int) -> str:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start).decode("utf-8", errors="replace")


def token_stream(tokenizer, files: Sequence[Path]) -> np.ndarray:
    """All documents as one int32 stream, each followed by EOS (the training layout)."""
    eos = tokenizer.eos_id
    parts = []
    for f in files:
        ids = [t for a, b in piece_offsets(f) for t in tokenizer.encode(read_piece(f, a, b))]
        parts.append(np.asarray(ids + [eos], np.int32))
    return np.concatenate([np.asarray([eos], np.int32)] + parts)


class TokenWindows(grain.sources.RandomAccessDataSource):
    """Window i of a token stream: tokens [i*T, i*T + T + 1) (inputs and shifted targets)."""

    def __init__(self, stream: np.ndarray, seq_len: int):
        if len(stream) < seq_len + 1:
            raise ValueError(f"{len(stream)} tokens are fewer than one window of {seq_len + 1}")
        self.stream, self.seq_len = stream, seq_len

    def __len__(self) -> int:
        return (len(self.stream) - 1) // self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        s = int(i) * self.seq_len
        return self.stream[s:s + self.seq_len + 1]


def train_windows(stream: np.ndarray, seq_len: int, batch_size: int, seed: int,
                  shard_index: int = 0, shard_count: int = 1) -> grain.IterDataset:
    """Shuffled (a new order every epoch), sharded across processes, batched [B, T+1] windows,
    endless; its iterator's get_state()/set_state() resume it exactly."""
    ds = grain.MapDataset.source(TokenWindows(stream, seq_len))[shard_index::shard_count]
    return ds.seed(seed).shuffle().repeat(None).batch(batch_size, drop_remainder=True).to_iter_dataset()


@dataclasses.dataclass
class _DocumentWindows(grain.experimental.FlatMapTransform):
    """One text piece -> its [T+1] windows (padded with 0) and their lengths."""
    tokenizer: object
    seq_len: int
    max_fan_out: int = PIECE_BYTES + 1

    def flat_map(self, element):
        text, first = element
        ids = self.tokenizer.encode(text)
        if first:
            ids = [self.tokenizer.eos_id] + ids
        out = []
        for s in range(0, max(len(ids) - 1, 0), self.seq_len):
            w = ids[s:s + self.seq_len + 1]
            row = np.zeros(self.seq_len + 1, np.int32)
            row[:len(w)] = w
            out.append({"tokens": row, "length": np.int32(len(w))})
        return out


class _Pieces(grain.sources.RandomAccessDataSource):
    """(text piece, is it the start of its document), by index over every file's pieces (only
    their byte ranges are kept)."""

    def __init__(self, files: Sequence[Path], piece_bytes: int = PIECE_BYTES):
        self.index = [(f, a, b) for f in files for a, b in piece_offsets(f, piece_bytes)]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        f, a, b = self.index[int(i)]
        return read_piece(f, a, b), a == 0


def eval_batches(tokenizer, path, seq_len: int, batch_size: int) -> grain.IterDataset:
    """Batches {"tokens": [B, T+1], "length": [B]} over every document under `path`, in file order
    (deterministic); the last batch may be smaller. Window lengths of 1 carry no target."""
    pieces = grain.MapDataset.source(_Pieces(text_files(path))).to_iter_dataset()
    windows = grain.experimental.FlatMapIterDataset(pieces, _DocumentWindows(tokenizer, seq_len))
    return windows.batch(batch_size, drop_remainder=False)
