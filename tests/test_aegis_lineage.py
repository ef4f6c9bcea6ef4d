"""A supervised job ends with its supervisor, and a pid is signalled only while it is the rank it was
(zaya.aegis.lineage, zaya.aegis.chaos): ``zaya chaos`` refuses an exited heartbeat, a reused pid, an unrelated
process; a supervisor counts as gone once it exited, is a zombie or its pid was reused; end to end, a second
``zaya run`` on a supervised directory is refused, and after ``kill -9`` of ``zaya run`` its torchrun agents and
ranks stop within seconds (with a checkpoint) and a new ``zaya run`` resumes with every step recorded once (warning
once about each file beside its rank's heartbeat that is not a heartbeat, as test_aegis_hostile.py describes)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from test_aegis_hostile import assert_warned_once_per_vandal_file, sleeper, vandal  # noqa: F401 - sleeper: a fixture
from test_aegis_runs import SETTINGS, aegis_table, leftover_processes
from zaya.aegis.chaos import request
from zaya.aegis.heartbeat import Heartbeat, heartbeat_dir, read_heartbeats
from zaya.aegis.lineage import (STOP_GRACE_ENV, SUPERVISOR_PID_ENV, SUPERVISOR_START_ENV, parent_death_signal,
                                supervisor_gone)
from zaya.core.errors import ConfigError


def write_heartbeat(run: Path, rank: int, **fields) -> None:
    directory = heartbeat_dir(run / "aegis")
    directory.mkdir(parents=True, exist_ok=True)
    doc = {"rank": rank, "host": socket.gethostname(), "phase": "train", "step": 5, "attempt": 0, "time": time.time(),
           **fields}
    (directory / f"rank-{rank:05d}.json").write_text(json.dumps(doc))


def test_chaos_signals_no_process_that_is_not_the_live_rank(tmp_path, sleeper):
    run = tmp_path / "run"
    started = psutil.Process(sleeper.pid).create_time()
    cases = {  # what a heartbeat says -> why the signal is refused
        "exited": ({"pid": sleeper.pid, "started": started, "phase": "exited", "exit_code": 0}, "has exited"),
        "reused": ({"pid": sleeper.pid, "started": started - 3600}, "no longer runs the process started"),
        "unrelated": ({"pid": sleeper.pid, "started": started}, "is not a zaya rank (it runs: sleep 300)"),
        "elsewhere": ({"pid": sleeper.pid, "started": started, "host": "another-node"}, "runs on host another-node"),
        "unchecked": ({"pid": sleeper.pid}, "no process start time"),
    }
    for rank, (fields, why) in enumerate(cases.values()):
        write_heartbeat(run, rank, **fields)
        for kind in ("kill", "hang"):
            with pytest.raises(ConfigError, match=re.escape(why)):
                request(run, kind, rank)
    assert sleeper.poll() is None and psutil.Process(sleeper.pid).status() != psutil.STATUS_STOPPED
    out = subprocess.run([sys.executable, "-m", "zaya", "chaos", "inject", str(run), "kill", "--rank", "0"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "has exited" in out.stderr and "Traceback" not in out.stderr
    assert sleeper.poll() is None


def test_chaos_signals_a_live_rank(tmp_path):
    """A process that is what its heartbeat says (a `zaya train` command line, its own start time) is signalled."""
    code = "import time; time.sleep(300)"
    rank = subprocess.Popen([sys.executable, "-c", code, "-m", "zaya", "train"])
    try:
        while "train" not in psutil.Process(rank.pid).cmdline():  # until it has exec'd
            time.sleep(0.01)
        write_heartbeat(tmp_path / "run", 1, pid=rank.pid, started=psutil.Process(rank.pid).create_time())
        assert "SIGKILL to rank 1" in request(tmp_path / "run", "kill", 1)
        assert rank.wait(timeout=10) == -signal.SIGKILL
    finally:
        rank.kill()


def test_a_heartbeat_records_the_process_start_time(tmp_path):
    Heartbeat(tmp_path)
    (hb,) = read_heartbeats(tmp_path).values()
    assert hb["pid"] == os.getpid() and hb["started"] == psutil.Process().create_time()


def test_a_supervisor_is_gone_once_exited_a_zombie_or_its_pid_reused(sleeper):
    me = {SUPERVISOR_PID_ENV: str(os.getpid()), SUPERVISOR_START_ENV: repr(psutil.Process().create_time())}
    assert not supervisor_gone(me) and not supervisor_gone({})
    assert supervisor_gone({**me, SUPERVISOR_START_ENV: repr(psutil.Process().create_time() - 3600)})
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    env = {SUPERVISOR_PID_ENV: str(zombie.pid), SUPERVISOR_START_ENV: repr(psutil.Process(zombie.pid).create_time())}
    assert not supervisor_gone(env)
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not reaped yet
        time.sleep(0.01)
    assert supervisor_gone(env)
    zombie.wait()
    assert supervisor_gone(env)


@pytest.mark.skipif(parent_death_signal() is None, reason="parent-death signals are Linux only")
def test_a_child_armed_with_the_parent_death_signal_dies_with_its_parent(tmp_path):
    """The supervisor's launch of torchrun, in miniature: a parent starts a child with parent_death_signal() and
    is SIGKILLed; the child, which would sleep on, dies at once."""
    code = ("import subprocess, sys, time; from zaya.aegis.lineage import parent_death_signal; "
            "c = subprocess.Popen(['sleep', '300'], preexec_fn=parent_death_signal()); print(c.pid, flush=True); "
            "time.sleep(300)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    assert still_running([child], timeout=10) == []


def test_an_orphaned_rank_stops_itself_when_its_supervisor_is_gone(tmp_path):
    """The portable path, for ranks a parent-death signal cannot reach: a process running watch_supervisor()
    whose supervisor has exited gets SIGTERM (a trainer checkpoints on it) within a few seconds."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    code = ("import signal, sys, time; from zaya.aegis.lineage import watch_supervisor; "
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75)); watch_supervisor(0.1); time.sleep(300)")
    env = {**os.environ, SUPERVISOR_PID_ENV: str(gone.pid), SUPERVISOR_START_ENV: repr(time.time()),
           STOP_GRACE_ENV: "30"}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 75 and "the supervisor (pid" in done.stderr and time.monotonic() - t0 < 30
    # one that ignores SIGTERM (a rank stuck in a step) is SIGKILLed after the grace
    env[STOP_GRACE_ENV] = "0.5"
    stuck = code.replace("lambda *a: sys.exit(75)", "signal.SIG_IGN")
    assert subprocess.run([sys.executable, "-c", stuck], env=env, timeout=60).returncode == -signal.SIGKILL


