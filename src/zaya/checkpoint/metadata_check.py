"""What an unpickled ``.metadata`` must be before DCP (or zaya) uses it: DCP's schema for plain tensors, field by
field, and a description of data that exists.

- Every object is of the type its field declares, down to the leaves: a ``Metadata`` whose entries are all tensors
  (zaya writes no bytes items), a ``planner_data`` of names to key paths, a ``storage_meta`` of strs and a path,
  ``torch.Size`` everywhere a size is. Nothing deeper or other than the schema passes (the unpickler has already
  refused anything that could hash, call or change something).
- The chunks of each tensor tile it exactly: each inside the tensor, none overlapping another, together covering
  every element (a tensor whose chunk list is empty, or one row short, was loaded with uninitialised memory in it),
  each with its data in the storage table.
- Every storage entry belongs to a tensor, and its data lies in a file the checkpoint's COMMIT lists, that is a
  regular file (a link to /etc/passwd or to a FIFO is not read), within its recorded size; no stream transforms.

Each check is linear in the metadata's size; a tiling is checked on the grid the chunks' edges make, which has one
cell per chunk for every layout DCP writes (a shard along any dimensions of a device mesh), and is refused beyond a
few cells per chunk.
"""

from __future__ import annotations

import os
import stat
from math import prod
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from zaya.checkpoint.commit import FileRecord
from zaya.checkpoint.metadata_pickle import MAX_INT, PATHS, describe, dims_problem

CELLS_PER_CHUNK = 4
"""How many grid cells per chunk a tensor's tiling check examines at most (DCP's layouts make one)."""


class _Missing:
    """A field that the file left out (the unpickler fills only the fields a state names)."""


_MISSING = _Missing()


def _field(obj: Any, name: str) -> Any:
    return vars(obj).get(name, getattr(type(obj), name, _MISSING))


def _is_size(value: Any, dims: int | None = None) -> bool:
    return type(value) is torch.Size and dims_problem(value) is None and (dims is None or len(value) == dims)


def _optional_str(value: Any) -> bool:
    return value is None or type(value) is str


def metadata_problem(md: Any, directory: Path, records: dict[str, FileRecord]) -> str | None:
    """Why ``md`` is not a DCP metadata of plain tensors whose data lies in the files ``records`` (COMMIT) lists in
    ``directory``, or None (see the module docstring)."""
    if type(md) is not Metadata:
        return f"it holds {describe(md)}, not a checkpoint metadata"
    entries, storage = _field(md, "state_dict_metadata"), _field(md, "storage_data")
    if type(entries) is not dict or type(storage) is not dict:
        return "its entries or its storage table are not dictionaries"
    problem = (_header_problem(md) or _entries_problem(entries, storage)
               or _storage_problem(entries, storage, directory, records))
    return problem


def _header_problem(md: Metadata) -> str | None:
    version, planner, meta = _field(md, "version"), _field(md, "planner_data"), _field(md, "storage_meta")
    if not _optional_str(version):
        return f"its version is {describe(version)}, not a str"
    if planner is not None:
        if type(planner) is not dict:
            return f"its planner data is {describe(planner)}, not a dictionary"
        for key, path in planner.items():
            if type(key) is not str or type(path) is not tuple or not all(
                    type(p) is str or (type(p) is int and 0 <= p < MAX_INT) for p in path):
                return f"its planner data maps {describe(key)} to {describe(path)}, not a key path"
    if meta is None:
        return None
    if type(meta) is not StorageMeta:
        return f"its storage_meta is {describe(meta)}, not a StorageMeta"
    checkpoint_id, modules = _field(meta, "checkpoint_id"), _field(meta, "modules")
    if not (_optional_str(checkpoint_id) or type(checkpoint_id) in PATHS) or not all(
            _optional_str(_field(meta, name)) for name in ("save_id", "load_id")):
        return "its storage_meta holds something other than strs and a path"
    if not (modules is _MISSING or (type(modules) is list and all(type(m) is str for m in modules))):
        return "its storage_meta's modules are not a list of strs"
    return None


def _properties_ok(props: Any) -> bool:
    return (type(props) is TensorProperties and type(_field(props, "dtype")) is torch.dtype
            and type(_field(props, "layout")) is torch.layout
            and type(_field(props, "memory_format")) is torch.memory_format
            and all(type(_field(props, name)) is bool for name in ("requires_grad", "pin_memory")))


