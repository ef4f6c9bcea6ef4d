"""DCP's file reader, made safe for files nobody vouches for: a checkpoint is data, never code.

torch's ``FileSystemReader`` reads a checkpoint's ``.metadata`` with ``pickle.load``, and its load planner reads any
non-tensor ("bytes") item with ``torch.load(weights_only=False)``: either runs whatever a crafted file asks for. The
COMMIT checksums do not help (whoever writes a file can recompute them). Here:

- ``.metadata`` is unpickled by ``_MetadataUnpickler``, which resolves only the names a DCP metadata pickle holds
  (DCP's metadata dataclasses, ``torch.Size``, the torch dtypes and layouts, the path type of ``checkpoint_id``),
  calls (REDUCE, NEWOBJ) only those, and sets state (BUILD) only on instances of those classes, never on a class or
  a function (which would change them for the whole process). Anything else is a ``CheckpointError`` naming the file.
  Measured with real DDP, ZeRO-1 and FSDP2 (DTensor) saves: these are all the names they use.
- The result is checked before DCP sees it: every entry a tensor (zaya writes no bytes items; the planner refuses
  them as well), every chunk inside its tensor, every data file a plain name in the checkpoint directory (no path
  leads elsewhere), no stream transforms. The tensor data itself is read by DCP with ``torch.load(weights_only=True)``.
- ``load_dcp`` checks the live tensors against it (present, same shape, floating point where a float is expected)
  before loading: a checkpoint made for another model is refused naming the tensor.

The unpickler is the standard library's pure-Python one (``pickle._Unpickler``): its opcodes can be overridden one by
one, which the C unpickler's cannot. It reads a large metadata about 3x slower (a 26 MB, 160,000-chunk metadata in
15 s against 5 s here); ``AllowListReader`` reads it once per load.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import reprlib
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata, _MEM_FORMAT_ENCODING)
from torch.serialization import _get_layout

from zaya.checkpoint.commit import METADATA
from zaya.checkpoint.errors import CheckpointError

# DCP warns on every single-process save/load that it "assumes" no process group: intended here. A module-level
# filter, because warnings.catch_warnings() is not thread-safe and the background save runs in a thread.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")

UNTRUSTED = ("this is not a checkpoint zaya wrote, or it was altered since (possibly maliciously): do not load it; "
             "use a checkpoint from a source you trust")

_CLASSES = (Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata, ChunkStorageMetadata,
            _StorageInfo, _MEM_FORMAT_ENCODING, pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath,
            pathlib.PureWindowsPath, torch.Size)
"""Classes a DCP metadata pickle creates (REDUCE, NEWOBJ) and fills (BUILD)."""
_CALLABLES = (*_CLASSES, _get_layout)
_GLOBALS: dict[tuple[str, str], Any] = {(obj.__module__, obj.__qualname__): obj for obj in _CALLABLES}
_GLOBALS.update({(module, c.__name__): c for c in _CLASSES if c.__module__.startswith("pathlib")
                 for module in ("pathlib", "pathlib._local")})  # where Python 3.13 defines them
_GLOBALS.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 160


def _short(value: Any) -> str:
    """A bounded repr for messages: a crafted file may hold a gigabyte string or a deeply nested list."""
    return _REPR.repr(value)


class _MetadataUnpickler(pickle._Unpickler):  # noqa: SLF001 - the only unpickler whose opcodes can be overridden
    """Unpickles a DCP metadata and nothing else (see the module docstring)."""

    dispatch = dict(pickle._Unpickler.dispatch)  # noqa: SLF001

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it asks for {module}.{name}, which no checkpoint metadata holds") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference, which no checkpoint metadata holds")

    def _refuse(self) -> None:
        raise pickle.UnpicklingError("it uses an instruction no checkpoint metadata uses")

    def _load_reduce(self) -> None:
        if not any(self.stack[-2] is c for c in _CALLABLES):
            raise pickle.UnpicklingError(f"it calls {_short(self.stack[-2])}, which no checkpoint metadata calls")
        pickle._Unpickler.load_reduce(self)  # noqa: SLF001

    def _load_newobj(self) -> None:
        if not any(self.stack[-2] is c for c in _CLASSES):
            raise pickle.UnpicklingError(f"it creates {_short(self.stack[-2])}, which no checkpoint metadata holds")
        pickle._Unpickler.load_newobj(self)  # noqa: SLF001

    def _load_build(self) -> None:
        target = self.stack[-2]
        if isinstance(target, type) or not any(type(target) is c for c in _CLASSES):
            raise pickle.UnpicklingError(f"it sets the state of {_short(target)}, which no checkpoint metadata does")
        pickle._Unpickler.load_build(self)  # noqa: SLF001

    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.BUILD[0]] = _load_build
    for _op in (pickle.NEWOBJ_EX, pickle.INST, pickle.OBJ, pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _refuse
    del _op


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of the checkpoint directory ``path``, through the allow-list and checked (module docstring)."""
    file = Path(path) / METADATA
    try:
        with open(file, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except OSError as exc:
        raise CheckpointError(f"{file} cannot be read ({exc}); the checkpoint is incomplete: use another one") from None
    except Exception as exc:  # noqa: BLE001 - anything a crafted or damaged pickle raises is a refusal
        reason = str(exc) if isinstance(exc, pickle.UnpicklingError) else f"{type(exc).__name__}: {exc}"
        raise CheckpointError(f"{file} is refused: {reason}; {UNTRUSTED}") from None
    problem = _metadata_problem(metadata, Path(path))
    if problem is not None:
        raise CheckpointError(f"{file} is refused: {problem}; {UNTRUSTED}")
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _is_size(value: Any, dims: int | None = None) -> bool:
    return (type(value) is torch.Size and (dims is None or len(value) == dims)
            and all(type(v) is int and v >= 0 for v in value))


def _metadata_problem(md: Any, directory: Path) -> str | None:
    """Why a loaded metadata is not one DCP wrote for plain tensors, or None."""
    if type(md) is not Metadata:
        return f"it holds a {type(md).__name__}, not a checkpoint metadata"
    if type(md.state_dict_metadata) is not dict or type(md.storage_data) is not dict:
        return "its entries or its storage table are not dictionaries"
    if md.storage_meta is not None and type(md.storage_meta) is not StorageMeta:
        return "its storage_meta is not a StorageMeta"
    for key, entry in md.state_dict_metadata.items():
        if type(key) is not str or type(entry) is not TensorStorageMetadata:
            return f"its entry {_short(key)} is not a tensor (zaya checkpoints hold tensors only)"
        props, size = entry.properties, entry.size
        if type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype) or not _is_size(size):
            return f"its entry {_short(key)} has no valid dtype or size"
        if type(entry.chunks) is not list:
            return f"its entry {_short(key)} has no chunk list"
        for chunk in entry.chunks:
            if (type(chunk) is not ChunkStorageMetadata or not _is_size(chunk.offsets, len(size))
                    or not _is_size(chunk.sizes, len(size))
                    or any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, size))):
                return f"a chunk of its entry {_short(key)} lies outside the tensor"
    files = {f.name for f in directory.iterdir()} if directory.is_dir() else set()
    for index, info in md.storage_data.items():
        if (type(index) is not MetadataIndex or type(index.fqn) is not str or type(info) is not _StorageInfo
                or not (index.offset is None or _is_size(index.offset))
                or not (index.index is None or type(index.index) is int)):
            return "its storage table holds something other than tensor locations"
        name = info.relative_path
        if type(name) is not str or not name.endswith(".distcp") or "/" in name or "\\" in name or name not in files:
            return (f"it points {_short(index.fqn)} at {_short(name)}, which is not a data file of the checkpoint "
                    "directory")
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            return f"it gives {_short(index.fqn)} an invalid offset or length"
        if info.transform_descriptors:
            return (f"it asks to transform the stream of {_short(index.fqn)} "
                    f"({_short(info.transform_descriptors)}), which zaya never does")
    return None


