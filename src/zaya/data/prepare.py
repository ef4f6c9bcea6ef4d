"""``zaya data prepare``: text in, a prepared dataset (tokenizer + bundles + manifest) out.

Every document starts with the tokenizer's ``prefix_ids`` (Gemma's <bos>; nothing for the BPE zaya trains) and ends
with its eos, as transformers' tokenizer and zaya's loader expect. In the chat format (``--format chat``) each
conversation is rendered with the tokenizer's chat template or zaya's default (``zaya.data.chat_template``) and its
bundles carry a loss mask: 1 on the assistant's tokens (and on the eos after a conversation that ends with a reply,
so the model learns to stop), 0 elsewhere.

The pipeline streams: the main process reads and decodes inputs (``zaya.data.sources``) and groups pieces into
batches of about ``BATCH_BYTES`` of text; ``workers`` processes tokenize batches (a bounded number in flight, results
taken in order, so the output is identical for any worker count); the main process routes each document to the
train or validation split and appends it to the split's current bundle, rolling to a new bundle at ``bundle_mb``.
Memory therefore stays bounded by the batches in flight, whatever the input size.

Everything is written into a temporary sibling of the output directory that is renamed into place at the end, so
an interrupted prepare never leaves a manifest that points at a partial bundle; the next prepare of the same output
removes such a folder once its writer has provably ended, and reports it otherwise (``zaya.data.leftovers``).
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from zaya.data import leftovers
from zaya.data.bundle import (BUNDLE_SUFFIX, DATASET_FORMAT, DATASET_VERSION, MANIFEST, TOKENIZER, BundleWriter,
                              sha256_file)
from zaya.data.sources import InputError, InputStats, Piece, expand_inputs, iter_documents, iter_pieces
from zaya.data.tokenizer import Tokenizer
from zaya.core.errors import writing
from zaya.core.fsutil import atomic_directory, atomic_write_text

BATCH_BYTES = 1 << 20
SPLITS = ("train", "val")
FORMATS = ("text", "chat")


@dataclass
class PrepareOptions:
    """Options of ``zaya data prepare`` (each maps to the command-line flag of the same name)."""

    inputs: list[str]
    out: str
    tokenizer: str | None = None          # a tokenizer.json or a Hugging Face model directory; else one is trained
    format: str = "text"                  # "text" (documents) or "chat" (conversations with loss masks)
    vocab_size: int = 8192                # size of the trained BPE (multiple of 64)
    tokenizer_sample_mb: float = 512.0    # text used to train the tokenizer (the first MB of the inputs)
    bundle_mb: float = 1024.0             # bundle size at which a new bundle starts
    val_fraction: float = 0.01            # share of documents held out for validation
    seed: int = 0                         # seeds the train/validation split
    workers: int = 1                      # tokenizer processes
    strict: bool = False                  # invalid UTF-8 or bad JSON lines fail instead of being counted
    text_field: str = "text"              # the JSON Lines field or the Parquet / Arrow column that holds the text
    eos_token: str | None = None          # override the special tokens found in a loaded tokenizer
    bos_token: str | None = None
    pad_token: str | None = None
    force: bool = False                   # replace an existing output directory


@dataclass
class PrepareResult:
    out: Path
    manifest: dict[str, Any]
    seconds: float
    stats: InputStats = field(default_factory=InputStats)

    @property
    def mb_per_s(self) -> float:
        return self.stats.bytes / 1e6 / max(self.seconds, 1e-9)


# --- tokenizer workers ---------------------------------------------------------------------------------------------
_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer_json: str, special: tuple[int, int, int]) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer as Backend

    from zaya.data.tokenizer import SpecialIds

    _WORKER_TOKENIZER = Tokenizer(Backend.from_str(tokenizer_json), SpecialIds(*special))


def _encode(texts: list[str], targets: list | None, special_tokens: bool):
    """Tokenize a batch; return the ids concatenated (int64), each text's length, and for chat pieces (``targets``
    given) the loss mask concatenated (uint8, else None): arrays, which pickle cheaply."""
    from zaya.data.chat_template import conversation_ids

    tok = _WORKER_TOKENIZER
    if targets is None:
        encoded, masks = tok.encode_batch(texts), None
    else:
        encoded, masks = zip(*(conversation_ids(tok, t, spans, special_tokens) for t, spans in zip(texts, targets)))
    lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter((i for e in encoded for i in e), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths, None if masks is None else np.concatenate(masks)


class _SerialPool:
    """The in-process stand-in for a worker pool (``workers=1``): no pickling, no process start-up."""

    def __init__(self, tokenizer: Tokenizer):
        global _WORKER_TOKENIZER
        _WORKER_TOKENIZER = tokenizer

    def submit(self, *args):
        result = _encode(*args)
        return lambda: result

    def close(self):
        pass


class _ProcessPool:
    def __init__(self, tokenizer: Tokenizer, workers: int):
        import multiprocessing as mp

        # spawn, not fork: the tokenizers library's thread pool must not be forked mid-use.
        ctx = mp.get_context("spawn")
        s = tokenizer.special
        self._pool = ctx.Pool(workers, initializer=_init_worker,
                              initargs=(tokenizer.backend.to_str(), (s.pad, s.bos, s.eos)))

    def submit(self, *args):
        return self._pool.apply_async(_encode, args).get

    def close(self):
        self._pool.close()
        self._pool.join()


# --- progress ------------------------------------------------------------------------------------------------------
class _Progress:
    """A rich bar on a terminal; a plain line every few seconds otherwise."""

    def __init__(self, total_bytes: int | None, log: Callable[[str], None]):
        self.log = log
        self.start = time.perf_counter()
        self.last = self.start
        self.bar = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("prepare"), BarColumn(), TextColumn("{task.fields[info]}"),
                                TimeRemainingColumn(), transient=True)
            self.task = self.bar.add_task("prepare", total=total_bytes, info="")
            self.bar.start()

    def update(self, stats: InputStats, tokens: int) -> None:
        now = time.perf_counter()
        mb_s = stats.bytes / 1e6 / max(now - self.start, 1e-9)
        info = f"{stats.documents:,} docs  {tokens:,} tokens  {mb_s:,.1f} MB/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=stats.bytes, info=info)
        elif now - self.last >= 5.0:
            self.log(f"prepare: {info}")
            self.last = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# --- the split writer ----------------------------------------------------------------------------------------------
class _SplitWriter:
    """Appends documents of one split to its bundles, rolling to a new bundle at the size limit."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, bundle_bytes: int, eos: int, masked: bool):
        self.directory, self.split, self.dtype, self.masked = directory, split, dtype, masked
        self.bundle_bytes, self.eos = bundle_bytes, np.array([eos])
        self.entries: list[dict[str, Any]] = []
        self.writer: BundleWriter | None = None

    def write(self, ids: np.ndarray, end_of_document: bool, mask: np.ndarray | None = None) -> None:
        if self.writer is None:
            name = f"{self.split}-{len(self.entries):05d}{BUNDLE_SUFFIX}"
            self.writer = BundleWriter(self.directory / name, self.dtype, self.masked)
        self.writer.write(ids, False, mask)
        if end_of_document:  # the eos is a target where the document's last token is (a reply's end)
            self.writer.write(self.eos, True, None if mask is None else mask[-1:])
            if self.writer.bytes_written >= self.bundle_bytes:
                self.entries.append(self.writer.close())
                self.writer = None

    def close(self) -> dict[str, Any]:
        if self.writer is not None:
            self.entries.append(self.writer.close())
            self.writer = None
        return {"tokens": sum(e["tokens"] for e in self.entries),
                "documents": sum(e["documents"] for e in self.entries), "bundles": self.entries}


