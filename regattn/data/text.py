"""A byte-level tokenizer and an offline text corpus: the Python standard library's own sources.

Every Python installation ships its standard library as ``.py`` files (``sysconfig``'s ``stdlib``
path, e.g. ``/usr/lib/python3.11``), so the corpus is present on any machine that runs regattn,
with no download. It is the top-level modules of that folder (``*.py``, not packages), sorted by
name, each file one document; documents are joined by the end-of-text token. Every ``val_every``-th
document (by sorted index) is held out for validation, so the two splits share no file. The text
depends on the Python version: record ``TextCorpus.info`` beside any result.

Tokens are the UTF-8 bytes ``0..255`` plus ``EOT = 256`` (vocabulary 257).
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass

import torch


class ByteTokenizer:
    """UTF-8 bytes as tokens ``0..255``; ``EOT = 256`` separates documents."""

    EOT = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens) -> str:
        """Tokens back to text; ``EOT`` becomes a newline, invalid UTF-8 a replacement character."""
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        return bytes(10 if t == self.EOT else t for t in tokens).decode("utf-8", errors="replace")


@dataclass
class TextCorpus:
    """Token streams ``train``, ``val``: 1-D int64 tensors; ``info`` says where the text came from."""
    train: torch.Tensor
    val: torch.Tensor
    info: dict

    def batch(self, split: str, batch_size: int, seq_len: int, generator: torch.Generator):
        """Random windows of ``split``: ``(inputs, targets)``, each ``[batch_size, seq_len]``, targets
        shifted by one token."""
        stream = self._split(split)
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
        rows = torch.stack([stream[s: s + seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def windows(self, split: str, seq_len: int, max_tokens: int | None = None):
        """Consecutive non-overlapping windows covering ``split`` (up to ``max_tokens`` targets):
        ``(inputs, targets)``, each ``[n, seq_len]``."""
        stream = self._split(split)
        n = (len(stream) - 1) // seq_len
        if max_tokens is not None:
            n = min(n, max(1, max_tokens // seq_len))
        x = stream[: n * seq_len].view(n, seq_len)
        y = stream[1: n * seq_len + 1].view(n, seq_len)
        return x, y

    def _split(self, split: str) -> torch.Tensor:
        if split not in ("train", "val"):
            raise ValueError(f"split: expected 'train' or 'val', got {split!r}")
        return self.train if split == "train" else self.val


def stdlib_files(root: str | None = None) -> list[str]:
    """The sorted top-level ``*.py`` files of the standard library folder (or of ``root``)."""
    root = root or sysconfig.get_paths()["stdlib"]
    return sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".py"))


def stdlib_corpus(max_bytes: int | None = None, *, val_every: int = 10, root: str | None = None) -> TextCorpus:
    """The standard-library corpus (see the module text), capped at ``max_bytes`` of text in all.

    Args:
        max_bytes: stop adding files once this many bytes are read (None: every file).
        val_every: document ``i`` goes to validation when ``i % val_every == val_every - 1``.
        root: a folder to read instead of the standard library.
    """
    if val_every < 2:
        raise ValueError(f"val_every: expected an int >= 2, got {val_every}")
    files = stdlib_files(root)
    tok = ByteTokenizer()
    splits = {"train": [], "val": []}
    digest, used = hashlib.sha256(), 0
    for i, path in enumerate(files):
        if max_bytes is not None and used >= max_bytes:
            break
        with open(path, "rb") as f:
            data = f.read()
        digest.update(data)
        used += len(data)
        splits["val" if i % val_every == val_every - 1 else "train"].append(data)
    if not splits["val"] or not splits["train"]:
        raise ValueError(f"max_bytes: {max_bytes} leaves a split empty; read {used} bytes from {len(files)} files")
    streams = {k: _stream(docs, tok.EOT) for k, docs in splits.items()}
    info = dict(source="python-stdlib", root=root or sysconfig.get_paths()["stdlib"],
                python=sys.version.split()[0], files=sum(len(d) for d in splits.values()), bytes=used,
                sha256=digest.hexdigest()[:16], train_tokens=len(streams["train"]), val_tokens=len(streams["val"]))
    return TextCorpus(train=streams["train"], val=streams["val"], info=info)


def _stream(docs: list[bytes], eot: int) -> torch.Tensor:
    """Documents as one int64 token stream, each followed by ``eot``."""
    parts = []
    for data in docs:
        parts.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).long())
        parts.append(torch.tensor([eot]))
    return torch.cat(parts)
