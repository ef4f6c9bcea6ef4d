"""What makes a checkpoint directory valid: its COMMIT marker, and the checks made against it before a load.

``COMMIT`` is written last, after every rank's files are on disk, and lists each file with its size and checksum
(``crc32`` by default, or ``sha256``; the key names the algorithm)::

    {"format": 2, "step": 100, "files": {".metadata": {"size": 1234, "crc32": "9a3b..."}, ...}}

A directory without a marker is *incomplete*: a save in progress or one that died (a save renames its directory
into place only after writing COMMIT), skipped without a word. One with a marker is complete or *damaged*, never in
progress: a marker that is not a regular file or does not parse, that names anything but a plain file name of the
directory, or a listed file missing, not a regular file (a link, a FIFO) or of another size, makes it damaged, and
every load that skips it names it and why. Verification goes further and recomputes the checksums (spread over the
ranks by the caller), which finds a flipped byte as well as a torn write. Markers of format 1 (sizes only) are still
read; they verify by size.

Why crc32 by default: the checksum guards against torn writes, bit rot and truncation, not against an adversary,
and zlib's crc32 runs at about 4 GB/s per core here against sha256's 1.8 GB/s, which matters when every save
hashes every byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from zaya.core.balance import balance
from zaya.core.fsutil import loads_json, read_json
from zaya.model.checksums import is_plain_name

COMMIT = "COMMIT"
META = "meta.json"
METADATA = ".metadata"
COMMIT_FORMAT = 2
STEP_DIR = re.compile(r"^step-(\d{8,})$")
NO_MARKER = f"no {COMMIT} marker (a save in progress, or one that died)"
MAX_COMMIT_BYTES = 16 << 20
"""A COMMIT lists a few files per rank: 16 MiB holds a 100,000-rank save's."""
_HASH_BLOCK = 8 << 20


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