def _batches(pieces, batch_bytes: int):
    batch: list[Piece] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece.text)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _load_or_train_tokenizer(opts: PrepareOptions, files, log) -> Tokenizer:
    if opts.tokenizer:
        return Tokenizer.from_file(opts.tokenizer, pad=opts.pad_token, bos=opts.bos_token, eos=opts.eos_token)
    if opts.format == "chat":
        raise InputError("--format chat needs --tokenizer: chat data is for fine-tuning a model, and is tokenized "
                         "with its tokenizer (its Hugging Face directory, or the tokenizer.json of its run or export)")
    log(f"training a {opts.vocab_size}-entry byte-level BPE on up to {opts.tokenizer_sample_mb:g} MB of the input")
    stats = InputStats()
    docs = iter_documents(files, stats, strict=opts.strict, text_field=opts.text_field,
                          max_bytes=int(opts.tokenizer_sample_mb * 1e6))
    tokenizer = Tokenizer.train(docs, opts.vocab_size)
    if stats.documents == 0 and stats.bytes == 0:
        raise InputError(f"no text in the inputs ({', '.join(map(str, opts.inputs))})")
    return tokenizer


def prepare(opts: PrepareOptions, log: Callable[[str], None] = print,
            elsewhere: str = "choose an --out on a disk with room") -> PrepareResult:
    """Run the whole pipeline; see the module docstring. Returns the manifest and throughput. A full disk is a
    DiskFullError (exit 5) naming the output's directory, its free space and, beside freeing space, ``elsewhere``."""
    with writing(Path(opts.out).parent, f"writing the dataset {opts.out}", elsewhere):
        return _prepare(opts, log)


