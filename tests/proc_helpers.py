"""Helpers for tests of who owns what is left behind: the record of a process that has ended."""

from __future__ import annotations

import subprocess
import sys


def ended_process() -> dict:
    """The owner record (``zaya.procs.record``) of a process that ran and has ended: its pid free now, or
    another process's."""
    from zaya import procs

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        rec = procs.record(child.pid)
    finally:
        child.kill()
        child.wait()
    assert procs.gone(rec) is True
    return rec