class AllowListReader(FileSystemReader):
    """``FileSystemReader`` whose metadata comes from ``read_metadata`` (allow-listed, checked), read once."""

    def __init__(self, path: str | Path):
        super().__init__(str(path))
        self._metadata: Metadata | None = None

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then never falls back to a rank-local __N.metadata
        if self._metadata is None:
            self._metadata = read_metadata(Path(self.path))
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that a bytes item (which torch unpickles with ``weights_only=False``) is refused:
    zaya never writes one, and ``read_metadata`` already refuses a metadata that declares one."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(f"a non-tensor item {read_item.dest_index.fqn!r} is refused; {UNTRUSTED}")


def check_entries(path: Path, metadata: Metadata, flat: Mapping[str, torch.Tensor]) -> None:
    """Refuse a checkpoint that lacks one of the live tensors, holds it with another shape, or holds a floating-point
    one as integers (or the reverse), naming it."""
    saved = metadata.state_dict_metadata
    for key, tensor in flat.items():
        part = key.split(".", 1)[0]
        what = "a different model" if part == "model" else f"a different setup (checkpoint part {part!r})"
        entry = saved.get(key)
        if entry is None:
            raise CheckpointError(f"{path}: has no tensor {key}: made for {what}")
        if tuple(entry.size) != tuple(tensor.shape):
            raise CheckpointError(f"{path}: tensor {key} has shape {list(entry.size)} there, {list(tensor.shape)} in "
                                  f"this run: made for {what}")
        stored = entry.properties.dtype
        if stored.is_floating_point != tensor.dtype.is_floating_point or stored.is_complex != tensor.is_complex():
            raise CheckpointError(f"{path}: tensor {key} is {str(stored).removeprefix('torch.')} there, "
                                  f"{str(tensor.dtype).removeprefix('torch.')} in this run: made for {what}, or "
                                  "damaged")


