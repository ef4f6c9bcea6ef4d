"""Who a RAM-tier copy belongs to, and when it goes: the private shared-memory directory, owner records, the sweep.

The RAM tier (``ram_tier``) lives in memory that outlasts its processes, so nothing but a rule removes a copy:

- **Private.** The tier's root (``/dev/shm/zaya-<uid>`` by default, or ``checkpoint.ram_dir``) and each run's
  directory in it are created mode 0700. An existing root or run directory that is a link, belongs to another user,
  or is writable by others is refused (``problem``): whoever can write there could swap a copy for one of their own,
  which a restart would load. The store then keeps to disk, with a warning that names the directory.
- **Owned.** Each rank that uses the tier records itself in ``rank-NNNNN.owner.json`` (``claim``): its process
  (host, pid, start time: ``zaya.core.procs``), the torchrun agent that launched it, if any, and the supervisor that
  will relaunch it, if any (``zaya run`` names itself to its ranks in ``SUPERVISOR_ENV``).
- **Removed when its run has ended.** A finished run removes its copy (the store's ``forget_ram_tier``), and so does
  a run that ends in an error no supervisor will restart (``restart_expected``), and a supervisor that gives a run
  up removes the run's directory once it has stopped the ranks (``remove``); a stopped run (exit 75) keeps it for
  the resume its exit code asks for. Whatever is left behind (a killed run, a stop never resumed) is removed by the
  next process that uses the tier on that node (``sweep``): a run directory goes once every process, launcher and
  supervisor its owner records name has provably ended, so a supervised job's crash-restart still finds its copy.
  A directory without owner records (an older zaya's) is left alone.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
from pathlib import Path
from typing import Any

from zaya.core import procs
from zaya.core.fsutil import atomic_write_text, read_json

OWNER_SUFFIX = ".owner.json"
SUPERVISOR_ENV = ("ZAYA_AEGIS_SUPERVISOR_PID", "ZAYA_AEGIS_SUPERVISOR_START")
"""``zaya run`` hands every rank its pid and process start time in these (``zaya.aegis.lineage``, restated here:
the checkpoint store sits below Aegis; a test holds the two to the same names)."""
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torchrun for its workers, whose parent is then the torchrun agent."""


def problem(directory: Path) -> str | None:
    """Why the RAM tier must not use ``directory`` (its root, or a run's directory in it), or None: a link, not a
    directory, another user's, or writable by others. A directory that does not exist yet is fine (``make_private``
    creates it)."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{directory} cannot be examined ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return f"{directory} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    if st.st_uid != os.getuid():
        return f"{directory} belongs to user id {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"{directory} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def make_private(root: Path, directory: Path) -> None:
    """Create ``root`` and ``directory`` (in it) mode 0700 if missing, then check both; PermissionError (naming the
    directory) when either is not this user's alone, including one another process made first."""
    for path in (root, directory):
        try:
            path.mkdir(mode=0o700, parents=path is root)
        except FileExistsError:
            pass
        why = problem(path)
        if why is not None:
            raise PermissionError(f"{why}: not used for the RAM tier")


def restart_expected(exit_code: int) -> bool:
    """Whether a supervisor will relaunch this process after it ends with ``exit_code``: ``zaya run`` named itself
    in the environment and still runs (and the code is not a config or data error, on which it gives up at once),
    or torchrun has restarts left."""
    if exit_code in (2, 3):
        return False
    if _supervisor() is not None and procs.gone(_supervisor()) is False:
        return True
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < int(
            os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return False


def _supervisor() -> dict[str, Any] | None:
    pid, started = (os.environ.get(name) for name in SUPERVISOR_ENV)
    if not pid or not started:
        return None
    return {"host": socket.gethostname(), "pid": pid, "started": started}


def owner_record() -> dict[str, Any]:
    """This process, the torchrun agent that launched it (if any) and its supervisor (if any)."""
    launcher = None
    if os.environ.get(TORCHRUN_ENV):
        try:
            launcher = procs.record(os.getppid())
        except Exception:  # noqa: BLE001 - a parent that just exited: no launcher to wait for
            launcher = None
    return {"process": procs.record(), "launcher": launcher, "supervisor": _supervisor()}


def claim(directory: Path, rank: int) -> None:
    """Record this process as the owner of rank ``rank``'s copy in ``directory`` (written atomically)."""
    atomic_write_text(directory / f"rank-{rank:05d}{OWNER_SUFFIX}", json.dumps(owner_record()) + "\n")


def release(directory: Path, rank: int) -> None:
    (directory / f"rank-{rank:05d}{OWNER_SUFFIX}").unlink(missing_ok=True)


def ended(directory: Path) -> bool:
    """Whether the run of ``directory`` has provably ended on this node: it has owner records, and every process,
    launcher and supervisor they name has ended (one that this host cannot judge counts as running)."""
    records = []
    for path in directory.glob(f"rank-*{OWNER_SUFFIX}"):
        try:
            records.append(read_json(path))
        except (OSError, ValueError):
            return False  # being written, or unreadable (not JSON, nested past the parser's depth): not provably ended
    if not records:
        return False
    for rec in records:
        if not isinstance(rec, dict):
            return False
        for who in ("process", "launcher", "supervisor"):
            try:
                if rec.get(who) is not None and procs.gone(rec[who]) is not True:
                    return False
            except OverflowError:  # a pid or start time no process has (an infinite one): not provably ended
                return False
    return True


def remove(directory: Path) -> bool:
    """Remove one run's directory of the tier (every copy of that run on this node), for the supervisor that gave
    the run up once its processes are gone: nothing will restart from it, and the memory would stay taken until
    another run on the node used the tier. Nothing is touched under a root or directory that is not this user's
    alone. Whether it was removed."""
    if problem(directory.parent) is not None or problem(directory) is not None or not directory.is_dir():
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return not directory.exists()


def sweep(root: Path, keep: Path) -> list[Path]:
    """Remove the run directories under ``root`` (``keep``, this run's own, aside) whose runs have ended; the
    directories removed. Nothing is touched under a root that is not this user's alone."""
    if problem(root) is not None or not root.is_dir():
        return []
    removed = []
    for directory in sorted(root.iterdir()):
        if directory == keep or directory.is_symlink() or not directory.is_dir() or problem(directory) is not None:
            continue
        if ended(directory):
            shutil.rmtree(directory, ignore_errors=True)
            if not directory.exists():
                removed.append(directory)
    return removed
