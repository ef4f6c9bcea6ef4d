"""One writer per run directory (zaya.train.run_lock, zaya.train.run_dir): a second job is refused at once naming
the holder's pid and host, a lock file left by a dead holder never blocks, a supervisor's own ranks are let in,
``--resume never`` never moves a directory another job holds, and end to end a second ``zaya train`` on a
directory a running one trains in is refused while the first trains on undisturbed.

The holders are small processes that only take the lock (no torch): fast."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from zaya.config import Config
from zaya.core.errors import ConfigError
from zaya.train.run_dir import prepare_run_dir
from zaya.train.run_lock import JOB_ENV, JOB_LOCK, RANK0_LOCK, lock_run_dir

HOLD = ("import sys, time; from zaya.train.run_lock import lock_run_dir; "
        "lock_run_dir(sys.argv[1], sys.argv[2], print, job=sys.argv[3] or None); print('held', flush=True); "
        "time.sleep(600)")


def quiet(text: str) -> None:
    pass


class Holder:
    """Another process holding ``run_dir`` as ``role`` (with job id ``job``) until killed."""

    def __init__(self, run_dir: Path, role: str, job: str = ""):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), role, job], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.strip() == "held", self.proc.stderr.read()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def holders():
    made: list[Holder] = []

    def make(*args) -> Holder:
        made.append(Holder(*args))
        return made[-1]

    yield make
    for h in made:
        if h.proc.poll() is None:
            h.kill()


def test_a_second_job_is_refused_naming_the_holder_and_a_dead_holders_file_never_blocks(tmp_path, holders):
    run = tmp_path / "run"
    first = holders(run, "rank0")  # an unsupervised `zaya train`
    for role in ("rank0", "supervisor"):
        with pytest.raises(ConfigError) as err:
            lock_run_dir(run, role, quiet)
        text = str(err.value)
        assert f"pid {first.proc.pid} on host {socket.gethostname()}" in text and f"kill {first.proc.pid}" in text
        assert str(run) in text and "--run-dir" in text
    assert json.loads((run / JOB_LOCK).read_text())["pid"] == first.proc.pid  # the refused left it as it was
    first.kill()  # SIGKILL: its lock file still names it, but the kernel let go of the lock
    assert json.loads((run / JOB_LOCK).read_text())["pid"] == first.proc.pid
    with lock_run_dir(run, "rank0", quiet) as mine:
        assert mine.owned and json.loads((run / JOB_LOCK).read_text())["pid"] == os.getpid()
    assert (run / JOB_LOCK).read_text() == ""  # released: no stale holder to read


def test_a_hand_written_lock_file_naming_a_live_process_does_not_block(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    record = {"pid": os.getppid(), "host": socket.gethostname(), "job": "x", "role": "`zaya run`"}
    for name in (JOB_LOCK, RANK0_LOCK):
        (run / name).write_text(json.dumps(record))
    lock_run_dir(run, "rank0", quiet).release()


def test_a_supervisors_ranks_are_let_in_and_other_jobs_are_not(tmp_path, holders, monkeypatch):
    run = tmp_path / "run"
    supervisor = holders(run, "supervisor", "job-A")
    with pytest.raises(ConfigError, match=f"pid {supervisor.proc.pid}"):
        lock_run_dir(run, "rank0", quiet, accept="job-B")  # a rank of another supervisor
    monkeypatch.setenv(JOB_ENV, "job-A")  # what `zaya run` hands its ranks
    rank0 = lock_run_dir(run, "rank0", quiet)
    assert not rank0.owned and [h.path.name for h in rank0.held] == [RANK0_LOCK]
    # The next attempt's rank 0 waits for the killed previous one of its own job to let go.
    threading.Timer(0.3, rank0.release).start()
    t0 = time.monotonic()
    relaunched = lock_run_dir(run, "rank0", quiet)
    assert 0.25 < time.monotonic() - t0 < 10
    # The supervisor dies; its rank 0 still trains: a new supervisor must not start a second timeline.
    supervisor.kill()
    monkeypatch.delenv(JOB_ENV)
    with pytest.raises(ConfigError) as err:
        lock_run_dir(run, "supervisor", quiet)
    assert f"pid {os.getpid()}" in str(err.value) and "still trains there" in str(err.value)
    relaunched.release()
    lock_run_dir(run, "supervisor", quiet).release()


def test_resume_never_does_not_move_a_directory_another_job_holds(tmp_path, holders):
    run = tmp_path / "run"
    config = Config()
    prepare_run_dir(run, config, "auto", quiet).release()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    other = holders(run, "supervisor")
    with pytest.raises(ConfigError, match=f"pid {other.proc.pid}"):
        prepare_run_dir(run, config, "never", quiet)
    assert (run / "metrics.jsonl").is_file() and not list(tmp_path.glob("run.replaced-*"))
    other.kill()
    lock = prepare_run_dir(run, config, "never", quiet)
    (aside,) = tmp_path.glob("run.replaced-*")
    assert (aside / "metrics.jsonl").is_file() and not (run / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):  # the new directory is held, by us
        lock_run_dir(run, "supervisor", quiet)
    lock.release()


def test_a_lock_file_that_is_a_link_is_refused_not_followed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (run / JOB_LOCK).symlink_to(target)
    with pytest.raises(ConfigError, match="not a link"):
        lock_run_dir(run, "rank0", quiet)
    assert target.read_text() == "keep me"


def test_a_second_zaya_train_is_refused_while_the_first_trains_on(tmp_path, micro_config, capsys):
    """End to end: the first `zaya train` is paused (SIGSTOP) once it has trained a step, so that it surely holds
    the directory while the second starts; the second (through main in this process: a subprocess would only add a
    torch start-up) is refused with the first's pid, and the first, continued, finishes every step exactly once."""
    from zaya.cli import main

    run = tmp_path / "run"
    cfg = micro_config(run)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "zaya", "train", "--config", str(cfg), "--set", "train.sample_tokens=0", "--set",
           "train.max_steps=3", "--set", "train.eval_every=0"]
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() or '"kind": "train"' not in (run / "metrics.jsonl").read_text():
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)
        try:
            capsys.readouterr()
            second_code = main(cmd[3:])
            second_err = capsys.readouterr().err
        finally:
            first.send_signal(signal.SIGCONT)
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert second_code == 2, second_err
    assert f"pid {first.pid} on host {socket.gethostname()}" in second_err and "Traceback" not in second_err
    assert first.returncode == 0, out
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == [1, 2, 3]
