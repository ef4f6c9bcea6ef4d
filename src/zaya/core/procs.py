"""Which recorded processes still run: how a file left behind (a killed prepare's temporary folder, a RAM-tier
copy) is told apart from one a live process is still using.

A pid alone names nothing for long: the kernel hands it to a new process once its own is gone. So a process is
recorded with its host and its start time (``record``), and counts as gone only when this host can prove it
(``gone``): the pid runs no process, a zombie, or a process started at another time. A record made on another
host, or one that does not parse, proves nothing either way.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import psutil

START_TOLERANCE_S = 1.0
"""Two readings of one process's start time agree within this (both derive from the boot time, which a clock step
may move)."""


def record(pid: int | None = None) -> dict[str, Any]:
    """``{"host", "pid", "started"}`` of process ``pid`` (this process by default), for ``gone`` to judge later."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "started": psutil.Process(pid).create_time()}


def gone(rec: Any) -> bool | None:
    """True when the process ``rec`` names has provably ended (recorded on this host; its pid now runs nothing, a
    zombie, or a process started at another time); False when it still runs; None when this host cannot tell."""
    try:
        host, pid, started = rec["host"], int(rec["pid"]), float(rec["started"])
    except (KeyError, TypeError, ValueError):
        return None
    if host != socket.gethostname():
        return None
    try:
        proc = psutil.Process(pid)
        return proc.status() == psutil.STATUS_ZOMBIE or abs(proc.create_time() - started) > START_TOLERANCE_S
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # it runs, but may not be looked at (another user's): not gone
        return False


def describe(rec: Any) -> str:
    """``pid 123 on host``, or what the record lacks."""
    try:
        return f"pid {int(rec['pid'])} on {rec['host']}"
    except (KeyError, TypeError, ValueError):
        return "an unreadable owner record"
