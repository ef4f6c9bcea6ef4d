"""The bundled token-shard format: a few large files of token ids instead of millions of small ones.

A prepared dataset is a directory::

    manifest.json          what is here: format version, tokenizer, dtype, splits, bundles with sizes and sha256
    tokenizer.json         the tokenizer that made the ids
    train-00000.zb ...     bundles of the training split
    val-00000.zb ...       bundles of the validation split

A bundle (``.zb``) is one file, little-endian::

    offset 0    header, 64 bytes: magic b"ZAYABNDL", u32 format version, u32 bytes per token (2 or 4),
                u64 tokens, u64 documents, u64 byte offset of the token array, u64 byte offset of the index,
                u64 byte offset of the loss mask (0: none), 8 reserved zero bytes
    offset 64   tokens: every document's ids followed by the eos id, documents back to back
    (8-aligned) index: documents + 1 u64 token offsets; document i is tokens[index[i]:index[i+1]] (its eos last)
    (version 2) loss mask: one u8 per token, 1 where the token is a training target (chat data: the assistant's)

Version 1 bundles (no mask field, every token a target) are written for data without a mask and still read.

The full specification, with the manifest's fields, is in docs/formats.md. Readers memory-map both arrays, so
opening a bundle costs one ``open`` and no copying, and the OS page cache serves repeated epochs.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from zaya.core.errors import DataError
from zaya.core.fsutil import read_json

MAGIC = b"ZAYABNDL"
BUNDLE_VERSION = 2
"""The newest bundle format (2: with a loss mask); a bundle without one is written as version 1."""
HEADER = struct.Struct("<8sIIQQQQQ8x")
assert HEADER.size == 64
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
DATASET_FORMAT = "zaya-dataset"
DATASET_VERSION = 1
BUNDLE_SUFFIX = ".zb"
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


class DatasetError(DataError):
    """A prepared dataset that is missing, incomplete, corrupt or of an unknown format."""


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


def sha256_file(path: str | Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class BundleWriter:
    """Streams documents into one bundle file; memory stays bounded (the index is spooled to a side file)."""

    def __init__(self, path: str | Path, dtype: np.dtype, masked: bool = False):
        self.path = Path(path)
        self.masked = masked
        self.dtype = np.dtype(dtype).newbyteorder("<")
        if self.dtype.itemsize not in _DTYPES:
            raise ValueError(f"bundle dtype must be uint16 or uint32, not {dtype}")
        self._fh: BinaryIO = open(self.path, "wb")
        self._fh.write(b"\0" * HEADER.size)
        self._index_path = self.path.with_name(self.path.name + ".index-spool")
        self._index: BinaryIO = open(self._index_path, "wb")
        self._index.write(np.zeros(1, "<u8").tobytes())
        self._mask_path = self.path.with_name(self.path.name + ".mask-spool")
        self._mask: BinaryIO | None = open(self._mask_path, "wb") if masked else None
        self.tokens = 0
        self.documents = 0
        self._in_document = False

    @property
    def bytes_written(self) -> int:
        return HEADER.size + self.tokens * self.dtype.itemsize

    def write(self, ids: np.ndarray, end_of_document: bool, mask: np.ndarray | None = None) -> None:
        """Append ids of the current document; ``end_of_document`` closes it (the caller appends the eos id). A
        ``masked`` writer takes each id's loss mask (1: a target) too."""
        ids = np.asarray(ids)
        if self._mask is not None:
            mask = np.asarray(mask, dtype=np.uint8)
            if mask.shape != ids.shape:
                raise ValueError(f"{self.path}: a loss mask of {mask.size} for {ids.size} ids")
            self._mask.write(mask.tobytes())
        if ids.size:
            self._fh.write(ids.astype(self.dtype, copy=False).tobytes())
            self.tokens += int(ids.size)
            self._in_document = True
        if end_of_document and self._in_document:
            self._index.write(np.array([self.tokens], "<u8").tobytes())
            self.documents += 1
            self._in_document = False

    def close(self) -> dict[str, Any]:
        """Write the index and header, flush to disk, and return the manifest entry (sizes and sha256)."""
        if self._in_document:
            raise RuntimeError(f"{self.path}: closed in the middle of a document")
        self._index.close()
        token_end = HEADER.size + self.tokens * self.dtype.itemsize
        index_offset = _align8(token_end)
        self._fh.write(b"\0" * (index_offset - token_end))
        self._append(self._index_path)
        mask_offset = 0
        if self._mask is not None:
            self._mask.close()
            mask_offset = index_offset + (self.documents + 1) * 8
            self._append(self._mask_path)
        self._fh.seek(0)
        self._fh.write(HEADER.pack(MAGIC, BUNDLE_VERSION if self.masked else 1, self.dtype.itemsize, self.tokens,
                                   self.documents, HEADER.size, index_offset, mask_offset))
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        return {"file": self.path.name, "tokens": self.tokens, "documents": self.documents,
                "bytes": self.path.stat().st_size, "sha256": sha256_file(self.path)}

    def _append(self, spool_path: Path) -> None:
        with open(spool_path, "rb") as spool:
            while block := spool.read(8 << 20):
                self._fh.write(block)
        spool_path.unlink()

    def abort(self) -> None:
        for fh in (self._fh, self._index, self._mask):
            if fh is not None:
                fh.close()
        for path in (self._index_path, self._mask_path, self.path):
            path.unlink(missing_ok=True)


