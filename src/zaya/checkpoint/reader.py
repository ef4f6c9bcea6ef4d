"""DCP's file reader, made safe for files nobody vouches for: a checkpoint is data, never code.

torch's ``FileSystemReader`` reads a checkpoint's ``.metadata`` with ``pickle.load``, and its load planner reads any
non-tensor ("bytes") item with ``torch.load(weights_only=False)``: either runs whatever a crafted file asks for. The
COMMIT checksums do not help (whoever writes a file can recompute them). Here:

- ``.metadata`` is read only as a regular file listed in COMMIT, of at most ``MAX_METADATA_BYTES``, and unpickled by
  ``metadata_pickle.py``'s allow-list unpickler: DCP's metadata classes and nothing else, no state set on anything
  but what it created, keys checked before they are hashed, in time linear in the file's size.
- The result is checked before DCP sees it (``metadata_check.py``): DCP's schema for plain tensors field by field,
  chunks that tile each tensor exactly, data only in regular files that COMMIT lists (no link, FIFO or device),
  within their sizes, no stream transforms. The tensor data itself is read by DCP with
  ``torch.load(weights_only=True)``, each item's pickle checked first (``item_pickle_problem``: torch's unpickler
  hashes what a crafted item holds, which hung or crashed it).
- ``load_dcp`` checks the live tensors against it (present, same shape, floating point where a float is expected)
  before loading: a checkpoint made for another model is refused naming the tensor.

Every refusal is a ``CheckpointError`` naming the file. The pure-Python unpickler reads a large metadata about 3x
slower than the C one (a 26 MB, 160,000-chunk metadata in 15 s against 5 s here); ``AllowListReader`` reads it once
per load.
"""

from __future__ import annotations

import io
import os
import stat
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from zaya.checkpoint.commit import METADATA, load_commit
from zaya.checkpoint.errors import CheckpointError
from zaya.checkpoint.metadata_check import metadata_problem
from zaya.checkpoint.metadata_pickle import Refused, item_pickle_problem, unpickle_metadata

# DCP warns on every single-process save/load that it "assumes" no process group: intended here. A module-level
# filter, because warnings.catch_warnings() is not thread-safe and the background save runs in a thread.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")

UNTRUSTED = ("this is not a checkpoint zaya wrote, or it was altered since (possibly maliciously): do not load it; "
             "use a checkpoint from a source you trust")
MAX_METADATA_BYTES = 1 << 30
"""The largest ``.metadata`` read: about 6 million chunks (a real one takes ~160 bytes per chunk), e.g. 5,000
tensors sharded over 1,024 ranks. Reading one takes about 20 bytes of memory per byte (a crafted one at most ~75)."""
METADATA_FLOOR_BYTES = 4 << 20
"""A ``.metadata`` may also be at most as large as the data files its COMMIT lists, or this, whichever is more: each
chunk it describes (~160 bytes) is a torch archive of at least ~1 KB in a data file. Unpickling runs at about 1 MB/s
(pure Python, every instruction checked), so this keeps a padded one (300 MB of no-op instructions took minutes)
to seconds."""


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of the checkpoint directory ``path``, through the allow-list and checked (module docstring);
    anything else is a ``CheckpointError`` naming the file."""
    directory = Path(path)
    file = directory / METADATA
    records, problem = load_commit(directory)
    if records is None:
        raise CheckpointError(f"{directory}: cannot be loaded: {problem}")
    if METADATA not in records:
        raise CheckpointError(f"{file} is not listed in {directory}/COMMIT; the checkpoint is damaged: use another "
                              "one")
    data_bytes = sum(r.size for name, r in records.items() if name not in (METADATA, "meta.json"))
    data = _read_regular(file, data_bytes)
    try:
        metadata = unpickle_metadata(data)
    except Refused as exc:
        raise CheckpointError(f"{file} is refused: {exc}; {UNTRUSTED}") from None
    except Exception as exc:  # noqa: BLE001 - anything a crafted or damaged pickle raises is a refusal
        detail = str(exc)[:200]
        raise CheckpointError(f"{file} is refused: {type(exc).__name__}: {detail}; {UNTRUSTED}") from None
    del data
    problem = metadata_problem(metadata, directory, records)
    if problem is not None:
        raise CheckpointError(f"{file} is refused: {problem}; {UNTRUSTED}")
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _read_regular(file: Path, data_bytes: int) -> bytes:
    """The bytes of ``file``, opened without following a link or blocking on a FIFO, if it is a regular file of at
    most MAX_METADATA_BYTES and ``data_bytes`` (what the checkpoint's data files could need described)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckpointError(f"{file} cannot be read ({exc.strerror or exc}); the checkpoint is incomplete or "
                              "damaged: use another one") from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{file} is not a regular file; the checkpoint is damaged: use another one")
        if info.st_size > MAX_METADATA_BYTES:
            raise CheckpointError(f"{file} has {info.st_size:,} bytes, more than the {MAX_METADATA_BYTES:,} zaya "
                                  f"reads (about 6 million chunks); {UNTRUSTED}")
        if info.st_size > max(METADATA_FLOOR_BYTES, data_bytes):
            raise CheckpointError(f"{file} has {info.st_size:,} bytes, more than the data files it describes "
                                  f"({data_bytes:,} bytes; a metadata takes far fewer bytes than its data, and "
                                  f"{METADATA_FLOOR_BYTES:,} are always allowed); {UNTRUSTED}")
        try:
            return fh.read(MAX_METADATA_BYTES + 1)
        except OSError as exc:
            raise CheckpointError(f"{file} cannot be read ({exc.strerror or exc}); the checkpoint is damaged: use "
                                  "another one") from None


class AllowListReader(FileSystemReader):
    """``FileSystemReader`` whose metadata comes from ``read_metadata`` (allow-listed, checked), read once."""

    def __init__(self, path: str | Path):
        super().__init__(str(path))
        self._metadata: Metadata | None = None
        self._dtypes: dict[tuple[str, int], torch.dtype] = {}

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then never falls back to a rank-local __N.metadata
        if self._metadata is None:
            self._metadata = read_metadata(Path(self.path))
            tensors = self._metadata.state_dict_metadata
            self._dtypes = {(info.relative_path, info.offset): tensors[index.fqn].properties.dtype
                            for index, info in self._metadata.storage_data.items()}
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _slice_file(self, file, sinfo):  # noqa: ANN001 - DCP's hook: the view of one item that torch.load reads
        """The item's view, after its pickle passed ``item_pickle_problem`` (torch.load would hash what it holds)."""
        view = super()._slice_file(file, sinfo)
        try:
            record = torch._C.PyTorchFileReader(view).get_record("data.pkl")  # noqa: SLF001 - what torch.load reads
        except Exception as exc:  # noqa: BLE001 - a damaged archive: torch.load would fail on it as well
            problem = f"it is not a tensor archive ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
        else:
            problem = item_pickle_problem(record, self._dtypes.get((sinfo.relative_path, sinfo.offset)))
        if problem is not None:
            where = Path(self.path) / sinfo.relative_path
            raise CheckpointError(f"{where}: the item at byte {sinfo.offset:,} is refused: {problem}; {UNTRUSTED}")
        view.seek(0)
        return view


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
