"""Tokenizers: train a byte-level BPE, or load any Hugging Face ``tokenizer.json``.

We wrap the ``tokenizers`` library rather than re-implementing BPE. The wrapper adds what the data path needs: the
ids of the three special tokens (pad, bos, eos), a stable content hash (so a dataset and a model can tell whether
they were made with the same tokenizer), and the smallest integer dtype that holds every id.

A tokenizer we train has a byte-level alphabet (so every UTF-8 string encodes, and decodes back exactly) and its
special tokens at the first ids::

    0 <|pad|>    1 <|bos|>    2 <|eos|>

A loaded tokenizer keeps its own ids. It comes from a ``tokenizer.json`` or a Hugging Face model directory holding
one; the ``tokenizer_config.json`` and ``special_tokens_map.json`` beside it name its special tokens (bos, eos, pad,
as transformers reads them), else they are found by the usual names (``<eos>``, ``</s>``, ``<|endoftext|>`` ...),
unless given explicitly. Whether a text starts with bos is the ``tokenizer.json``'s post-processor's to say
(``prefix_ids``), as it is for transformers.

A ``tokenizer.json`` is a program of sorts (regular expressions, normalizers, decoders), and the library can fail on
a text: a Split pattern such as ``^(a+)+$`` makes Oniguruma give up on ``"a" * 40 + "!"`` with a Rust panic, which
reaches Python as ``pyo3_runtime.PanicException``, a ``BaseException`` that ``except Exception`` lets through.
Every encode and decode of the wrapper turns any failure of the library into a ``TokenizerFailure`` (a
``ConfigError``, exit 2) naming the file and the fix; a server answers that request alone with a 400.

A tokenizer is checked against the model it serves (``check_model``): one with ids past the model's vocabulary is
refused (those ids would leave the embedding), as is one without the model's eos id; one that covers much less of
the vocabulary than the model has gets a warning. Ids the tokenizer does not have decode visibly, as
``<unk:ID>`` (the library drops them: a model on a 20-entry tokenizer generated empty text).
"""

from __future__ import annotations

import hashlib
import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from zaya.core.errors import ConfigError
from zaya.core.fsutil import MAX_JSON_BYTES, atomic_write_bytes, loads_json, read_regular

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
VOCAB_MULTIPLE = 64

# Names under which common tokenizers (GPT-2, Llama, Gemma, Mistral, ...) spell their special tokens.
_CANDIDATES = {
    "eos": (EOS, "<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "[SEP]"),
    "bos": (BOS, "<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]"),
    "pad": (PAD, "<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>"),
}


TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
SPECIAL_TOKENS_MAP, CHAT_TEMPLATE = "special_tokens_map.json", "chat_template.jinja"
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE)
"""The files of a Hugging Face tokenizer directory that travel with a tokenizer (into a prepared dataset, a run, an
export): the vocabulary and pipeline, the special tokens and BOS handling, and the chat template."""


def copy_tokenizer_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy those of ``TOKENIZER_FILES`` present in ``src_dir`` into ``dst_dir`` (each written atomically) and
    return the names copied. Each must be a regular file of at most ``MAX_JSON_BYTES`` (Gemma3's tokenizer.json is
    33 MB): a FIFO or device in a file's place is refused, not read forever."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    copied = []
    for name in TOKENIZER_FILES:
        src = src_dir / name
        if not src.exists() and not src.is_symlink():
            continue
        try:
            data = read_regular(src, MAX_JSON_BYTES)
        except OSError as exc:
            raise TokenizerError(f"{src}: cannot copy this tokenizer file ({exc.strerror or exc}); replace it with "
                                 "the file from the model's tokenizer directory") from None
        atomic_write_bytes(dst_dir / name, data)
        copied.append(name)
    return copied


MAX_PIPELINE_TEXT = 1024
"""The longest literal a tokenizer's normalizer, pre-tokenizer, post-processor or decoder may hold (real ones hold a
few characters, a regular expression a few hundred): a normalizer that prepends 1 MB to every text made every
encode take minutes."""