class Bundle:
    """One memory-mapped bundle: ``tokens`` (uint16/uint32), ``index`` (u64 document starts, plus the end) and
    ``mask`` (u8 per token, 1 for a target; None when every token is one)."""

    def __init__(self, path: str | Path, expect: dict[str, Any] | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise DatasetError(f"{self.path}: bundle file missing (the dataset directory is incomplete; "
                               "prepare it again)")
        size = self.path.stat().st_size
        if expect is not None and size != expect["bytes"]:
            raise DatasetError(f"{self.path}: {size:,} bytes on disk, the manifest says {expect['bytes']:,} "
                               "(truncated or replaced; prepare the dataset again)")
        with open(self.path, "rb") as fh:
            raw = fh.read(HEADER.size)
        if len(raw) < HEADER.size:
            raise DatasetError(f"{self.path}: shorter than a bundle header (truncated)")
        magic, version, width, tokens, documents, token_offset, index_offset, mask_offset = HEADER.unpack(raw)
        if magic != MAGIC:
            raise DatasetError(f"{self.path}: not a zaya bundle (bad magic {magic!r})")
        if version not in (1, BUNDLE_VERSION):
            raise DatasetError(f"{self.path}: bundle format version {version}; this zaya reads versions 1 to "
                               f"{BUNDLE_VERSION} (upgrade zaya or prepare the data again)")
        index_end = index_offset + (documents + 1) * 8
        if width not in _DTYPES or (mask_offset, size) not in ((0, index_end), (index_end, index_end + tokens)) \
                or (version == 1 and mask_offset):
            raise DatasetError(f"{self.path}: header does not match the file size (truncated or corrupt)")
        if expect is not None and (tokens, documents) != (expect["tokens"], expect["documents"]):
            raise DatasetError(f"{self.path}: header says {tokens} tokens / {documents} documents, the manifest "
                               f"{expect['tokens']} / {expect['documents']} (corrupt)")
        self.dtype = _DTYPES[width]
        self.num_tokens = int(tokens)
        self.num_documents = int(documents)
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r", offset=token_offset, shape=(self.num_tokens,)) \
            if tokens else np.zeros(0, self.dtype)
        self.index = np.memmap(self.path, dtype="<u8", mode="r", offset=index_offset, shape=(documents + 1,))
        self.mask = None if not mask_offset else np.memmap(self.path, dtype=np.uint8, mode="r", offset=mask_offset,
                                                           shape=(self.num_tokens,)) if tokens else np.zeros(0, np.uint8)

    def document(self, i: int) -> np.ndarray:
        """Ids of document ``i``, its trailing eos included."""
        return np.asarray(self.tokens[int(self.index[i]):int(self.index[i + 1])])


@dataclass
class Split:
    """The bundles of one split (train or val) of a prepared dataset."""

    name: str
    bundles: list[Bundle]

    @property
    def num_tokens(self) -> int:
        return sum(b.num_tokens for b in self.bundles)

    @property
    def num_documents(self) -> int:
        return sum(b.num_documents for b in self.bundles)

    def documents(self):
        for bundle in self.bundles:
            for i in range(bundle.num_documents):
                yield bundle.document(i)


class PreparedDataset:
    """A prepared dataset directory, opened: its manifest, tokenizer file and memory-mapped bundles.

    Opening checks the format version, that every bundle exists with the manifest's size, and each header;
    ``verify()`` (or ``verify=True``) also recomputes every sha256.
    """

    def __init__(self, directory: str | Path, verify: bool = False):
        self.directory = Path(directory)
        manifest_path = self.directory / MANIFEST
        if not self.directory.is_dir():
            raise DatasetError(f"{self.directory}: no such dataset directory (create one with `zaya data prepare`)")
        if not manifest_path.is_file():
            raise DatasetError(f"{self.directory}: no {MANIFEST}; not a prepared dataset, or an interrupted "
                               "prepare (run `zaya data prepare` again)")
        try:
            self.manifest = read_json(manifest_path)
        except ValueError as exc:  # not JSON, not UTF-8, or nested past the parser's depth
            raise DatasetError(f"{manifest_path}: not valid JSON ({exc}); not written by `zaya data prepare`, or "
                               "damaged: prepare the dataset again") from None
        if not isinstance(self.manifest, dict):
            raise DatasetError(f"{manifest_path}: a JSON {type(self.manifest).__name__}, not a manifest's object; "
                               "not written by `zaya data prepare`, or damaged: prepare the dataset again")
        fmt, version = self.manifest.get("format"), self.manifest.get("format_version")
        if fmt != DATASET_FORMAT:
            raise DatasetError(f"{manifest_path}: format {fmt!r}, expected {DATASET_FORMAT!r}")
        if version != DATASET_VERSION:
            raise DatasetError(f"{manifest_path}: dataset format_version {version!r}; this zaya reads version "
                               f"{DATASET_VERSION} (upgrade zaya, or prepare the data again with this version)")
        try:
            self._check_manifest()
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DatasetError(f"{manifest_path}: malformed ({type(exc).__name__}: {exc}); not written by `zaya "
                               "data prepare`, or damaged: prepare the dataset again") from None
        if verify:
            self.verify()
        self.splits = {name: Split(name, [Bundle(self.directory / b["file"], expect=b) for b in split["bundles"]])
                       for name, split in self.manifest["splits"].items()}
        self.loss_mask: bool = self.manifest.get("loss_mask", False)
        """Whether the bundles carry loss masks (chat data: only the assistant's tokens are targets)."""
        unlike = [b.path.name for split in self.splits.values() for b in split.bundles
                  if (b.mask is not None) != self.loss_mask]
        if unlike:
            raise DatasetError(f"{manifest_path}: says loss_mask = {str(self.loss_mask).lower()}, but the bundle "
                               f"{unlike[0]} {'lacks' if self.loss_mask else 'has'} one (corrupt or mixed by hand); "
                               "prepare the dataset again")
        tok = self.manifest["tokenizer"]
        self.vocab_size: int = tok["vocab_size"]
        self.eos_id: int = tok["eos_id"]
        self.dtype = np.dtype(self.manifest["dtype"])

    def _check_manifest(self) -> None:
        """The manifest's fields have the types the readers rely on (a KeyError, TypeError or ValueError here is a
        malformed manifest), and bundles are plain file names inside the dataset directory."""
        tok = self.manifest["tokenizer"]
        for key in ("vocab_size", "eos_id"):
            if type(tok[key]) is not int or tok[key] < 0 or (key == "vocab_size" and tok[key] == 0):
                raise ValueError(f"tokenizer.{key} = {tok[key]!r} is not a valid id count or id")
        if type(self.manifest.get("loss_mask", False)) is not bool:
            raise ValueError(f"loss_mask = {self.manifest['loss_mask']!r} is not true or false")
        if np.dtype(self.manifest["dtype"]) not in (np.uint16, np.uint32):
            raise ValueError(f"dtype {self.manifest['dtype']!r} is not uint16 or uint32")
        for name, split in self.manifest["splits"].items():
            for b in split["bundles"]:
                file = b["file"]
                if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                    raise ValueError(f"splits.{name}: bundle file {file!r} is not a file name in the directory")
                for key in ("bytes", "tokens", "documents"):
                    if type(b[key]) is not int or b[key] < 0:
                        raise ValueError(f"splits.{name}: {file}: {key} = {b[key]!r}")

    def fingerprint(self) -> str:
        """A digest of what the dataset holds (dtype, tokenizer and every bundle's sha256, by split), not of where
        or when it was prepared: two nodes that prepared the same data independently get the same one."""
        content = {"dtype": self.manifest["dtype"], "tokenizer": self.manifest["tokenizer"].get("file_sha256"),
                   "splits": {name: [b["sha256"] for b in split["bundles"]]
                              for name, split in sorted(self.manifest["splits"].items())}}
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    def split(self, name: str) -> Split:
        if name not in self.splits:
            raise DatasetError(f"{self.directory}: no {name!r} split (has: {', '.join(self.splits)})")
        return self.splits[name]

    def tokenizer(self):
        from zaya.data.tokenizer import Tokenizer

        tok = self.manifest["tokenizer"]
        return Tokenizer.from_file(self.directory / TOKENIZER, pad=tok.get("pad_token"), bos=tok.get("bos_token"),
                                   eos=tok.get("eos_token"))

    def verify(self) -> list[str]:
        """Recompute every checksum (tokenizer and bundles); raise naming the first file that differs."""
        checked = []
        tok = self.manifest["tokenizer"]
        path = self.directory / TOKENIZER
        if not path.is_file():
            raise DatasetError(f"{path}: missing")
        if sha256_file(path) != tok["file_sha256"]:
            raise DatasetError(f"{path}: sha256 differs from the manifest (corrupt or replaced)")
        checked.append(path.name)
        for split in self.manifest["splits"].values():
            for b in split["bundles"]:
                path = self.directory / b["file"]
                if not path.is_file():
                    raise DatasetError(f"{path}: bundle file missing")
                if path.stat().st_size != b["bytes"]:
                    raise DatasetError(f"{path}: {path.stat().st_size:,} bytes, the manifest says {b['bytes']:,} "
                                       "(truncated)")
                if sha256_file(path) != b["sha256"]:
                    raise DatasetError(f"{path}: sha256 differs from the manifest (corrupt bundle; prepare the "
                                       "dataset again)")
                self._check_ids(Bundle(path, expect=b))
                checked.append(path.name)
        return checked

    def _check_ids(self, bundle: Bundle, chunk: int = 1 << 24) -> None:
        """Every id of ``bundle`` is below the tokenizer's vocabulary size (vectorised, in chunks)."""
        vocab = int(self.manifest["tokenizer"]["vocab_size"])
        for start in range(0, bundle.num_tokens, chunk):
            part = np.asarray(bundle.tokens[start:start + chunk])
            if int(part.max()) >= vocab:
                at = start + int(np.argmax(part >= vocab))
                raise DatasetError(f"{bundle.path}: token {at:,} has id {int(part[at - start]):,}, outside the "
                                   f"vocabulary of {vocab:,} ids (a bundle written with another tokenizer, or a "
                                   "manifest rewritten to match a corrupt one); prepare the dataset again")
