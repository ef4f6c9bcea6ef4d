"""Aegis against files it did not write: a heartbeat without a rank, a JSON list, a rank "zero", JSON nested 100,000
deep, a rank another file's name claims, ages and steps of the wrong kind; directives, events and chaos plans that
are not JSON objects. ``zaya chaos inject`` refuses to signal through such a heartbeat (exit 2 naming the file, its
process untouched; these were a KeyError, a TypeError, "invalid literal for int()" and a RecursionError), and
``zaya run`` warns, ignores the file and trains on (a corrupt heartbeat never crashes the supervisor)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from zaya.aegis.heartbeat import heartbeat_dir, parse_heartbeat, read_heartbeats
from zaya.cli import main
from zaya.core.errors import ConfigError

DEEP = "[" * 100_000 + "]" * 100_000
BAD_HEARTBEATS = {  # what the file holds -> what the refusal says about it
    "no rank": (json.dumps({"pid": 1, "time": 1.0, "phase": "train"}), "no 'rank'"),
    "a list": ("[1, 2]", "a JSON list, not an object"),
    "rank zero": (json.dumps({"rank": "zero", "pid": 1, "time": 1.0, "phase": "train"}), "rank = 'zero'"),
    "nested 100k deep": (DEEP, "nested too deeply"),
    "another rank": (json.dumps({"rank": 3, "time": 1.0, "phase": "train"}), "rank 3 in a file named rank-00000"),
    "time a string": (json.dumps({"rank": 0, "time": "now", "phase": "train"}), "time = 'now'"),
    "time infinite": ('{"rank": 0, "time": Infinity, "phase": "train"}', "time inf"),
    "huge step": (json.dumps({"rank": 0, "time": 1.0, "phase": "train", "step": 2**70}), "step = "),
    "unknown phase": (json.dumps({"rank": 0, "time": 1.0, "phase": "dancing"}), "phase 'dancing'"),
    "exit code a list": (json.dumps({"rank": 0, "time": 1.0, "phase": "exited", "exit_code": [1]}), "exit_code"),
    "not UTF-8": (b'{"rank": 0, "x": "\x80"}', "codec can't decode"),
}


@pytest.fixture
def sleeper():
    """An unrelated live process (a `sleep`): what a stale or malformed heartbeat's pid may name; never signalled."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def put(run: Path, content: str | bytes, rank: int = 0) -> Path:
    """Write a file where rank ``rank``'s heartbeat goes, whole (write, then rename) as a rank writes its own."""
    path = heartbeat_dir(run / "aegis") / f"rank-{rank:05d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(content.encode() if isinstance(content, str) else content)
    tmp.replace(path)
    return path


@pytest.mark.parametrize("case", list(BAD_HEARTBEATS))
def test_chaos_refuses_a_malformed_heartbeat_naming_it(tmp_path, sleeper, capsys, case):
    content, why = BAD_HEARTBEATS[case]
    if isinstance(content, str) and '"pid": 1' in content:
        content = content.replace('"pid": 1', f'"pid": {sleeper.pid}')
    path = put(tmp_path / "run", content)
    for kind in ("kill", "hang"):
        assert main(["chaos", "inject", str(tmp_path / "run"), kind]) == 2
        err = capsys.readouterr().err
        assert f"its heartbeat {path} is not one a rank writes" in err and why in err, err
        assert "nothing was sent" in err and "Traceback" not in err
    assert sleeper.poll() is None and psutil.Process(sleeper.pid).status() != psutil.STATUS_STOPPED


