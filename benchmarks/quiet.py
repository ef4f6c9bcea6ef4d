"""Waiting for a quiet machine before timing: these benchmarks run on shared, noisy VMs (imported by the scripts
in this directory, which run with it on sys.path)."""

from __future__ import annotations

import os
import time


def cpu_busy(interval: float = 0.5) -> float:
    """Share of the machine's CPU time that was busy (any process) over ``interval`` seconds, from /proc/stat."""

    def read():
        v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return sum(v), v[3] + v[4]

    t0, i0 = read()
    time.sleep(interval)
    t1, i1 = read()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def wait_quiet(max_busy: float, timeout: float) -> bool:
    """Wait up to ``timeout`` s until the machine is at most ``max_busy`` busy; whether it got there."""
    if timeout <= 0 or not os.path.exists("/proc/stat"):
        return True
    start = time.time()
    while time.time() - start < timeout:
        if cpu_busy() <= max_busy:
            return True
    return False