def _prepare(opts: PrepareOptions, log: Callable[[str], None]) -> PrepareResult:
    if not 0 <= opts.val_fraction < 1:
        raise InputError(f"--val-fraction {opts.val_fraction}: must be in [0, 1)")
    if opts.bundle_mb <= 0:
        raise InputError(f"--bundle-mb {opts.bundle_mb}: must be positive")
    if opts.workers < 1:
        raise InputError(f"--workers {opts.workers}: must be at least 1")
    if opts.format not in FORMATS:
        raise InputError(f"--format {opts.format}: must be one of {', '.join(FORMATS)}")
    out = Path(opts.out)
    leftovers.sweep(out, log)
    if out.exists() and not opts.force:
        raise FileExistsError(f"{out} already exists; choose another --out or pass --force to replace it")
    files = expand_inputs(opts.inputs)
    total_bytes = sum(f.stat().st_size for f in files if isinstance(f, Path) and not f.name.endswith(".gz")) or None

    start = time.perf_counter()
    tokenizer = _load_or_train_tokenizer(opts, files, log)
    eos, prefix = tokenizer.special.eos, np.array(tokenizer.prefix_ids, dtype=np.int64)
    chat = None
    if opts.format == "chat":
        from zaya.data.chat_template import ConversationRenderer

        chat = ConversationRenderer(tokenizer)
        log(f"chat format: conversations rendered with {chat.where}; only the assistant's tokens are targets")
    stats = InputStats()
    rng = random.Random(opts.seed)
    bundle_bytes = int(opts.bundle_mb * 1e6)
    with atomic_directory(out, overwrite=opts.force) as tmp:
        leftovers.claim(tmp)
        writers = {s: _SplitWriter(tmp, s, tokenizer.dtype, bundle_bytes, eos, chat is not None) for s in SPLITS}
        pool = _SerialPool(tokenizer) if opts.workers == 1 else _ProcessPool(tokenizer, opts.workers)
        progress = _Progress(total_bytes, log)
        in_flight: collections.deque = collections.deque()
        split_of_open_document: str | None = None
        tokens = 0

        def drain_one() -> None:
            nonlocal split_of_open_document, tokens
            batch, result = in_flight.popleft()
            flat, lengths, masks = result()
            starts = np.concatenate([[0], np.cumsum(lengths)])
            for piece, a, b in zip(batch, starts[:-1], starts[1:]):
                if split_of_open_document is None:
                    split_of_open_document = "val" if rng.random() < opts.val_fraction else "train"
                    if chat is None and prefix.size:  # a conversation's ids start with the prefix already
                        writers[split_of_open_document].write(prefix, False)
                        tokens += prefix.size
                writers[split_of_open_document].write(flat[a:b], piece.end_of_document,
                                                      None if masks is None else masks[a:b])
                tokens += int(b - a) + int(piece.end_of_document)
                if piece.end_of_document:
                    split_of_open_document = None
            progress.update(stats, tokens)

        try:
            for batch in _batches(iter_pieces(files, stats, opts.strict, opts.text_field, chat), BATCH_BYTES):
                targets = None if chat is None else [p.targets for p in batch]
                in_flight.append((batch, pool.submit([p.text for p in batch], targets,
                                                     chat is not None and chat.special_tokens)))
                if len(in_flight) > 2 * opts.workers:
                    drain_one()
            while in_flight:
                drain_one()
        finally:
            pool.close()
            progress.close()
            if chat is not None:
                chat.close()
        splits = {s: w.close() for s, w in writers.items()}
        if splits["train"]["tokens"] == 0:
            raise InputError(f"no text in the inputs ({', '.join(map(str, opts.inputs))}): "
                             f"{stats.no_text_reason(opts.text_field)}")
        if opts.val_fraction > 0 and splits["val"]["documents"] == 0:
            log(f"warning: --val-fraction {opts.val_fraction} held out no document ({stats.documents} in all)")
        files_written = tokenizer.save_files(tmp)
        manifest = _manifest(opts, tokenizer, splits, stats, sha256_file(tmp / TOKENIZER), files_written)
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        leftovers.release(tmp)
    seconds = time.perf_counter() - start
    if stats.decode_errors:
        log(f"warning: {stats.decode_errors} invalid UTF-8 sequence(s) or unpaired surrogate escape(s) replaced by "
            "U+FFFD (use --strict to fail)")
    if stats.bad_lines:
        log(f"warning: {stats.bad_lines} record(s) skipped (use --strict to fail)")
    for message in stats.warnings[:5]:
        log(f"  {message}")
    return PrepareResult(out, manifest, seconds, stats)