@pytest.mark.slow
def test_chaos_inject_through_the_cli_exits_2_for_a_heartbeat_nested_100k_deep(tmp_path):
    """The 100k-deep case of test_chaos_refuses_a_malformed_heartbeat_naming_it in a process of its own (a torch
    start-up); the fast test covers the refusal through `main`, and test_aegis_lineage.py's
    test_chaos_signals_no_process_that_is_not_the_live_rank the exit 2 of a `zaya chaos inject` process."""
    path = put(tmp_path / "run", DEEP)
    out = subprocess.run([sys.executable, "-m", "zaya", "chaos", "inject", str(tmp_path / "run"), "kill"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and str(path) in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_read_heartbeats_skips_and_reports_what_is_not_a_heartbeat(tmp_path):
    good = {"rank": 1, "time": time.time(), "phase": "train", "step": 4, "attempt": 0, "host": socket.gethostname(),
            "busy_recent": [0.1, 0.2], "loss": "nan", "exit_code": None}
    put(tmp_path, json.dumps(good), rank=1)
    bad = {case: put(tmp_path, content, rank=10 + i) for i, (case, (content, _)) in enumerate(BAD_HEARTBEATS.items())}
    problems: dict[Path, str] = {}
    assert read_heartbeats(tmp_path / "aegis", problems) == {1: good}
    assert set(problems) == set(bad.values())
    assert parse_heartbeat(heartbeat_dir(tmp_path / "aegis") / "rank-00001.json") == good


def test_malformed_directives_events_and_plans_are_errors_naming_the_file(tmp_path):
    from zaya.aegis.chaos import ChaosHook, load_plan, read_injections
    from zaya.aegis.directives import DIRECTIVES_FILE, read_directives
    from zaya.aegis.events import EVENTS_FILE, read_events

    aegis = tmp_path / "aegis"
    aegis.mkdir()
    for doc in (DEEP, "[]", '{"skip": [{"from_step": "3", "steps": 1}]}', '{"lr_cut": [{"from_step": 3, "steps": 2, '
                '"factor": 5}]}', '{"skip": {"from_step": 3}}'):
        (aegis / DIRECTIVES_FILE).write_text(doc)
        with pytest.raises(ConfigError, match=f"{aegis / DIRECTIVES_FILE}: not the rewind directives"):
            read_directives(aegis)
    (aegis / EVENTS_FILE).write_text('{"kind": "start"}\n' + DEEP + "\n")
    with pytest.raises(ConfigError, match=rf"{aegis / EVENTS_FILE}:2: not an Aegis event \(JSON nested too deeply"):
        read_events(aegis)
    (aegis / EVENTS_FILE).write_text('{"kind": "start"}\n[1]\n')
    with pytest.raises(ConfigError, match=f"{EVENTS_FILE}:2: not an Aegis event"):
        read_events(aegis)
    plan = tmp_path / "plan.json"
    plan.write_text(DEEP)
    with pytest.raises(ConfigError, match=f"chaos plan {plan}: cannot be read as JSON"):
        load_plan(plan)
    (aegis / "chaos.jsonl").write_text(DEEP + '\n[1]\n{"kind": "kill"}\n')
    assert read_injections(aegis) == [{"kind": "kill"}]
    requests = aegis / "chaos-requests"
    requests.mkdir()
    for i, doc in enumerate((DEEP, "[1]", '{"kind": "kill"}', '{"kind": "stall", "seconds": 0.01}')):
        (requests / f"rank-00000-{i}.json").write_text(doc)
    hook = ChaosHook([], aegis)
    assert hook._requests() == [{"kind": "stall", "seconds": 0.01}] and not list(requests.iterdir())


def test_supervisor_reads_hostile_metrics_without_failing(tmp_path):
    from zaya.aegis.detectors import LossSpike
    from zaya.aegis.supervisor import productive_seconds

    lines = [DEEP, "[1, 2]", '{"kind": "train", "step": "7", "step_time_s": 1.0}',
             json.dumps({"kind": "train", "step": 1, "step_time_s": 2**80, "loss": 2**2000}),
             json.dumps({"kind": "train", "step": 2, "step_time_s": 0.5, "loss": 1.5})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert productive_seconds(tmp_path) == 0.5
    from types import SimpleNamespace

    records = [json.loads(line) for line in lines[3:]]
    assert LossSpike(8, 6.0, 2).check(SimpleNamespace(metrics=records)) == []


VANDAL_FILES = ((1, "nested too deeply"), (2, "a JSON list"), (3, "rank 0 in a file named rank-00003"))
"""The ranks whose heartbeat files ``vandal`` writes, and why the supervisor refuses each."""


@contextlib.contextmanager
def vandal(run: Path):
    """While the block runs, files that are not heartbeats appear beside a supervised rank's own (nested 100,000
    deep, a list, a rank claiming another's file; ``VANDAL_FILES``) once a launch has written rank 0's heartbeat
    (a rank 0 heartbeat older than the block, a finished job's, is not one)."""
    stop = threading.Event()
    since = time.time()

    def write():
        rank0 = heartbeat_dir(run / "aegis") / "rank-00000.json"
        while not stop.is_set():
            try:
                fresh = rank0.stat().st_mtime >= since  # the launch has cleared the old heartbeats
            except FileNotFoundError:
                fresh = False
            if fresh:
                put(run, DEEP, rank=1)
                put(run, "[1]", rank=2)
                put(run, json.dumps({"rank": 0, "time": time.time(), "phase": "train"}), rank=3)
            time.sleep(0.1)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def assert_warned_once_per_vandal_file(run: Path, stderr: str) -> None:
    """A supervisor that ran one attempt beside ``vandal`` warned once per file, naming why, and finished."""
    for rank, why in VANDAL_FILES:
        path = heartbeat_dir(run / "aegis") / f"rank-{rank:05d}.json"
        warnings = [line for line in stderr.splitlines() if f"aegis: warning: {path}" in line]
        assert len(warnings) == 1 and why in warnings[0], stderr[-3000:]
    assert "Traceback" not in stderr and "aegis: finished (exit code 0)" in stderr


@pytest.mark.slow
def test_zaya_run_warns_about_a_corrupt_heartbeat_and_trains_on(tmp_path, micro_config):
    """End to end: while a supervised rank trains, files that are not heartbeats appear beside its own (nested
    100,000 deep, a list, a rank claiming another's file): the supervisor warns once per file, and the run finishes.
    A `zaya run` of its own (25 s on 2 cores): test_aegis_lineage.py's
    test_supervisor_death_stops_its_ranks_and_a_new_run_resumes_once checks the same during its resuming run."""
    cfg = micro_config(extra="\n[aegis]\npoll_s = 0.2\nwarm_standby = false\n")
    run = tmp_path / "run"
    with vandal(run):
        out = subprocess.run([sys.executable, "-m", "zaya", "run", "--config", str(cfg), "--quiet", "--set",
                              "train.sample_tokens=0", "--set", "train.eval_every=0", "--max-steps", "8"],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert_warned_once_per_vandal_file(run, out.stderr)
