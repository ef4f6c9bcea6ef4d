"""One writer per run directory: two ``flock`` locks in it, so that a second job there is refused at once.

    <run_dir>/job.lock     held by the job: the supervisor (``zaya run``) for its whole life, or ``zaya train``'s
                           rank 0 when no supervisor runs it
    <run_dir>/rank0.lock   held by rank 0 of the job while it trains (its peers write checkpoint shards only at
                           rank 0's pace, through collectives)

The kernel's lock is the truth: it is released when its holder exits, however it exits (a SIGKILL too), so a lock
file left by a dead holder never blocks. The file's content (pid, host, since, command, job) only tells a refused
job who holds it. Files are never deleted (deleting a lock file while another process waits on its inode would let
two holders in).

A supervisor's ranks are not refused by their supervisor's lock: the supervisor hands them its job id in
``ZAYA_RUN_JOB`` (a fresh random id per supervisor; on a multi-node job the rendezvous id and endpoint, which every
node's supervisor derives alike), and a rank 0 that finds ``job.lock`` held with that id goes on (the job is its
own). ``rank0.lock`` is always taken by rank 0 itself; a new supervisor checks it is free (not held by the ranks of
a job whose supervisor died) before it launches. Rank 0 of a relaunch waits a moment for the killed rank 0 of the
previous attempt of its own job to let go.

Shared filesystems: Linux implements ``flock`` on NFS (v3 with lockd, v4) as a whole-file lock the server keeps,
so it holds across nodes; Lustre needs the ``flock`` mount option (``localflock`` locks per node only); a
filesystem without locks (ENOLCK, EOPNOTSUPP) gets a warning and no lock (docs/operations.md).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from zaya.core.errors import ConfigError
from zaya.core.fsutil import loads_json

JOB_LOCK = "job.lock"
RANK0_LOCK = "rank0.lock"
LOCK_FILES = (JOB_LOCK, RANK0_LOCK)
JOB_ENV = "ZAYA_RUN_JOB"
"""Set by ``zaya run`` for its ranks: the job id written in the ``job.lock`` it holds."""
PREVIOUS_RANK0_WAIT_S = 30.0
"""How long rank 0 waits for the previous attempt's rank 0 of its own job (killed by the supervisor) to let go."""
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class _Flock:
    """An exclusive, non-blocking ``flock`` on one file; ``holder`` is what the file said when it was held."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None
        self.holder: dict[str, Any] = {}
        self.unsupported = ""

    def take(self, record: dict[str, Any]) -> bool:
        """Try once: True when taken (the record written into the file), or when the filesystem has no locks
        (``unsupported`` says why); False when someone holds it (``holder`` filled in)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as exc:
            raise ConfigError(f"{self.path}: cannot open the run directory's lock file ({exc.strerror or exc}); "
                              "the run directory must be a writable directory and its lock file a plain file "
                              "(not a link): remove it, or choose another --run-dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                self.holder = _read_record(fd)
                os.close(fd)
                return False
            if exc.errno not in _UNSUPPORTED:
                os.close(fd)
                raise
            self.unsupported = os.strerror(exc.errno)
            os.close(fd)
            return True
        try:  # who holds it, for a refused job's message; the lock itself is already ours
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        except OSError:
            pass
        self.fd = fd
        return True

    def release(self) -> None:
        """Empty the file (a later reader sees no stale holder), then let go. Idempotent."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)  # closing the one descriptor releases the lock


def _read_record(fd: int) -> dict[str, Any]:
    """The holder's record; a holder that is still writing it gets a few tries; {} when there is none."""
    for _ in range(20):
        try:
            text = os.pread(fd, 1 << 16, 0).decode("utf-8", "replace")
            if text:
                doc = loads_json(text)
                return doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    return {}


def describe_holder(doc: dict[str, Any]) -> str:
    """'`zaya run` (pid 123 on host h, since 2025-01-01T00:00:00Z, command: ...)' for a lock file's record."""
    if not doc.get("pid"):
        return "a process that has not said who it is (its lock file is empty: it is starting)"
    command = str(doc.get("command") or "")
    command = command if len(command) <= 200 else command[:200] + " ..."
    return (f"{doc.get('role') or 'a zaya job'} (pid {doc['pid']} on host {doc.get('host') or '?'}, since "
            f"{doc.get('since') or '?'}{', command: ' + command if command else ''})")


def _stop_hint(doc: dict[str, Any]) -> str:
    if not doc.get("pid"):
        return "Wait a moment and run again"
    return f"Wait for it to end, or stop it (`kill {doc['pid']}` on {doc.get('host') or 'its host'}: it checkpoints " \
           "and exits), then run again"


class RunLock:
    """The locks a process holds on a run directory (see the module docstring); ``release()`` (or ``close()``)
    lets go. ``owned`` is True when this process holds ``job.lock`` itself (it may move the directory aside)."""

    def __init__(self, run_dir: Path, job: str) -> None:
        self.run_dir, self.job = run_dir, job
        self.held: list[_Flock] = []
        self.owned = False

    def release(self) -> None:
        for lock in reversed(self.held):
            lock.release()
        self.held.clear()
        self.owned = False

    close = release

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_run_dir(run_dir: Path, role: str, log: Callable[[str], None], job: str | None = None,
                 accept: str | None = None) -> RunLock:
    """Take the run directory for ``role``: "supervisor" (``zaya run``: holds job.lock, checks rank0.lock is free)
    or "rank0" (holds rank0.lock, and job.lock unless its supervisor holds it: ``accept`` or ``$ZAYA_RUN_JOB``).
    ``job`` is the id written into the locks (a fresh one when None); a job.lock held under the id ``accept`` is
    this job's own (multi-node supervisors pass their shared id). Creates the directory. Raises ConfigError naming
    the holder when another job has it."""
    run_dir = Path(run_dir)
    if accept is None and role == "rank0":
        accept = os.environ.get(JOB_ENV) or None
    job = job or accept or uuid.uuid4().hex
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"train.run_dir = {run_dir}: cannot create it ({exc.strerror or exc}); choose a writable "
                          "--run-dir") from None
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "job": job,
              "role": "`zaya run`" if role == "supervisor" else "rank 0 of `zaya train`",
              "command": " ".join(sys.argv)}
    lock = RunLock(run_dir, job)
    try:
        job_lock = _Flock(run_dir / JOB_LOCK)
        if job_lock.take(record):
            lock.held.append(job_lock)
            lock.owned = True
            _warn_unsupported(job_lock, log)
        elif not (accept and job_lock.holder.get("job") == accept):
            raise ConfigError(f"{run_dir} is in use by {describe_holder(job_lock.holder)}: two jobs in one run "
                              "directory would record every step twice and interleave their checkpoints. "
                              f"{_stop_hint(job_lock.holder)}; or choose another --run-dir")
        rank0 = _Flock(run_dir / RANK0_LOCK)
        deadline = time.monotonic() + PREVIOUS_RANK0_WAIT_S
        while not rank0.take(record):
            if rank0.holder.get("job") == job and role == "supervisor":
                break  # a multi-node peer's ranks of this very job already started
            if rank0.holder.get("job") != job or time.monotonic() > deadline:
                raise ConfigError(
                    f"{run_dir} is in use: {describe_holder(rank0.holder)} still trains there, though no "
                    "supervisor holds the directory (the ranks of a `zaya run` that died stop by themselves "
                    f"within seconds). {_stop_hint(rank0.holder)}")
            time.sleep(0.05)  # the previous attempt's rank 0 of this job, killed by its supervisor, is exiting
        if rank0.fd is not None:
            if role == "supervisor":
                rank0.release()  # only a check: the supervisor's rank 0 takes it
            else:
                lock.held.append(rank0)
    except BaseException:
        lock.release()
        raise
    return lock


def _warn_unsupported(lock: _Flock, log: Callable[[str], None]) -> None:
    if lock.unsupported:
        log(f"warning: the filesystem of {lock.path.parent} does not support file locks ({lock.unsupported}): "
            "a second job in this run directory cannot be refused; run one job at a time there")
