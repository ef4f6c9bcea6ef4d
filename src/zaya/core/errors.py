"""zaya's error types and the exit codes ``zaya`` ends with: the contract a supervisor (a launcher, Aegis, a
cluster's job system) reads to decide what to do next.

| code | meaning                                                        | what a supervisor does                    |
|------|----------------------------------------------------------------|-------------------------------------------|
| 0    | finished                                                       | nothing                                   |
| 2    | config or input error (a bad key, a missing path, a directory   | stop; a person must fix the command        |
|      | that every rank must see but does not)                         |                                           |
| 3    | data error (a dataset missing, corrupt, or made for another     | stop; fix or re-prepare the data          |
|      | tokenizer)                                                     |                                           |
| 4    | non-finite loss or gradient                                    | resume from the named checkpoint with a   |
|      |                                                                | lower lr, or skip the batch               |
| 5    | checkpoint or storage failure (a save failed with on_error =    | free space / fix storage, then resume     |
|      | "stop", the run's final or on-signal save failed, none of the  |                                           |
|      | checkpoints can be loaded, or a disk is full: DiskFullError)   |                                           |
| 6    | collective timeout or lost peer (a rank died, hung or lost the  | replace the node, resume                  |
|      | network for longer than train.timeout_s)                       |                                           |
| 75   | interrupted by a signal; a checkpoint was written              | resume with the same command              |
| 70   | internal error: a bug (the traceback is printed)               | report it                                 |
| 130  | interrupted at once (a second Ctrl-C); nothing was saved        | resume from the newest checkpoint         |

Only zaya's own error types carry a code other than 70: an exception of any other type (a torch error inside a
training step, say) is an internal error, never mistaken for a config error. ``zaya.cli`` maps them; ``docs/
architecture.md`` has the same table.
"""

from __future__ import annotations

import errno
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

FINISHED = 0
CONFIG_ERROR = 2
DATA_ERROR = 3
NON_FINITE = 4
CHECKPOINT_ERROR = 5
COLLECTIVE_ERROR = 6
INTERNAL_ERROR = 70
INTERRUPTED = 75
INTERRUPTED_AT_ONCE = 130


class ZayaError(Exception):
    """Base of every error zaya raises on purpose; ``exit_code`` is what ``zaya`` exits with."""

    exit_code = INTERNAL_ERROR


class ConfigError(ZayaError, ValueError):
    """A configuration file, value, command-line argument or input path that breaks a rule; the message says which
    and how to fix it."""

    exit_code = CONFIG_ERROR


class DataError(ZayaError, ValueError):
    """A dataset that is missing, corrupt, or does not fit the model."""

    exit_code = DATA_ERROR


class NonFiniteLossError(ZayaError, RuntimeError):
    """A non-finite loss or gradient norm; the message names the step and the newest good checkpoint."""

    exit_code = NON_FINITE


class CheckpointError(ZayaError, ValueError):
    """A checkpoint that is missing, incomplete, corrupt, made for another model, or could not be written."""

    exit_code = CHECKPOINT_ERROR


class DiskFullError(CheckpointError):
    """A write the filesystem refused for lack of room (a full disk or quota, a file-size limit), wherever it was:
    the run directory, the data cache, a prepared dataset. Exit 5 like a failed checkpoint: the fix is the same
    (free space, then run the same command again)."""


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""No space left, quota exceeded, file too large (a file-size limit, ``ulimit -f``)."""


def disk_full(exc: BaseException, directory: str | Path, what: str, elsewhere: str = "") -> DiskFullError | None:
    """A DiskFullError for ``exc`` when it (or an exception it was raised from) is an OSError that says the
    filesystem has no room, naming ``what`` was being written, ``directory``, its free space and the fix
    (``elsewhere``: e.g. "point train.run_dir elsewhere"); None for any other error."""
    cause: BaseException | None = exc
    for _ in range(8):
        if cause is None or (isinstance(cause, OSError) and cause.errno in DISK_FULL_ERRNOS):
            break
        cause = cause.__cause__ or cause.__context__
    if cause is None or not isinstance(cause, OSError) or cause.errno not in DISK_FULL_ERRNOS:
        return None
    probe = Path(directory)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = f"{shutil.disk_usage(probe).free / 2**20:,.0f} MiB free there"
    except OSError:
        free = "its free space unknown"
    return DiskFullError(f"{what}: {directory}: {cause.strerror or cause} ({free}): the filesystem is full or "
                         "refuses a file this large; free space" + (f", or {elsewhere}" if elsewhere else "")
                         + ", then run the same command again")


@contextmanager
def writing(directory: str | Path, what: str, elsewhere: str = "") -> Iterator[None]:
    """Within it, an OSError that says the filesystem has no room becomes the ``disk_full`` error (exit 5, naming
    the directory and its free space) instead of a traceback; any other error passes unchanged."""
    try:
        yield
    except OSError as exc:
        error = disk_full(exc, directory, what, elsewhere)
        if error is None:
            raise
        raise error from exc


class CollectiveError(ZayaError, RuntimeError):
    """A collective timed out or a peer rank went away (see ``zaya.distributed.runtime.collective_error``)."""

    exit_code = COLLECTIVE_ERROR


_BY_CODE = {CONFIG_ERROR: ConfigError, DATA_ERROR: DataError, NON_FINITE: NonFiniteLossError,
            CHECKPOINT_ERROR: CheckpointError, COLLECTIVE_ERROR: CollectiveError}


def exit_code_of(exc: BaseException) -> int:
    """The exit code for an exception: a zaya error's own, 70 (internal) for anything else."""
    return exc.exit_code if isinstance(exc, ZayaError) else INTERNAL_ERROR


def error_for_code(code: int, message: str) -> ZayaError:
    """A zaya error of the kind that exits with ``code`` (how a failure on one rank is re-raised on the others, so
    that every rank of a job exits with the same code)."""
    return _BY_CODE.get(code, ZayaError)(message)