def _pipeline_problem(spec: object) -> str | None:
    """Why the text-transforming parts of a tokenizer.json (everything but its vocabulary and merges) are not a
    tokenizer's, or None: a literal longer than ``MAX_PIPELINE_TEXT`` characters."""
    if not isinstance(spec, dict):
        return None
    pending = [(key, spec.get(key)) for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder")]
    while pending:
        where, value = pending.pop()
        if isinstance(value, str) and len(value) > MAX_PIPELINE_TEXT:
            return (f"its {where} holds a text of {len(value):,} characters (a tokenizer's hold at most "
                    f"{MAX_PIPELINE_TEXT:,})")
        if isinstance(value, dict):
            pending += [(f"{where}.{k}", v) for k, v in value.items()]
        elif isinstance(value, list):
            pending += [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    return None


class TokenizerError(ConfigError):
    """A tokenizer file that cannot be used, or a request it cannot serve."""


class TokenizerFailure(TokenizerError):
    """The tokenizer library failed on one text or list of ids (a Rust panic, a regex that gave up): the tokenizer
    file is at fault, and another text may work."""


UNKNOWN = "<unk:{}>"
"""How ``decode`` renders an id the tokenizer does not have."""
COVERAGE_WARNING = 7 / 8
"""``check_model`` warns when the tokenizer has fewer entries than this share of the model's vocabulary (models pad
their vocabulary a little: ZAYA1 has 262,272 rows for Gemma3's 262,144 tokens plus a few special ones)."""


def round_up(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    bos: int
    eos: int


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special ids and content hash the data path relies on."""

    def __init__(self, backend, special: SpecialIds, source: str = "<memory>", directory: Path | None = None):
        self.backend = backend
        self.directory = directory
        """The Hugging Face tokenizer directory it was loaded from (its ``TOKENIZER_FILES`` travel with it)."""
        # Text that happens to spell a special token ("<|eos|>" in a document about tokenizers) is encoded as
        # ordinary text: only the data pipeline itself places eos ids, at document boundaries.
        backend.encode_special_tokens = True
        self.special = special
        self.source = source
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        ids = backend.get_vocab(with_added_tokens=True).values()
        # Ids of added tokens can exceed the base vocabulary; the dtype must hold the largest id.
        self.max_id = max(self.vocab_size - 1, *ids)
        self._known = bytearray(self.max_id + 1)
        """1 at every id the tokenizer has (a vocabulary may have holes)."""
        for i in ids:
            self._known[i] = 1
        canonical = json.dumps(loads_json(backend.to_str()), sort_keys=True, separators=(",", ":"))
        self.sha256 = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
        self._specials_backend = None
        self._specials_lock = threading.Lock()
        self._prefix: list[int] | None = None

    # --- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path, pad: str | None = None, bos: str | None = None,
                  eos: str | None = None) -> "Tokenizer":
        """Load a ``tokenizer.json``, or the one of a Hugging Face model directory; special tokens as given, else as
        the configuration files beside it name them, else found by name (``eos`` is required)."""
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        if path.is_dir():
            if not (path / TOKENIZER_JSON).is_file():
                raise TokenizerError(f"{path}: a directory without a {TOKENIZER_JSON} (expected a Hugging Face "
                                     "model or tokenizer directory, or a tokenizer.json)")
            path = path / TOKENIZER_JSON
        if not path.is_file():
            raise TokenizerError(f"{path}: tokenizer file not found (expected a Hugging Face tokenizer.json)")
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception with a serde message
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({exc})") from exc
        problem = _pipeline_problem(loads_json(backend.to_str()))
        if problem:
            raise TokenizerError(f"{path}: {problem}; use the tokenizer the model was trained with")
        named = _configured_special(path.parent)
        given = {"pad": pad, "bos": bos, "eos": eos}
        special = _find_special(backend, path, **{role: given[role] or named.get(role) for role in given})
        return cls(backend, special, source=str(path), directory=path.parent)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
              show_progress: bool = False) -> "Tokenizer":
        """Train a byte-level BPE with ``vocab_size`` entries (specials included) on ``texts``.

        ``vocab_size`` must be a multiple of 64 (it becomes the model's embedding size, and GEMMs tile in 64s). A
        corpus too small to learn that many merges yields fewer; the dataset manifest records the true size.
        """
        from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

        if vocab_size % VOCAB_MULTIPLE or vocab_size < 320:
            raise TokenizerError(f"vocab size {vocab_size}: must be a multiple of {VOCAB_MULTIPLE} and at least 320 "
                                 f"(256 byte symbols + special tokens + merges); e.g. {max(320, round_up(vocab_size))}")
        backend = Backend(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress)
        backend.train_from_iterator(texts, trainer=trainer)
        return cls(backend, SpecialIds(pad=0, bos=1, eos=2), source=f"trained byte-level BPE ({vocab_size})")

    # --- use -----------------------------------------------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype:
        """uint16 when every id fits, else uint32: half the disk and page cache for vocabularies up to 65,536."""
        return np.dtype(np.uint16) if self.max_id < 2**16 else np.dtype(np.uint32)

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary rounded up to a multiple of 64: what a model trained on this tokenizer should use."""
        return round_up(self.max_id + 1)

    @property
    def prefix_ids(self) -> list[int]:
        """The ids the tokenizer's post-processor puts before a text: ``[bos]`` for Gemma's and Llama's, ``[]`` for
        the byte-level BPE zaya trains. Every prepared document and every prompt starts with them, as
        transformers' ``tokenizer(text)`` starts."""
        if self._prefix is None:
            with self._library("a probe text"):
                plain = self.backend.encode("a", add_special_tokens=False).ids
                full = self.backend.encode("a", add_special_tokens=True).ids
            at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
            self._prefix = list(full[:at])
        return list(self._prefix)

    def with_prefix(self, ids: list[int]) -> list[int]:
        """``ids`` starting with ``prefix_ids`` exactly once: a chat template that writes ``{{ bos_token }}`` itself
        (Gemma's) gets no second one."""
        prefix = self.prefix_ids
        return list(ids) if ids[:len(prefix)] == prefix else prefix + list(ids)

    def encode_offsets(self, text: str, special_tokens: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` (no special tokens added) and each one's ``(start, end)`` characters in it;
        ``special_tokens`` as for ``encode_fast``."""
        backend = self._specials() if special_tokens else self.backend
        with self._library("this text"):
            encoding = backend.encode(text, add_special_tokens=False)
            return encoding.ids, encoding.offsets

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added."""
        with self._library("this text"):
            return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        with self._library("these texts"):
            return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode_fast(self, text: str, special_tokens: bool = False) -> list[int]:
        """``encode(text)`` through the library's ``encode_batch_fast``, which releases the GIL while it runs and
        keeps no offsets (``encode`` held the GIL 12 s and took 1 GB for a 4 MB prompt): what a server calls.
        ``special_tokens``: text that spells a special token is that token (a chat template's output, where
        ``<|eos|>`` means the token) rather than ordinary text."""
        backend = self._specials() if special_tokens else self.backend
        with self._library("this text"):
            return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; an id the tokenizer does not have is rendered as ``<unk:ID>`` (not dropped)."""
        ids = [int(i) for i in ids]
        known, size = self._known, len(self._known)
        with self._library("these token ids"):
            if all(0 <= i < size and known[i] for i in ids):
                return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
            pieces, run = [], []
            for i in ids + [None]:
                if i is not None and 0 <= i < size and known[i]:
                    run.append(i)
                    continue
                if run:
                    pieces.append(self.backend.decode(run, skip_special_tokens=skip_special_tokens))
                    run = []
                if i is not None:
                    pieces.append(UNKNOWN.format(i))
            return "".join(pieces)

    def token_text(self, token: int) -> str | None:
        """The vocabulary's spelling of ``token`` (``id_to_token``), None for an id it does not have."""
        return self.backend.id_to_token(token) if 0 <= token < len(self._known) and self._known[token] else None

    def check_model(self, vocab_size: int, eos_token_id: int, model: str) -> str | None:
        """Check this tokenizer against a model with ``vocab_size`` embedding rows and ``eos_token_id`` (``model``
        names it): ``TokenizerError`` when an id of the tokenizer is past the model's vocabulary, or the model's
        eos is not a token of the tokenizer; a warning (returned) when the tokenizer covers less than
        ``COVERAGE_WARNING`` of the model's vocabulary, else None."""
        if self.max_id >= vocab_size:
            raise TokenizerError(
                f"the tokenizer {self.source} has ids up to {self.max_id:,} ({self.vocab_size:,} entries) but the "
                f"model {model} has a vocabulary of {vocab_size:,}: its ids past {vocab_size - 1:,} would leave the "
                "embedding; use the tokenizer the model was trained with (--tokenizer FILE)")
        if self.token_text(eos_token_id) is None:
            raise TokenizerError(
                f"the model {model} ends a document with token id {eos_token_id:,}, which the tokenizer "
                f"{self.source} ({self.vocab_size:,} entries) does not have; use the tokenizer the model was "
                "trained with (--tokenizer FILE)")
        if self.vocab_size < COVERAGE_WARNING * vocab_size:
            return (f"the tokenizer {self.source} has {self.vocab_size:,} entries, the model {model} a vocabulary "
                    f"of {vocab_size:,}: ids the tokenizer does not have print as {UNKNOWN.format('ID')}; is it the "
                    "tokenizer the model was trained with?")
        return None

    def _specials(self):
        """A copy of the backend that encodes text spelling a special token as that token (the shared one encodes
        it as plain text and is used from other threads at the same time, so its flag is never switched)."""
        with self._specials_lock:
            if self._specials_backend is None:
                from tokenizers import Tokenizer as Backend

                backend = Backend.from_str(self.backend.to_str())
                backend.encode_special_tokens = False
                self._specials_backend = backend
            return self._specials_backend

    @contextmanager
    def _library(self, what: str):
        """Any failure of the tokenizer library inside the block is a ``TokenizerFailure`` naming the file."""
        try:
            yield
        except (KeyboardInterrupt, SystemExit, MemoryError):
            raise
        except BaseException as exc:  # noqa: BLE001 - a Rust panic is a pyo3 PanicException, a BaseException
            reason = " ".join(str(exc).split())[:300]
            raise TokenizerFailure(f"the tokenizer {self.source} failed on {what} ({type(exc).__name__}: {reason}); "
                                   "fix or replace the tokenizer") from None

    def save(self, path: str | Path) -> None:
        from zaya.core.fsutil import atomic_write_text

        atomic_write_text(path, self.backend.to_str(pretty=True))

    def save_files(self, directory: str | Path) -> list[str]:
        """Write the tokenizer into ``directory``: the ``TOKENIZER_FILES`` of the directory it was loaded from, as
        they are, and its ``tokenizer.json`` when that did not come along (a trained tokenizer, or a file under
        another name). The names written."""
        directory = Path(directory)
        written = [] if self.directory is None or Path(self.source).name != TOKENIZER_JSON else \
            copy_tokenizer_files(self.directory, directory)
        if TOKENIZER_JSON not in written:
            self.save(directory / TOKENIZER_JSON)
            written.insert(0, TOKENIZER_JSON)
        return written

    def __repr__(self) -> str:
        return (f"Tokenizer({self.source}, vocab={self.vocab_size}, pad={self.special.pad}, bos={self.special.bos}, "
                f"eos={self.special.eos})")


def read_tokenizer_config(path: Path) -> dict:
    """A tokenizer_config.json or special_tokens_map.json as a dict ({} when there is none); TokenizerError naming
    it when it is not a readable JSON object."""
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        config = loads_json(read_regular(path, MAX_JSON_BYTES))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: cannot be read as JSON ({exc}); fix or remove it") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: holds a {type(config).__name__}, not a JSON object; fix or remove it")
    return config


def special_token_names(config: dict) -> dict[str, str]:
    """The ``*_token`` entries of a tokenizer config (a name, or an object with its ``content``, as transformers
    writes them): ``{"bos_token": "<bos>", ...}``."""
    return {k: v if isinstance(v, str) else v["content"] for k, v in config.items()
            if k.endswith("_token") and (isinstance(v, str) or isinstance(v, dict) and isinstance(v.get("content"),
                                                                                                  str))}


def _configured_special(directory: Path) -> dict[str, str]:
    """Role -> token name as the directory's tokenizer_config.json, else its special_tokens_map.json, names it."""
    names = {**special_token_names(read_tokenizer_config(directory / SPECIAL_TOKENS_MAP)),
             **special_token_names(read_tokenizer_config(directory / TOKENIZER_CONFIG))}
    return {role: names[f"{role}_token"] for role in ("pad", "bos", "eos") if f"{role}_token" in names}


def _find_special(backend, path: Path, **given: str | None) -> SpecialIds:
    vocab = backend.get_vocab(with_added_tokens=True)
    ids: dict[str, int] = {}
    for role in ("pad", "bos", "eos"):
        name = given.get(role)
        if name is not None:
            if name not in vocab:
                raise TokenizerError(f"{path}: the {role} token {name!r} (given, or named in the tokenizer_config.json or "
                                     f"special_tokens_map.json beside it) is not in the vocabulary; name one it has "
                                     f"with --{role}-token")
            ids[role] = vocab[name]
            continue
        found = next((vocab[c] for c in _CANDIDATES[role] if c in vocab), None)
        if found is None and role == "eos":
            raise TokenizerError(
                f"{path}: no end-of-document token found (looked for {', '.join(_CANDIDATES['eos'])}); "
                "name it with --eos-token")
        ids[role] = found if found is not None else -1
    # Documents are separated by eos; a missing bos or pad falls back to eos (they are only used as markers).
    eos = ids["eos"]
    return SpecialIds(pad=ids["pad"] if ids["pad"] >= 0 else eos, bos=ids["bos"] if ids["bos"] >= 0 else eos, eos=eos)
