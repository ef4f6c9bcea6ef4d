"""Helpers shared by test_data_prepare.py and test_data_loader.py: tiny hand-made datasets and references.

A hand-made dataset is written the same way `zaya data prepare` writes one (``BundleWriter`` + tokenizer.json +
manifest.json), but from token ids chosen by the test, so the loader tests can use documents of consecutive
integers: every token except eos is distinct, so a window of ``seq_len + 1`` tokens identifies itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

from zaya.data.bundle import (DATASET_FORMAT, DATASET_VERSION, MANIFEST, TOKENIZER, BundleWriter, PreparedDataset,
                              sha256_file)

EOS = 2


def tiny_tokenizer():
    """A three-entry word-level tokenizer (pad 0, bos 1, eos 2): only its file and hash matter to the loader."""
    from tokenizers import Tokenizer as Backend, models

    from zaya.data.tokenizer import SpecialIds, Tokenizer

    backend = Backend(models.WordLevel({"<|pad|>": 0, "<|bos|>": 1, "<|eos|>": 2}, unk_token="<|pad|>"))
    return Tokenizer(backend, SpecialIds(pad=0, bos=1, eos=EOS), source="test word-level")


def consecutive_documents(lengths: Sequence[int], start: int = 3) -> list[np.ndarray]:
    """Documents of consecutive integers (no eos), the first starting at ``start``."""
    docs, nxt = [], start
    for n in lengths:
        docs.append(np.arange(nxt, nxt + n, dtype=np.int64))
        nxt += n
    return docs


def write_dataset(directory: Path, splits: dict[str, list[list[np.ndarray]]], dtype=np.uint16,
                  vocab_size: int = 65536) -> PreparedDataset:
    """Write a prepared dataset by hand. ``splits``: name -> bundles, each a list of documents (ids, no eos)."""
    directory = Path(directory)
    directory.mkdir(parents=True)
    manifest_splits = {}
    for name, bundles in splits.items():
        entries = []
        for i, docs in enumerate(bundles):
            writer = BundleWriter(directory / f"{name}-{i:05d}.zb", dtype)
            for doc in docs:
                writer.write(np.asarray(doc), False)
                writer.write(np.array([EOS]), True)
            entries.append(writer.close())
        manifest_splits[name] = {"tokens": sum(e["tokens"] for e in entries),
                                 "documents": sum(e["documents"] for e in entries), "bundles": entries}
    tok = tiny_tokenizer()
    tok.save(directory / TOKENIZER)
    manifest = {
        "format": DATASET_FORMAT, "format_version": DATASET_VERSION, "dtype": np.dtype(dtype).name,
        "tokenizer": {"file": TOKENIZER, "file_sha256": sha256_file(directory / TOKENIZER), "sha256": tok.sha256,
                      "source": tok.source, "vocab_size": vocab_size, "padded_vocab_size": vocab_size,
                      "pad_id": 0, "bos_id": 1, "eos_id": EOS,
                      "pad_token": "<|pad|>", "bos_token": "<|bos|>", "eos_token": "<|eos|>"},
        "splits": manifest_splits,
        "stats": {},
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return PreparedDataset(directory)


def bundle_windows(tokens: np.ndarray, seq_len: int) -> list[tuple[int, ...]]:
    """Reference cut of one bundle's token stream: windows of seq_len + 1 tokens starting every seq_len tokens,
    never running past the end (so a final partial window is dropped)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    out = []
    start = 0
    while start + seq_len + 1 <= len(tokens):
        out.append(tuple(tokens[start:start + seq_len + 1].tolist()))
        start += seq_len
    return out


def split_windows(dataset: PreparedDataset, split: str, seq_len: int) -> list[tuple[int, ...]]:
    """Every window of a split, bundle by bundle, in stored order (the unshuffled reference)."""
    return [w for b in dataset.split(split).bundles for w in bundle_windows(b.tokens, seq_len)]
