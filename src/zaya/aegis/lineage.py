"""A supervised job's processes end with their supervisor, and a pid is trusted only while it names the process
it named.

``zaya run`` hands its identity (pid and process start time, ``supervisor_env``) to everything it launches. Its
torchrun agents get a parent-death signal (``parent_death_signal``: Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``):
when the supervisor dies, even by SIGKILL, its agents die at once. SIGKILL, not torchrun's own SIGTERM shutdown:
that one stops the ranks too, but the agent then lingered 8 s after its ranks had exited (measured on a CPU node),
and the ranks stop themselves anyway. The ranks are the agent's children, beyond a parent-death signal's reach,
so each runs ``watch_supervisor``: a thread that looks every second whether the supervisor still runs (the
portable path, the only one off Linux) and, once it is gone, stops the rank as a supervisor's SIGTERM would (it
finishes its step, checkpoints, exits 75), and SIGKILLs it when that took longer than the supervisor's
``graceful_stop_s``. A warm standby's waiting ranks use the same check (``zaya.aegis.standby``).

A supervisor counts as gone when its pid no longer runs, is a zombie, or runs a process started at another time
(the pid was reused): ``zaya.core.procs``, which every such judgement in zaya shares.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Mapping

import psutil

from zaya.core import procs

SUPERVISOR_PID_ENV = "ZAYA_AEGIS_SUPERVISOR_PID"
"""Set by the supervisor for every process it launches: its pid. (``zaya.checkpoint.ram_owners``, a floor below,
reads this variable and the next one by name too: a RAM-tier copy lives while its supervisor may resume it.)"""
SUPERVISOR_START_ENV = "ZAYA_AEGIS_SUPERVISOR_START"
"""With the pid: the supervisor's process start time (psutil ``create_time``), so a reused pid is not mistaken."""
STOP_GRACE_ENV = "ZAYA_AEGIS_STOP_GRACE_S"
"""With the pid: how long an orphaned rank may take to stop gracefully before it is killed (aegis.graceful_stop_s)."""
CHECK_S = 1.0
_PR_SET_PDEATHSIG = 1


def live_process(pid: int, started: float) -> psutil.Process | None:
    """The process with ``pid`` on this host when it still is the one started at ``started`` (``zaya.core.procs``);
    None otherwise. The returned handle refuses to signal a process that later takes the same pid (psutil)."""
    if procs.gone({"host": socket.gethostname(), "pid": pid, "started": started}) is not False:
        return None
    try:
        return psutil.Process(int(pid))
    except psutil.Error:
        return None


def supervisor_env(grace_s: float) -> dict[str, str]:
    """The supervisor's side: what it sets for every process it launches."""
    me = procs.record()
    return {SUPERVISOR_PID_ENV: str(me["pid"]), SUPERVISOR_START_ENV: repr(me["started"]),
            STOP_GRACE_ENV: repr(float(grace_s))}


def supervisor_gone(environ: Mapping[str, str] | None = None) -> bool:
    """True when this process was started by a supervisor that has provably ended; False while it runs, or when
    no supervisor is named (``zaya train`` on its own) or the variables do not parse (nothing to judge)."""
    environ = os.environ if environ is None else environ
    if not environ.get(SUPERVISOR_PID_ENV):
        return False
    return procs.gone({"host": socket.gethostname(), "pid": environ.get(SUPERVISOR_PID_ENV),
                       "started": environ.get(SUPERVISOR_START_ENV)}) is True


def parent_death_signal(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for a child that must get ``sig`` when its parent dies (Linux; None elsewhere). The libc
    call is looked up here, before the fork, so the child runs only the call itself; a parent that died before
    the call took effect is caught by comparing the parent pid."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return arm


def watch_supervisor(check_s: float = CHECK_S) -> threading.Thread | None:
    """The rank's side (``zaya train`` under ``zaya run``): a daemon thread that stops this process when its
    supervisor is gone (SIGTERM to itself: the trainer checkpoints and exits 75; SIGKILL after the grace). None
    when no supervisor is named."""
    if not os.environ.get(SUPERVISOR_PID_ENV):
        return None
    try:
        grace = float(os.environ.get(STOP_GRACE_ENV) or 60.0)
    except ValueError:
        grace = 60.0

    def watch() -> None:
        while not supervisor_gone():
            time.sleep(check_s)
        print(f"zaya: the supervisor (pid {os.environ.get(SUPERVISOR_PID_ENV)}) is gone: stopping this rank "
              f"(pid {os.getpid()}) with a checkpoint; killed in {grace:g} s if not stopped", file=sys.stderr,
              flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="zaya-supervisor-watch", daemon=True)
    thread.start()
    return thread
