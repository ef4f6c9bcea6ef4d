"""Who may use a run directory (what lives in it is named in ``zaya.core.layout``; its locks, job.lock and
rank0.lock, in ``zaya.train.run_lock``).

A run directory belongs to one config: resuming with a config that differs in a key that changes what is computed
(any field not declared ``resumable`` in zaya.config) is refused, naming the keys. It belongs to one job at a time:
``prepare_run_dir`` takes its lock first, so a second job there is refused naming the holder.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from zaya.config import Config, config_differences, dump_config, load_config
from zaya.core.errors import ConfigError
from zaya.core.layout import CHECKPOINTS, CONFIG_FILE
from zaya.train.run_lock import LOCK_FILES, RunLock, lock_run_dir


def prepare_run_dir(run_dir: Path, config: Config, resume: str, log: Callable[[str], None], role: str = "rank0",
                    job: str | None = None, accept: str | None = None) -> RunLock:
    """Take the run directory (its lock, for ``role``: ``zaya.train.run_lock.lock_run_dir``), refuse one owned by
    a different config, move an old run aside with ``--resume never`` (only the lock's own holder does: a
    supervisor's ranks leave that to it), write config.toml. Returns the lock, to be released when the job ends."""
    existing = run_dir / CONFIG_FILE
    if resume != "never" and not existing.is_file() and run_dir.exists() \
            and any(p.name not in (CHECKPOINTS, *LOCK_FILES) for p in run_dir.iterdir()):
        raise ConfigError(f"{run_dir} exists and is not a zaya run directory (no {CONFIG_FILE}); choose another "
                          "--run-dir")
    lock = lock_run_dir(run_dir, role, log, job=job, accept=accept)
    try:
        if resume == "never":
            if lock.owned and any(p.name not in LOCK_FILES for p in run_dir.iterdir()):
                lock = _move_aside(run_dir, lock, role, log)
        elif existing.is_file():
            _check_config(run_dir, existing, config)
        dump_config(config, run_dir / CONFIG_FILE)
    except BaseException:
        lock.release()
        raise
    return lock


def _check_config(run_dir: Path, existing: Path, config: Config) -> None:
    try:
        old = load_config(existing)
    except ConfigError as err:
        raise ConfigError(f"{run_dir} holds a run whose {CONFIG_FILE} cannot be read ({err}); use "
                          "--resume never to move it aside, or another --run-dir") from None
    diff = config_differences(old, config)
    if diff:
        shown = ", ".join(diff[:6]) + (" ..." if len(diff) > 6 else "")
        raise ConfigError(f"{run_dir} belongs to a run with a different config ({shown} differ); resume it "
                          f"with its own config ({existing}), or pass --resume never (moves it aside) or "
                          "another --run-dir")


def _move_aside(run_dir: Path, lock: RunLock, role: str, log: Callable[[str], None]) -> RunLock:
    """``--resume never``: rename the old run (still locked by us, so no other job is in it) to
    ``NAME.replaced-STAMP``, then take the new, empty directory; returns its lock."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
    n = 1
    while aside.exists():
        aside, n = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}-{n}"), n + 1
    run_dir.rename(aside)
    log(f"--resume never: moved the previous run in {run_dir} to {aside}")
    try:
        return lock_run_dir(run_dir, role, log, job=lock.job)
    finally:
        lock.release()  # the lock of the directory now at ``aside``
