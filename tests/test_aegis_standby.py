"""The warm standby's rank side (zaya.aegis.standby): a waiting rank goes on with the --resume of the go file,
ends quietly when its supervisor is gone, and refuses a go file it cannot read. The supervisor side (started
ahead, released on a restart, never leaked) is exercised end to end in test_aegis_runs.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from zaya.aegis.lineage import SUPERVISOR_PID_ENV, SUPERVISOR_START_ENV
from zaya.aegis.standby import STANDBY_ENV, wait_for_go, write_go


def test_a_waiting_rank_goes_on_with_the_resume_of_the_go_file(tmp_path):
    go = tmp_path / "standby-001.go"
    timer = threading.Timer(0.3, write_go, args=(go, "/runs/a/checkpoints/step-00000040"))
    timer.start()
    t0 = time.monotonic()
    assert wait_for_go(go, poll_s=0.01) == "/runs/a/checkpoints/step-00000040"
    assert 0.25 < time.monotonic() - t0 < 5
    timer.join()


def test_a_standby_whose_supervisor_is_gone_exits_by_itself(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs
    code = ("import os, sys; from zaya.aegis.standby import wait_for_go; "
            "wait_for_go(os.environ['ZAYA_AEGIS_STANDBY']); sys.exit(3)")
    env = {**os.environ, STANDBY_ENV: str(tmp_path / "never.go"), SUPERVISOR_PID_ENV: str(gone.pid),
           SUPERVISOR_START_ENV: repr(time.time())}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr  # 3 would mean it went on as if released
    assert time.monotonic() - t0 < 60 and done.stdout == ""


def test_a_go_file_that_is_not_one_is_refused_with_its_path(tmp_path):
    go = tmp_path / "standby-002.go"
    go.write_text("{not json")
    with pytest.raises(RuntimeError, match="standby-002.go: not a standby go file"):
        wait_for_go(go)
