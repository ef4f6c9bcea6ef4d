"""A warm standby: the next attempt's processes, started ahead of time so that a restart skips the launch.

A cold relaunch costs torchrun's start-up and every rank's imports (torch, the trainer: about 3 s of the 7-10 s a
restart takes on a CPU node) before a rank even reads its checkpoint. Once a supervised job is training, the
supervisor starts the next attempt's torchrun with ``ZAYA_AEGIS_STANDBY`` set to a "go" file; each of its ranks
imports what a rank needs and then waits here, touching neither a device, nor the run directory, nor the process
group. A restart writes the go file (with the ``--resume`` the relaunch would have had) and the waiting ranks go on
as a cold launch would, only sooner. A standby whose supervisor is gone exits by itself.

The go file is written atomically (write, then rename): a rank reads either nothing or the whole decision.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

from zaya.aegis.lineage import supervisor_gone
from zaya.core.fsutil import read_json

STANDBY_ENV = "ZAYA_AEGIS_STANDBY"
"""Set by the supervisor for a standby's ranks: the go file to wait for (with the supervisor's identity,
``zaya.aegis.lineage``: a standby whose supervisor has exited ends too)."""

PRELOAD = ("zaya.train.trainer", "zaya.train.build", "zaya.checkpoint.store", "zaya.checkpoint.parts",
           "zaya.aegis.heartbeat", "zaya.aegis.directives", "zaya.aegis.chaos")
"""What a rank imports while it waits (the bulk is torch, through the trainer): the work a standby saves."""

POLL_S = 0.02


def write_go(path: Path, resume: str) -> None:
    """The supervisor's side: release the standby's ranks, to resume as ``--resume RESUME`` would."""
    from zaya.aegis.heartbeat import write_json_atomic

    write_json_atomic(Path(path), {"resume": resume, "time": time.time()})


def wait_for_go(path: str | Path, poll_s: float = POLL_S) -> str:
    """A rank's side: preload, then block until the go file appears; returns the ``--resume`` it carries. Exits
    the process (code 0, silently) when the supervisor that started the standby is gone."""
    for name in PRELOAD:
        importlib.import_module(name)
    path = Path(path)
    checked = time.monotonic()
    while True:
        try:
            return str(read_json(path)["resume"])
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(f"{path}: not a standby go file ({exc}); only the Aegis supervisor writes it") from exc
        if time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            if supervisor_gone():
                sys.exit(0)
        time.sleep(poll_s)
