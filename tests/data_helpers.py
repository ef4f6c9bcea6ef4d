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
                  vocab_size: int = 65536, masks: dict[str, list[list[np.ndarray]]] | None = None) -> PreparedDataset:
    """Write a prepared dataset by hand. ``splits``: name -> bundles, each a list of documents (ids, no eos);
    ``masks``: the same shape, each document's loss mask (its eos takes the mask of its last token)."""
    directory = Path(directory)
    directory.mkdir(parents=True)
    manifest_splits = {}
    for name, bundles in splits.items():
        entries = []
        for i, docs in enumerate(bundles):
            writer = BundleWriter(directory / f"{name}-{i:05d}.zb", dtype, masked=masks is not None)
            for j, doc in enumerate(docs):
                mask = None if masks is None else np.asarray(masks[name][i][j])
                writer.write(np.asarray(doc), False, mask)
                writer.write(np.array([EOS]), True, None if mask is None else mask[-1:])
            entries.append(writer.close())
        manifest_splits[name] = {"tokens": sum(e["tokens"] for e in entries),
                                 "documents": sum(e["documents"] for e in entries), "bundles": entries}
    tok = tiny_tokenizer()
    tok.save(directory / TOKENIZER)
    manifest = {
        "format": DATASET_FORMAT, "format_version": DATASET_VERSION, "dtype": np.dtype(dtype).name,
        "loss_mask": masks is not None,
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


GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
"""Gemma3's chat template in its essentials: the template writes the <bos> and the turn markers itself."""


def gemma_like_tokenizer(directory: Path, vocab_size: int = 1024) -> Path:
    """A Hugging Face tokenizer directory of Gemma3's kind, built with the tokenizers library (no Gemma3 file can be
    had offline): SentencePiece-style BPE with byte fallback (<0xNN> tokens) trained on the built-in corpus, spaces
    replaced by "▁", <pad>=0 <eos>=1 <bos>=2 <unk>=3 <mask>=4, <start_of_turn> / <end_of_turn> as added special
    tokens, a post-processor putting <bos> first; and a tokenizer_config.json like Gemma3's (GemmaTokenizer,
    add_bos_token, the chat template). Returns the directory."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, normalizers, pre_tokenizers, \
        processors, trainers

    from zaya.data.corpus import load_corpus_text

    def pipeline(backend):
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        return backend

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    # Trained on words (the pipeline's Split sees no space once they are "▁", so a text is one word to a trainer)
    trained = Backend(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trained.train_from_iterator(load_corpus_text()[:200_000].splitlines(), trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials) - 256, special_tokens=["<unk>"], show_progress=False))
    spec = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(spec["vocab"], key=spec["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    backend = pipeline(Backend(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<start_of_turn>", "<end_of_turn>")])
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                           special_tokens=[("<bos>", 2)])
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "mask_token": "<mask>", "chat_template": GEMMA_CHAT_TEMPLATE}))
    return directory


def tokenizer_test_strings(n: int, seed: int = 0) -> list[str]:
    """``n`` strings that stress a tokenizer: ASCII words, accents, CJK, astral-plane characters, combining marks,
    runs of spaces, tabs and newlines, text spelling special tokens, and the empty string (the first)."""
    import random

    rng = random.Random(seed)
    pieces = ["the", " king", "ROMEO:", "héllo", "naïve", "Straße", "日本語", "한국어", "𝄞", "😀", "👩‍👩‍👧", "𐍈",
              "e\u0301", "a\u0308\u0323", "\u200b", "  ", "    ", "\t", "\n", "\n\n", " \n ", "\r\n", "<bos>",
              "<eos>", "<start_of_turn>", "<end_of_turn>user", "<pad>", "<0x41>", "▁", "<unk>", "0123", "!?",
              "\u00a0", "\ufeff", "\U0010fffd"]
    out = [""]
    while len(out) < n:
        k = rng.randint(1, 12)
        out.append("".join(rng.choice(pieces) if rng.random() < 0.7 else chr(rng.choice(
            [rng.randint(0x20, 0x7e), rng.randint(0xa0, 0x2fff), rng.randint(0x10000, 0x1faff)])) for _ in range(k)))
    return out