def _manifest(opts, tokenizer: Tokenizer, splits, stats: InputStats, tokenizer_sha: str,
              tokenizer_files: list[str]) -> dict[str, Any]:
    from zaya import __version__

    s = tokenizer.special
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    names = {v: k for k, v in vocab.items()}
    options = asdict(opts)
    options.pop("out")
    return {
        "format": DATASET_FORMAT,
        "format_version": DATASET_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "zaya_version": __version__,
        "dtype": tokenizer.dtype.name,
        "loss_mask": opts.format == "chat",
        "tokenizer": {
            "file": TOKENIZER, "file_sha256": tokenizer_sha, "sha256": tokenizer.sha256, "source": tokenizer.source,
            "vocab_size": tokenizer.max_id + 1, "padded_vocab_size": tokenizer.padded_vocab_size,
            "pad_id": s.pad, "bos_id": s.bos, "eos_id": s.eos,
            "pad_token": names.get(s.pad), "bos_token": names.get(s.bos), "eos_token": names.get(s.eos),
            "prefix_ids": tokenizer.prefix_ids, "files": tokenizer_files,
        },
        "splits": splits,
        "inputs": [str(i) for i in opts.inputs],
        "options": options,
        "stats": {"files": stats.files, "bytes": stats.bytes, "documents": stats.documents,
                  "decode_errors": stats.decode_errors, "bad_lines": stats.bad_lines,
                  "empty_documents": stats.empty_documents},
    }
