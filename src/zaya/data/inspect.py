"""``zaya data inspect``: what a prepared dataset holds, and (with verify) whether every byte is intact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from zaya.data.bundle import PreparedDataset


def length_histogram(lengths: np.ndarray) -> list[dict[str, int]]:
    """Document lengths in power-of-two buckets: [{"min": 1, "max": 1, "documents": n}, {"min": 2, "max": 3}, ...]."""
    if lengths.size == 0:
        return []
    exponents = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    counts = np.bincount(exponents)
    return [{"min": 1 << e, "max": (2 << e) - 1, "documents": int(c)} for e, c in enumerate(counts) if c]


def summarize(directory: str | Path, verify: bool = False, sample_tokens: int = 64) -> dict[str, Any]:
    """Tokens, documents and a length histogram per split, the tokenizer, and a decoded sample."""
    dataset = PreparedDataset(directory)
    checked = dataset.verify() if verify else []
    manifest = dataset.manifest
    splits: dict[str, Any] = {}
    for name, split in dataset.splits.items():
        lengths = np.concatenate([np.diff(np.asarray(b.index, dtype=np.int64)) for b in split.bundles]) \
            if split.bundles else np.zeros(0, np.int64)
        splits[name] = {
            "tokens": split.num_tokens, "documents": split.num_documents, "bundles": len(split.bundles),
            "bytes": sum(b["bytes"] for b in manifest["splits"][name]["bundles"]),
            "mean_document_tokens": float(lengths.mean()) if lengths.size else 0.0,
            "max_document_tokens": int(lengths.max()) if lengths.size else 0,
            "length_histogram": length_histogram(lengths),
        }
    sample = ""
    train = dataset.splits.get("train")
    if train is not None and train.num_documents:
        sample = dataset.tokenizer().decode(train.bundles[0].document(0)[:sample_tokens])
    return {"directory": str(dataset.directory), "format_version": manifest["format_version"],
            "dtype": manifest["dtype"], "tokenizer": manifest["tokenizer"], "splits": splits,
            "stats": manifest.get("stats", {}), "sample": sample, "verified": checked}
