"""A prepare's temporary folder, and what the next prepare does with one that a killed prepare left behind.

``prepare`` writes into ``.NAME.tmp-XXXXXX`` beside ``--out`` (``zaya.core.fsutil.atomic_directory``) and renames it into
place at the end. ``claim`` puts ``.owner.json`` in it first (the writing process's host, pid and start time:
``zaya.core.procs``) and ``release`` takes it out just before the rename. A prepare killed in between (SIGKILL, a lost
node, a full disk that took the process down) leaves the folder behind; ``sweep``, run by the next prepare of the
same ``--out`` (a built-in corpus's cache entry included), removes it when its owner has provably ended, and
otherwise reports it without touching it: the owner still runs, ran on another host, or left no record.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Callable

from zaya.core import procs
from zaya.core.fsutil import read_json

OWNER = ".owner.json"


def temporary_folders(out: Path) -> list[Path]:
    """The temporary folders of prepares of ``out`` (``atomic_directory``'s naming), oldest name first."""
    if not out.parent.is_dir():
        return []
    prefix = f".{out.name}.tmp-"  # compared as text: a name with glob characters ("data[1]") must match too
    return sorted(p for p in out.parent.iterdir()
                  if p.name.startswith(prefix) and p.is_dir() and not p.is_symlink())


def claim(tmp: Path) -> None:
    """Record this process as the writer of ``tmp``."""
    (tmp / OWNER).write_text(json.dumps(procs.record()) + "\n")


def release(tmp: Path) -> None:
    """Take the record out (the folder is about to become the dataset)."""
    (tmp / OWNER).unlink(missing_ok=True)


def _owner(doc: object) -> dict | None:
    """The owner record ``claim`` writes (host, an int pid, a finite start time), or None for anything else."""
    if not isinstance(doc, dict) or not isinstance(doc.get("host"), str):
        return None
    pid, started = doc.get("pid"), doc.get("started")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:
        return None
    if not isinstance(started, float) or not math.isfinite(started):
        return None
    return doc


def sweep(out: Path, log: Callable[[str], None]) -> list[Path]:
    """Remove the temporary folders of ``out`` whose prepare has provably ended; report the others. Returns the
    folders removed."""
    removed = []
    for tmp in temporary_folders(out):
        try:
            owner = _owner(read_json(tmp / OWNER))
        except (OSError, ValueError):
            owner = None
        ended = procs.gone(owner) if owner is not None else None
        if ended:
            shutil.rmtree(tmp, ignore_errors=True)
            if not tmp.exists():
                removed.append(tmp)
                log(f"removed {tmp}: the temporary folder of a prepare of {out} that ended without finishing "
                    f"({procs.describe(owner)}, no longer running)")
                continue
        age = _age(tmp)
        if owner is None:
            why = f"it has no owner record (an older zaya's, or a prepare killed as it began), last changed {age} ago"
        elif ended is None:
            why = f"its prepare ran as {procs.describe(owner)}, which this host cannot check, last changed {age} ago"
        elif ended:
            why = "it could not be removed"
        else:
            why = f"its prepare is still running ({procs.describe(owner)})"
        log(f"warning: {tmp} is a temporary folder of another prepare of {out}: {why}; it is left as it is "
            "(remove it once no prepare writes there)")
    return removed


def _age(path: Path) -> str:
    try:
        seconds = max(0.0, time.time() - path.stat().st_mtime)
    except OSError:
        return "an unknown time"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"