class _Crc32:
    """crc32 with hashlib's update/hexdigest interface."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


CHECKSUMS = {"crc32": _Crc32, "sha256": hashlib.sha256}
"""Checksum algorithms a COMMIT may use, by the key they are stored under."""


def new_checksum(algorithm: str):
    return CHECKSUMS[algorithm]()


def checksum_file(path: Path, algorithm: str = "crc32") -> str:
    """Hex checksum of a file, read in large blocks (zlib and hashlib release the GIL while they hash them)."""
    digest = new_checksum(algorithm)
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(_HASH_BLOCK)
        view = memoryview(buf)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


@dataclass(frozen=True)
class FileRecord:
    size: int
    algorithm: str | None = None  # None in format-1 markers (sizes only)
    checksum: str | None = None


def load_commit(path: Path) -> tuple[dict[str, FileRecord] | None, str | None]:
    """(the files a checkpoint's COMMIT lists, None), or (None, why there is no valid marker). Reads only a regular
    file (a FIFO or device in its place would block or never end), whose names are plain file names of the
    checkpoint directory (a name like /etc/passwd or ../x would have that file checksummed and loaded)."""
    file = path / COMMIT
    try:
        info = os.lstat(file)
    except FileNotFoundError:
        return None, NO_MARKER
    except OSError as exc:
        return None, f"{file} cannot be read ({exc.strerror or exc})"
    if not stat.S_ISREG(info.st_mode):
        return None, f"{file} is not a regular file"
    if info.st_size > MAX_COMMIT_BYTES:
        return None, f"{file} has {info.st_size:,} bytes, more than any COMMIT marker ({MAX_COMMIT_BYTES:,})"
    try:
        data = loads_json(file.read_bytes())
    except (OSError, ValueError) as exc:
        return None, f"{file} is not valid JSON ({_clip(exc)})"
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return None, f"{file} has no 'files' table"
    records: dict[str, FileRecord] = {}
    for name, entry in files.items():
        if not is_plain_name(name):
            return None, (f"{file} lists {_clip(repr(name))}, which is not the name of a file in the checkpoint "
                          "directory")
        size = entry.get("size") if isinstance(entry, dict) else entry
        if type(size) is not int or size < 0:
            return None, f"{file} gives {_clip(repr(name))} no valid size"
        algorithm = next((a for a in CHECKSUMS if isinstance(entry, dict) and isinstance(entry.get(a), str)), None)
        records[name] = FileRecord(size, algorithm, entry[algorithm][:128] if algorithm else None)
    return records, None


def read_commit(path: Path) -> dict[str, FileRecord] | None:
    """The files a checkpoint's COMMIT lists, or None when it has no valid marker (``load_commit``)."""
    return load_commit(path)[0]


def _clip(value: object) -> str:
    text = str(value)
    return text[:200] + ("..." if len(text) > 200 else "")


def write_commit(path: Path, step: int, files: dict[str, FileRecord]) -> None:
    from zaya.core.fsutil import atomic_write_text

    body = {"format": COMMIT_FORMAT, "step": step,
            "files": {name: {"size": r.size, **({r.algorithm: r.checksum} if r.algorithm else {})}
                      for name, r in sorted(files.items())}}
    atomic_write_text(path / COMMIT, json.dumps(body, indent=1) + "\n")


def files_problem(path: Path, records: dict[str, FileRecord]) -> str | None:
    """Why the files ``records`` lists are not all in ``path`` as regular files of their recorded sizes, or None."""
    unlisted = [name for name in (META, METADATA) if name not in records]
    if unlisted:  # every checkpoint lists both: an unlisted one would be read unverified
        return f"{COMMIT} does not list {unlisted[0]}"
    for name, record in sorted(records.items()):
        file = path / name
        try:
            info = os.lstat(file)
        except FileNotFoundError:
            return f"{file} is missing"
        except OSError as exc:
            return f"{file} cannot be read ({exc.strerror or exc})"
        if not stat.S_ISREG(info.st_mode):
            return f"{file} is not a regular file (a link, a FIFO or a device: a checkpoint holds only files it wrote)"
        if info.st_size != record.size:
            return f"{file} has {info.st_size:,} bytes, {COMMIT} says {record.size:,} (truncated or overwritten)"
    return None


def completeness_problem(path: Path) -> str | None:
    """Why ``path`` is not complete by the cheap checks (its marker, the presence, kind and size of every file it
    lists), or None."""
    records, problem = load_commit(path)
    return problem if records is None else files_problem(path, records)


def has_marker(path: Path) -> bool:
    """Whether ``path`` has a COMMIT marker of any kind: a directory without one is a save in progress or one that
    died (incomplete, skipped without a word); with one, it is complete or damaged (named when skipped)."""
    return os.path.lexists(path / COMMIT)


def is_complete(path: Path) -> bool:
    """A directory whose COMMIT marker lists files that all exist with their recorded sizes."""
    return completeness_problem(path) is None


def checksum_problem(path: Path, names: list[str], records: dict[str, FileRecord]) -> str | None:
    """Recompute the checksums of ``names`` (a subset of the marker's files); the first mismatch, or None."""
    for name in names:
        record = records[name]
        if record.algorithm is None:
            continue
        try:
            actual = checksum_file(path / name, record.algorithm)
        except OSError as err:
            return f"{path / name} cannot be read ({err})"
        if actual != record.checksum:
            return (f"{path / name} fails its checksum ({record.algorithm} {actual[:16]}, {COMMIT} says "
                    f"{record.checksum[:16]})")
    return None


def verification_problem(path: Path, checksums: bool = True, rank: int = 0, world_size: int = 1) -> str | None:
    """Why ``path`` must not be loaded, or None: its marker and sizes, then (``checksums``) the checksums of this
    rank's ``share_of_files`` (all of them in one process)."""
    records, problem = load_commit(path)
    if records is not None:
        problem = files_problem(path, records)
    if problem is None and checksums:
        problem = checksum_problem(path, share_of_files(records, rank, world_size), records)
    return problem


def newest_loadable(candidates: list[Path], problem_of: Callable[[Path], str | None],
                    skipped: Callable[[Path, str], None]) -> Path | None:
    """The newest of ``candidates`` (oldest first) that ``problem_of`` finds nothing wrong with; every newer one is
    handed to ``skipped(path, problem)`` before the next is tried. None when none passes. The one fallback rule,
    shared by training's resume (``CheckpointStore.select``) and inference (``consolidate.resolve_checkpoint``)."""
    for path in reversed(candidates):
        problem = problem_of(path)
        if problem is None:
            return path
        skipped(path, problem)
    return None


def unloadable(path: Path, problem: str):
    """The ``CheckpointError`` for a checkpoint named explicitly that fails verification: no fallback (the user chose
    it), but the newest other complete one is named."""
    from zaya.checkpoint.errors import CheckpointError

    others = [p for p in list_checkpoints(path.parent) if p != path]
    hint = f"; the newest other complete one is {others[-1]}" if others else ""
    return CheckpointError(f"{path}: cannot be loaded: {problem}{hint}")


def share_of_files(records: dict[str, FileRecord], rank: int, world_size: int) -> list[str]:
    """This rank's share of the files to checksum, by size (``zaya.core.balance``: largest first, each to the
    least-loaded rank; deterministic)."""
    owner = balance({name: record.size for name, record in records.items()}, [0] * world_size)
    return [name for name, r in owner.items() if r == rank]


def committed_checkpoints(directory: Path) -> list[Path]:
    """Step directories with a COMMIT marker (``has_marker``: complete or damaged, never a save in progress), oldest
    first: the candidates a load tries, naming each it skips."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and has_marker(p)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (by the cheap checks), oldest first."""
    return [p for p in committed_checkpoints(directory) if is_complete(p)]


def latest_checkpoint(directory: Path) -> Path | None:
    done = list_checkpoints(directory)
    return done[-1] if done else None


def read_meta(path: Path) -> dict[str, Any]:
    from zaya.checkpoint.errors import CheckpointError

    problem = completeness_problem(path)
    if problem is not None:
        raise CheckpointError(f"{path}: not a complete checkpoint ({problem}); it is never loaded")
    try:
        meta = read_json(path / META)  # a regular file: completeness_problem checked it
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / META} cannot be read ({_clip(exc)}); the checkpoint is damaged: use another "
                              "one") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path / META} is not a JSON object; the checkpoint is damaged: use another one")
    return meta
