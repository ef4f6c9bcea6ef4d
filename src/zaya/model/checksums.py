"""The checksum manifest of an exported model directory: ``SHA256SUMS``, one line per file, in the format of
``sha256sum`` (``<64 hex digits><two spaces><file name>``), so ``sha256sum -c SHA256SUMS`` checks an export too, and
each weight file's line is the sha256 the Hugging Face Hub shows for it.

``zaya export`` (and ``save_checkpoint`` / ``save_hf``) write it last, listing every file of the directory; every
load of the directory checks every listed file first, and refuses a file the load reads that it does not list. It
guards against bit rot, a truncated copy or download: not against whoever wrote the directory, who can recompute it
(loading never runs code from these files: see docs/operations.md). A directory without the manifest (a Hugging Face
download, an export made before it existed) loads with the structural checks alone.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path
from typing import Iterable

from zaya.core.errors import CheckpointError

MANIFEST = "SHA256SUMS"
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")
_CHANGED = (f"export it again (or download it again); if you changed the directory on purpose, delete {MANIFEST} "
            "there")


MAX_MANIFEST_BYTES = 16 << 20
"""A manifest lists a few files: 16 MiB holds a 100,000-shard export's."""
NAME_MAX = 255
"""Bytes of a file name (Linux's NAME_MAX)."""


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is a file name inside a flat directory (a checkpoint's, an export's): a str of at most
    NAME_MAX bytes, no path separator, NUL, '.' or '..' (an absolute name or a '..' would reach outside)."""
    if type(name) is not str or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        return False
    return len(name.encode("utf-8", "surrogatepass")) <= NAME_MAX


def sha256_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def write_checksums(directory: Path) -> None:
    """List every file of ``directory`` (a flat export being written) in its ``SHA256SUMS``."""
    directory = Path(directory)
    files = sorted(f for f in directory.iterdir() if f.is_file() and f.name != MANIFEST)
    (directory / MANIFEST).write_text("".join(f"{sha256_file(f)}  {f.name}\n" for f in files))


def read_manifest(directory: Path) -> dict[str, str] | None:
    """{file name: sha256} of ``directory``'s ``SHA256SUMS``, or None without one; a manifest that is not a regular
    file or not in its format (a name that is not a plain file name of the directory: /etc/passwd, ../x, one longer
    than a file name can be) is a ``CheckpointError`` naming it and the fix."""
    manifest = Path(directory) / MANIFEST
    if not os.path.lexists(manifest):
        return None
    try:
        info = manifest.stat()  # an export copied into a cache of links (Hugging Face's) is read through them
        if not stat.S_ISREG(info.st_mode):  # a FIFO or device would block or never end
            raise CheckpointError(f"{manifest} is not a regular file; {_CHANGED}")
        if info.st_size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{manifest} has {info.st_size:,} bytes, more than any export's manifest "
                                  f"({MAX_MANIFEST_BYTES:,}); {_CHANGED}")
        lines = manifest.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest} cannot be read ({_short(exc)}); {_CHANGED}") from None
    listed: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        match = _LINE.match(line)
        name = match.group(2) if match else ""
        if match is None or not is_plain_name(name) or name in listed:
            raise CheckpointError(f"{manifest}, line {number}: not '<sha256>  <file name>' of a file of this "
                                  f"directory, listed once; {_CHANGED}")
        listed[name] = match.group(1)
    return listed


def verify_checksums(directory: Path) -> set[str] | None:
    """Check every file ``directory``'s ``SHA256SUMS`` lists (``read_manifest``); the names it lists, or None
    without a manifest. A listed file missing, not a regular file or changed is a ``CheckpointError`` naming it and
    the fix."""
    listed = read_manifest(directory)
    if listed is None:
        return None
    manifest = Path(directory) / MANIFEST
    for name, expected in listed.items():
        file = manifest.parent / name
        try:
            regular = stat.S_ISREG(file.stat().st_mode)
        except FileNotFoundError:
            regular = False
        except OSError as exc:
            raise CheckpointError(f"{file}, listed in {MANIFEST}, cannot be read ({_short(exc.strerror or exc)}); "
                                  f"{_CHANGED}") from None
        if not regular:  # missing, or a FIFO or device a read would block on or never finish
            raise CheckpointError(f"{file}, listed in {MANIFEST}, is missing or not a regular file; {_CHANGED}")
        try:
            actual = sha256_file(file)
        except OSError as exc:
            raise CheckpointError(f"{file}, listed in {MANIFEST}, cannot be read ({_short(exc.strerror or exc)}); "
                                  f"{_CHANGED}") from None
        if actual != expected:
            raise CheckpointError(f"{file} fails its checksum (sha256 {actual[:16]}..., {MANIFEST} says "
                                  f"{expected[:16]}...): it changed after the export (bit rot, a truncated copy or "
                                  f"download); {_CHANGED}")
    return set(listed)


def _short(value: object) -> str:
    text = str(value)
    return text[:200] + ("..." if len(text) > 200 else "")


def check_listed(directory: Path, listed: set[str] | None, files: Iterable[Path]) -> None:
    """With a manifest (``listed``), refuse to read a file of ``directory`` it does not list (added or replaced
    after the export)."""
    if listed is None:
        return
    for file in files:
        if Path(file).name not in listed:
            raise CheckpointError(f"{file} is not listed in {Path(directory) / MANIFEST}: it was added after the "
                                  f"export; {_CHANGED}")