def first_failure(exc: BaseException) -> tuple[str, BaseException]:
    """(prefix, exception) of the first rank's failure inside DCP's ``CheckpointException`` (which holds every
    rank's exception and traceback), or ("", exc) for any other exception."""
    failures = getattr(exc, "failures", None)  # {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        rank, (inner, _) = sorted(failures.items())[0]
        return f"rank {rank}: " + (f"(and {len(failures) - 1} more rank(s)) " if len(failures) > 1 else ""), inner
    return "", exc


def load_dcp(path: Path, flat: dict[str, torch.Tensor], process_group: Any = None, distributed: bool = False,
             reader: AllowListReader | None = None) -> None:
    """Load the tensors ``flat`` (DCP keys -> live tensors, filled in place) from the checkpoint directory ``path``
    through ``AllowListReader`` (``reader``, when the caller has read the metadata already) and
    ``TensorsOnlyPlanner``, after ``check_entries``. Any failure is a ``CheckpointError`` naming ``path``. Collective
    when ``distributed``."""
    path = Path(path)
    reader = reader if reader is not None else AllowListReader(path)
    check_entries(path, reader.read_metadata(), flat)
    try:
        dcp.load(flat, storage_reader=reader, planner=TensorsOnlyPlanner(), process_group=process_group,
                 no_dist=not distributed)
    except (Exception, CheckpointException) as exc:
        prefix, inner = first_failure(exc)
        prefix = prefix if distributed else ""
        if isinstance(inner, CheckpointError):
            raise CheckpointError(f"{prefix}{inner}") from None
        lines = str(inner).strip().splitlines()
        raise CheckpointError(f"{path}: cannot be loaded: {prefix}{type(inner).__name__}"
                              + (f": {lines[0]}" if lines else "")) from exc