def _entries_problem(entries: dict, storage: dict) -> str | None:
    for key, entry in entries.items():
        if type(key) is not str or type(entry) is not TensorStorageMetadata:
            return f"its entry {describe(key)} is not a tensor (zaya checkpoints hold tensors only)"
        size, chunks = _field(entry, "size"), _field(entry, "chunks")
        if not _properties_ok(_field(entry, "properties")) or not _is_size(size):
            return f"its entry {describe(key)} has no valid dtype or size"
        if type(chunks) is not list:
            return f"its entry {describe(key)} has no chunk list"
        for chunk in chunks:
            offsets, sizes = (_field(chunk, "offsets"), _field(chunk, "sizes")) \
                if type(chunk) is ChunkStorageMetadata else (None, None)
            if not (_is_size(offsets, len(size)) and _is_size(sizes, len(size))) \
                    or any(o + s > n for o, s, n in zip(offsets, sizes, size)):
                return f"a chunk of its entry {describe(key)} lies outside the tensor"
            if MetadataIndex(key, offsets) not in storage:
                return f"a chunk of its entry {describe(key)} at {list(offsets)} has no data in its storage table"
        problem = tiling_problem(size, [(c.offsets, c.sizes) for c in chunks])
        if problem is not None:
            return f"the chunks of its entry {describe(key)} {problem}"
    return None


def tiling_problem(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """Why the boxes ``chunks`` ((offsets, sizes), each inside ``size``) do not tile the tensor exactly (every
    element covered once), or None. Checked on the grid their edges make, one cell at a time, so at most
    ``CELLS_PER_CHUNK`` cells per chunk (DCP's layouts are grids: one cell each)."""
    volume = prod(size)
    covered = sum(prod(s) for _, s in chunks)
    if covered != volume:
        return f"cover {covered:,} elements of its {volume:,}: the tensor would be left partly uninitialised"
    if len(chunks) == 1 or volume == 0:
        return None  # one chunk inside the tensor with the tensor's volume is the tensor
    live = [(o, s) for o, s in chunks if prod(s)]
    edges = [sorted({o[d] for o, _ in live} | {o[d] + s[d] for o, s in live}) for d in range(len(size))]
    cells = prod(len(e) - 1 for e in edges)
    if cells > CELLS_PER_CHUNK * len(live) + 64:
        return f"do not form a grid ({len(live):,} chunks make {cells:,} cells): not a layout DCP writes"
    position = [{edge: i for i, edge in enumerate(e)} for e in edges]
    strides = [prod(len(e) - 1 for e in edges[d + 1:]) for d in range(len(size))]
    seen = bytearray(cells)
    for offsets, sizes in live:
        starts = [0]
        for d, (o, s) in enumerate(zip(offsets, sizes)):
            span = range(position[d][o], position[d][o + s])
            starts = [a + i * strides[d] for a in starts for i in span]
        for cell in starts:
            if seen[cell]:
                return f"overlap at {list(offsets)}: some elements are stored twice, others not at all"
            seen[cell] = 1
    return None


def _storage_problem(entries: dict, storage: dict, directory: Path, records: dict[str, FileRecord]) -> str | None:
    kinds: dict[str, str | None] = {}
    for index, info in storage.items():
        fqn, offset = index.fqn, index.offset  # keys were checked by the unpickler before they were hashed
        entry = entries.get(fqn)
        if entry is None or offset is None or len(offset) != len(entry.size):
            return f"its storage table holds data for {describe(fqn)}, which is no tensor of its entries"
        if type(info) is not _StorageInfo:
            return f"its storage table holds {describe(info)} for {describe(fqn)}, not a tensor location"
        name, start, length = (_field(info, f) for f in ("relative_path", "offset", "length"))
        transforms = _field(info, "transform_descriptors")
        if type(name) is not str or name not in records:
            return (f"it points {describe(fqn)} at {describe(name)}, which is not a file its COMMIT lists in the "
                    "checkpoint directory")
        if name not in kinds:
            kinds[name] = _file_problem(directory / name)
        if kinds[name] is not None:
            return f"it points {describe(fqn)} at {directory / name}, which {kinds[name]}"
        if not (type(start) is int and type(length) is int and 0 <= start and 0 <= length
                and start + length <= records[name].size):
            return (f"it gives {describe(fqn)} bytes {describe(start)}+{describe(length)} of {name}, which has "
                    f"{records[name].size:,}")
        if transforms not in (None, _MISSING) and not (type(transforms) is list and not transforms):
            return (f"it asks to transform the stream of {describe(fqn)} ({describe(transforms)}), which zaya never "
                    "does")
    return None


def _file_problem(file: Path) -> str | None:
    try:
        info = os.lstat(file)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file (a link, a FIFO or a device: a checkpoint holds only files it wrote)"
    return None

