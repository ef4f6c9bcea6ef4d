"""What makes a checkpoint directory valid: its COMMIT marker, and the checks made against it before a load.

``COMMIT`` is written last, after every rank's files are on disk, and lists each file with its size and checksum
(``crc32`` by default, or ``sha256``; the key names the algorithm)::

    {"format": 2, "step": 100, "files": {".metadata": {"size": 1234, "crc32": "9a3b..."}, ...}}

A directory without a readable marker, or with a listed file missing or of another size, is *incomplete* and is
never loaded. Verification goes further and recomputes the checksums (spread over the ranks by the caller), which
finds a flipped byte as well as a torn write. Markers of format 1 (sizes only) are still read; they verify by size.

Why crc32 by default: the checksum guards against torn writes, bit rot and truncation, not against an adversary,
and zlib's crc32 runs at about 4 GB/s per core here against sha256's 1.8 GB/s, which matters when every save
hashes every byte.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

COMMIT = "COMMIT"
META = "meta.json"
METADATA = ".metadata"
COMMIT_FORMAT = 2
STEP_DIR = re.compile(r"^step-(\d{8,})$")
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


def read_commit(path: Path) -> dict[str, FileRecord] | None:
    """The files a checkpoint's COMMIT lists, or None when there is no readable marker (a FIFO or device in its
    place is none: reading one would block or never end)."""
    if not (path / COMMIT).is_file():
        return None
    try:
        data = json.loads((path / COMMIT).read_text())
        files = data["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(files, dict):
        return None
    records: dict[str, FileRecord] = {}
    for name, entry in files.items():
        if isinstance(entry, int) and not isinstance(entry, bool):
            records[name] = FileRecord(entry, None)
        elif isinstance(entry, dict) and isinstance(entry.get("size"), int) and not isinstance(entry["size"], bool):
            algorithm = next((a for a in CHECKSUMS if isinstance(entry.get(a), str)), None)
            records[name] = FileRecord(entry["size"], algorithm, entry.get(algorithm) if algorithm else None)
        else:
            return None
    return records


def write_commit(path: Path, step: int, files: dict[str, FileRecord]) -> None:
    from zaya.fsutil import atomic_write_text

    body = {"format": COMMIT_FORMAT, "step": step,
            "files": {name: {"size": r.size, **({r.algorithm: r.checksum} if r.algorithm else {})}
                      for name, r in sorted(files.items())}}
    atomic_write_text(path / COMMIT, json.dumps(body, indent=1) + "\n")


def size_problem(path: Path, records: dict[str, FileRecord] | None) -> str | None:
    """Why ``path`` is incomplete by the cheap checks (marker, presence, sizes), or None."""
    if records is None:
        return f"no valid {COMMIT} marker"
    unlisted = [name for name in (META, METADATA) if name not in records]
    if unlisted:  # every checkpoint lists both: an unlisted one would be read unverified
        return f"{COMMIT} does not list {unlisted[0]}"
    for name, record in sorted(records.items()):
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        size = file.stat().st_size
        if size != record.size:
            return f"{file} has {size:,} bytes, {COMMIT} says {record.size:,} (truncated or overwritten)"
    return None


def is_complete(path: Path) -> bool:
    """A directory whose COMMIT marker lists files that all exist with their recorded sizes."""
    return size_problem(path, read_commit(path)) is None


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
    records = read_commit(path)
    problem = size_problem(path, records)
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
    """This rank's share of the files to checksum: largest first, each to the least-loaded rank (deterministic)."""
    loads = [0] * world_size
    mine: list[str] = []
    for name, record in sorted(records.items(), key=lambda kv: (-kv[1].size, kv[0])):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        loads[owner] += record.size
        if owner == rank:
            mine.append(name)
    return mine


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (by the cheap checks), oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted((p for p in found if is_complete(p)), key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(directory: Path) -> Path | None:
    done = list_checkpoints(directory)
    return done[-1] if done else None


def read_meta(path: Path) -> dict[str, Any]:
    from zaya.checkpoint.errors import CheckpointError

    problem = size_problem(path, read_commit(path))
    if problem is not None:
        raise CheckpointError(f"{path}: not a complete checkpoint ({problem}); it is never loaded")
    try:
        meta = json.loads((path / META).read_text())  # a regular file: size_problem checked it
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / META} cannot be read ({exc}); the checkpoint is damaged: use another "
                              "one") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path / META} is not a JSON object; the checkpoint is damaged: use another one")
    return meta