def still_running(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``procs`` still running after up to ``timeout`` s (an exited process whose new parent has not
    reaped it yet, a zombie, counts as ended)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _zaya_run(cfg: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "zaya", "run", "--config", str(cfg), *SETTINGS, "--max-steps", str(steps),
            "--quiet", *extra]


def test_supervisor_death_stops_its_ranks_and_a_new_run_resumes_once(tmp_path, micro_config):
    """kill -9 of `zaya run` (2 ranks): the second `zaya run` meanwhile was refused naming it; its torchrun
    agents and ranks (a warm standby's too) are gone within seconds, the ranks having stopped with a checkpoint;
    a new `zaya run` resumes there and every step is recorded exactly once."""
    watched = tmp_path / "kern.log"
    watched.touch()
    run = tmp_path / "run"
    cfg = micro_config(run, extra=aegis_table(watched, graceful_stop_s=20.0))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZAYA_STRICT_DEVICES": "1"}
    log = tmp_path / "supervisor.log"
    with open(log, "w") as out:
        sup = subprocess.Popen(_zaya_run(cfg, 400, "--nproc-per-node", "2"), env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 180
        while not (run / "job.lock").is_file() or f'"pid": {sup.pid},' not in (run / "job.lock").read_text():
            assert sup.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        second = subprocess.run(_zaya_run(cfg, 400), env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and f"pid {sup.pid} on host" in second.stderr, second.stderr[-2000:]
        while not all(hb.get("step", 0) >= 2 for hb in read_heartbeats(run / "aegis").values()) \
                or len(read_heartbeats(run / "aegis")) < 2:
            assert sup.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        family = psutil.Process(sup.pid).children(recursive=True)  # torchrun agent(s), ranks, any standby
        ranks = {hb["pid"] for hb in read_heartbeats(run / "aegis").values()}
        assert ranks <= {p.pid for p in family} and len(family) >= 3
        sup.kill()
        sup.wait()
        killed = time.monotonic()
        alive = still_running(family, timeout=20)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        while leftover_processes(tmp_path):  # also a standby rank its agent started after the snapshot
            assert time.monotonic() - killed < 20, leftover_processes(tmp_path)
            time.sleep(0.1)
        print(f"after kill -9 of the supervisor, its {len(family)} processes were gone in "
              f"{time.monotonic() - killed:.1f} s")
    finally:  # on a failure, leave nothing of this test running (its processes name tmp_path)
        if sup.poll() is None:
            sup.kill()
        for p in psutil.process_iter(["cmdline"]):
            if str(tmp_path) in " ".join(p.info["cmdline"] or []):
                p.kill()
    beats = read_heartbeats(run / "aegis")
    assert {hb["phase"] for hb in beats.values()} == {"exited"} and {hb["exit_code"] for hb in beats.values()} \
        == {75}, beats  # each rank stopped as on a supervisor's SIGTERM: checkpoint, exit 75
    stopped = max(hb["step"] for hb in beats.values())

    # one rank (the checkpoint reshards) and no standby: the cheapest relaunch that proves the point; meanwhile
    # files that are not heartbeats appear beside its rank's (test_aegis_hostile.py): warned about, ignored
    with vandal(run):
        done = subprocess.run(_zaya_run(cfg, stopped + 2, "--set", "aegis.warm_standby=false"), env=env,
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert_warned_once_per_vandal_file(run, done.stderr)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == list(range(1, stopped + 3))  # no step twice: the killed job's and the new one's timelines
