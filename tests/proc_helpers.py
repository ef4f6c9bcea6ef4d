"""Helpers for tests of processes: the record of a process that has ended, a training stopped by SIGTERM, and a
file-size limit (a full disk) around a call in the test process."""

from __future__ import annotations

import contextlib
import subprocess
import sys


def ended_process() -> dict:
    """The owner record (``zaya.core.procs.record``) of a process that ran and has ended: its pid free now, or
    another process's."""
    from zaya.core import procs

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        rec = procs.record(child.pid)
    finally:
        child.kill()
        child.wait()
    assert procs.gone(rec) is True
    return rec


def sigterm_after_two_steps(run, *zaya_args: str, preexec_fn=None) -> tuple[int, str]:
    """Start ``zaya ZAYA_ARGS...`` (a training of ``run``), SIGTERM it once metrics.jsonl holds two steps; its exit
    code and output."""
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "zaya", *zaya_args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=preexec_fn)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count('"train"') >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past ``limit`` bytes fail with EFBIG (as a full disk fails them with ENOSPC) while the block runs in
    this process; SIGXFSZ ignored, as Python ignores it in every process it starts."""
    import resource
    import signal

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
