"""Crash-safe file writes shared by every module that writes user data (checkpoints, datasets, configs), and the
one way zaya parses JSON that a file or a peer gave it.

The rule everywhere: write under a temporary name in the destination's directory, flush to disk, then rename into
place, so that a crash mid-write leaves either the old file or the new one, never a torn mix.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def fsync_dir(path: str | Path) -> None:
    """Flush a directory entry (a rename inside it) to disk; a no-op where the platform cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def umask() -> int:
    """The process's umask, read without changing it where the platform allows (Linux's /proc/self/status): setting
    it to read it back would briefly give files that another thread creates meanwhile the wrong mode."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal_mode(path: Path, mask: int) -> None:
    """Give ``path`` the mode a plain ``open`` / ``mkdir`` would have: 0666 (0777 for a directory, or a file with an
    execute bit) less the umask ``mask``. Temporary-file helpers (``tempfile``, the safetensors writer) make theirs
    0600 / 0700, which must not outlive the rename into place."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return
    full = 0o777 if stat.S_ISDIR(mode) or mode & 0o111 else 0o666
    os.chmod(path, full & ~mask)


def atomic_write_bytes(path: str | Path, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and an atomic rename (mode 0666 less the umask).
    ``durable=False`` skips the fsyncs: the file still survives its writer's crash whole, but not a power cut (for
    a file rewritten every step, such as a heartbeat, where an fsync would cost more than the file is worth)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str, durable: bool = True) -> None:
    """``atomic_write_bytes`` for UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"), durable)


def replace_directory(src: str | Path, dst: str | Path) -> None:
    """Rename the complete directory ``src`` to ``dst``; an existing ``dst`` is swapped aside first and deleted only
    after ``src`` is in place, so there is never a moment without one of them at ``dst``'s name or its aside."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        old = aside_name(dst)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        try:
            os.replace(src, dst)
        except BaseException:
            os.replace(old, dst)  # put the old one back: a failed replacement changes nothing
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    fsync_dir(dst.parent)


def aside_name(dst: Path) -> Path:
    """Where ``replace_directory`` keeps ``dst`` while swapping (``restore_aside`` finds it after a crash)."""
    return dst.with_name(f".{dst.name}.old")


def restore_aside(dst: str | Path) -> None:
    """Undo a ``replace_directory`` cut short by a crash: bring the old directory back if ``dst`` is missing,
    else delete the leftover."""
    dst = Path(dst)
    old = aside_name(dst)
    if old.exists():
        if dst.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, dst)


@contextmanager
def atomic_directory(dst: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``dst`` only if the block finishes without an exception.

    Files written inside are fsynced before the rename, and every file and directory gets the mode a plain
    ``open`` / ``mkdir`` would give it (``normal_mode``), whatever wrote it. ``dst`` existing is an error unless
    ``overwrite``; then the old directory is swapped out (renamed aside) and deleted only after the new one is in
    place.
    """
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists; choose another destination or pass overwrite/--force")
    created: list[Path] = []
    parent = dst.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    mask = umask()
    normal_mode(tmp, mask)  # mkdtemp makes it private; the result should look like any new directory
    ok = False
    try:
        yield tmp
        for f in tmp.rglob("*"):
            normal_mode(f, mask)
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        replace_directory(tmp, dst)
        ok = True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if not ok:
            for d in created:  # innermost first: remove only the parents this call made, and only if still empty
                try:
                    d.rmdir()
                except OSError:
                    break


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """zaya's cache directory: ``cache_dir`` if given, else ``$ZAYA_CACHE_DIR``, else ``~/.cache/zaya``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("ZAYA_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "zaya"


def loads_json(text: str | bytes) -> object:
    """``json.loads``, but every way the text can fail to parse is a ``ValueError``: JSON nested deeper than the
    interpreter's recursion limit raises ``RecursionError`` from the json module (100,000 ``[`` in a file zaya
    reads would otherwise end in a traceback), and undecodable bytes ``UnicodeDecodeError`` (a ValueError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None


MAX_JSON_BYTES = 256 << 20
"""The largest JSON file zaya reads (a sharded model's index or a tokenizer config is a few MB)."""


def read_regular(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of ``path`` if it is (or links to) a regular file of at most ``max_bytes``; else OSError saying
    why. Opened without blocking, so a FIFO in its place is refused instead of waiting for a writer forever, and a
    link to /dev/zero instead of reading until memory runs out."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a directory)", str(path))
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"larger than the {max_bytes:,} bytes zaya reads from such a file", str(path))
    return data


def read_json(path: str | Path, max_bytes: int = MAX_JSON_BYTES) -> object:
    """The JSON document in ``path`` (UTF-8, a regular file of at most ``max_bytes``). OSError when it cannot be
    read; ValueError (see ``loads_json``) when it is not JSON: callers turn either into their own error naming the
    file and the fix."""
    return loads_json(read_regular(path, max_bytes))
