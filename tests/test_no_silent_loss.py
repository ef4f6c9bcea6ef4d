"""No run is silently lost: a failed closing checkpoint (final, on a signal) ends the run with exit 5 whatever
checkpoint.on_error says, on every rank, naming the step, the error and the newest good checkpoint; a full disk
at start is an error naming the directory."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys

import pytest

from dist_helpers import run_ranks
from proc_helpers import sigterm_after_two_steps

from zaya.config import load_config
from zaya.core.errors import CheckpointError

QUICK = ["--set", "train.eval_every=0", "--set", "train.sample_tokens=0"]


def _limit_file_size(limit: int):
    """A preexec_fn: writes past ``limit`` bytes fail with EFBIG (as a full disk fails them with ENOSPC)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def zaya(*args: str, limit: int | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zaya", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=None if limit is None else _limit_file_size(limit), **popen)


def fail_writes(monkeypatch, when) -> None:
    """Checkpoint files fail with ENOSPC while ``when()`` is true (the checkpoint writer's stream)."""
    from zaya.checkpoint import writer

    real = writer._ChecksummingStream.write

    def write(self, b):
        if when():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, b)

    monkeypatch.setattr(writer._ChecksummingStream, "write", write)


def fail_the_final_save(monkeypatch, where: str = "writer") -> None:
    """The final save fails with ENOSPC: while DCP writes the tensors (``writer``), or while rank 0 commits
    (``commit``: meta.json and COMMIT)."""
    from zaya.checkpoint import store

    real, state = store.CheckpointStore.save, {"final": False}

    def save(self, *args, **kwargs):
        state["final"] = kwargs.get("closing") == "final"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(store.CheckpointStore, "save", save)
    if where == "writer":
        fail_writes(monkeypatch, lambda: state["final"])
        return
    real_commit = store.write_commit

    def write_commit(*args, **kwargs):
        if state["final"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(store, "write_commit", write_commit)


# --- a failed closing checkpoint -------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_save,where", [(True, "writer"), (False, "commit")])
def test_a_failed_final_save_stops_with_the_newest_good_checkpoint_whatever_on_error_says(
        tmp_path, micro_config, monkeypatch, async_save, where):
    """With async saves the periodic save of step 2 may still be in flight when the final one starts."""
    from zaya.train.trainer import train

    fail_the_final_save(monkeypatch, where)
    run = tmp_path / "run"
    config = load_config(micro_config(run), ["train.max_steps=3", "checkpoint.every=2", "train.eval_every=0",
                                             "train.sample_tokens=0", 'checkpoint.on_error="continue"',
                                             f"checkpoint.async_save={str(async_save).lower()}"])
    logs: list[str] = []
    monkeypatch.setattr("zaya.train.callbacks.ProgressDisplay.log", lambda self, text: logs.append(text))
    with pytest.raises(CheckpointError) as err:
        train(config, resume="never")
    message = str(err.value)
    assert err.value.exit_code == 5
    assert "checkpoint of step 3 failed" in message and "No space left on device" in message, message
    assert "MiB free in" in message and f"{run / 'checkpoints' / 'step-00000002'}" in message, message
    assert not any("training goes on" in line for line in logs), logs
    from zaya.checkpoint.store import latest_checkpoint

    assert latest_checkpoint(run / "checkpoints").name == "step-00000002"


def test_zaya_train_on_a_full_disk_exits_5_never_0(tmp_path, micro_config):
    """Every save refused (the files past 200 KB): the periodic failure is a warning, the final one exit 5."""
    run = tmp_path / "run"
    proc = zaya("train", "--config", str(micro_config(run)), "--max-steps", "2", "--set", "checkpoint.every=1",
                *QUICK, limit=200_000)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 5, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("zaya: error: checkpoint of step 2 failed") and "no checkpoint at all" in last, out
    assert "File too large" in last and "MiB free in" in last, last  # the cause, in words a supervisor matches
    assert "checkpoint of step 1 failed" in out and "training goes on" in out  # the periodic one: a warning
    assert not list((run / "checkpoints").iterdir())


def test_a_sigterm_whose_checkpoint_fails_exits_5_not_75(tmp_path, micro_config):
    run = tmp_path / "run"
    code, out = sigterm_after_two_steps(run, "train", "--config", str(micro_config(run)), "--max-steps", "100000",
                                        "--set", "checkpoint.every=0", *QUICK, preexec_fn=_limit_file_size(200_000))
    assert code == 5, out
    assert "last checkpoint (stop requested (SIGTERM))" in out and "stopped at step" not in out, out


def _final_save_fails_on_rank_1(rank: int, world: int, dataset: str, root: str) -> str:
    import pytest as _pytest

    from zaya.config import config_from_dict
    from zaya.train.trainer import train

    mp = _pytest.MonkeyPatch()
    if rank == 1:
        fail_the_final_save(mp)
    import tomllib

    from conftest import MICRO_CONFIG

    data = tomllib.loads(MICRO_CONFIG.format(dataset=dataset, run_dir=root))
    data["train"].update(max_steps=2, eval_every=0, sample_tokens=0)
    data["checkpoint"].update(every=0)
    train(config_from_dict(data, "micro"), resume="never")
    return "finished"


def test_a_final_save_that_fails_on_one_rank_stops_every_rank_with_exit_5(tmp_path, shakespeare_dataset):
    results = run_ranks(_final_save_fails_on_rank_1, 2, str(shakespeare_dataset), str(tmp_path / "run"))
    for r in results:
        assert r.exit_code == 5 and "checkpoint of step 2 failed" in r.error, r.error
    assert "No space left on device" in results[0].error


# --- a full disk at start --------------------------------------------------------------------------------------------
FULL_DISK_DRIVER = """
import resource, signal, sys
import tempfile, torch, zaya.train.trainer, zaya.data.prepare, zaya.checkpoint.store  # before the limit: imports
from zaya.cli import main                                                               # write their caches
tempfile.gettempdir()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # every write of a byte fails, as on a full disk
sys.exit(main(sys.argv[1:]))
"""


def test_zaya_train_on_a_full_disk_at_start_exits_5_naming_the_run_directory(tmp_path, micro_config):
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", FULL_DISK_DRIVER, "train", "--config", str(micro_config(run)),
                          "--max-steps", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 5, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"zaya: error: preparing the run directory: {run}: File too large (")
    assert "MiB free there" in last and "train.run_dir (--run-dir)" in last and "Traceback" not in out.stderr


def test_a_metrics_file_that_cannot_be_written_is_exit_5_naming_it(tmp_path):
    from zaya.core.errors import DiskFullError
    from zaya.train.metrics import MetricsLog

    class Full:
        def write(self, text):
            return len(text)

        def flush(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self):
            self.flush()

    log = MetricsLog(tmp_path / "metrics.jsonl", True)
    log.write({"kind": "train", "step": 1})
    log._file._fh.close()
    log._file._fh = Full()
    with pytest.raises(DiskFullError) as err:
        log.write({"kind": "train", "step": 2})
    assert str(err.value).startswith(f"writing metrics.jsonl: {tmp_path}: No space left on device (")
    assert err.value.exit_code == 5
    log.close()  # what it still held is lost, and was reported: closing does not raise again
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
