"""Aegis's rules, policy, directives, events and chaos plan, each on hand-made evidence (no processes: fast)."""

from __future__ import annotations

import json
import time

import pytest

from zaya.core import errors
from zaya.aegis.detectors import (CollectiveFault, DiskFull, GpuHardware, Hang, Line, LossSpike, NicFlap,
                                  NonFiniteLoss, Observation, OutOfMemory, RankExited, Straggler, diagnose,
                                  build_detectors, normalise_device)
from zaya.config import AegisConfig, ConfigError

T0 = 1_000_000.0


def obs(**kw) -> Observation:
    base = dict(now=T0 + 100, launched_at=T0, world_size=2)
    base.update(kw)
    return Observation(**base)


def hb(rank, step=5, phase="train", t=T0 + 99, **kw):
    return {"rank": rank, "local_rank": rank, "pid": 100 + rank, "host": "h", "step": step, "phase": phase,
            "time": t, **kw}


def lines(*texts, t=T0 + 50):
    return [Line(t + i, "output", text) for i, text in enumerate(texts)]


TORCHRUN_SIGKILL = ["[1]:", "  time      : 2025", "  host      : h", "  rank      : 1 (local_rank: 1)",
                    "  exitcode  : -9 (pid: 4242)  (SIGKILL)",
                    "  traceback : Signal 9 (SIGKILL) received by PID 4242"]


def test_rank_exited_names_the_killed_rank_not_its_peers_echo():
    o = obs(ended=True, job_exit_code=1, lines=lines(*TORCHRUN_SIGKILL),
            heartbeats={0: hb(0, phase="exited", exit_code=6, error="CollectiveError: a collective failed"),
                        1: hb(1, step=9)})
    (f,) = RankExited().check(o)
    assert f.rank == 1 and f.fault == "exit:signal" and "code -9" in f.evidence[0] and "SIGKILL" in f.evidence[0]
    assert "rank 0: 6" in f.evidence[-1] and f.exit_code == errors.COLLECTIVE_ERROR
    assert RankExited().check(obs(ended=False, lines=o.lines, heartbeats=o.heartbeats)) == []  # live: wait


def test_rank_exited_by_code_class_and_config_errors_are_given_up_at_once():
    o = obs(ended=True, job_exit_code=1, heartbeats={0: hb(0, phase="exited", exit_code=70, t=T0 + 10,
                                                           error="RuntimeError: boom"),
                                                     1: hb(1, phase="exited", exit_code=6, t=T0 + 12)})
    (f,) = RankExited().check(o)
    assert (f.rank, f.fault, f.exit_code, f.forced_action) == (0, "exit:internal", 70, None)
    assert "RuntimeError: boom" in f.evidence[1]
    o.heartbeats[0]["exit_code"] = 2
    assert RankExited().check(o)[0].forced_action == "give_up"


def test_collective_fault_from_gloo_and_nccl_lines_and_exit_six():
    o = obs(ended=True, job_exit_code=1, lines=lines("[default0]:RuntimeError: [../gloo/transport/tcp/pair.cc:534] "
                                                     "Connection closed by peer [127.0.0.1]:1234"),
            heartbeats={0: hb(0, phase="exited", exit_code=6), 1: hb(1, phase="exited", exit_code=6)})
    (f,) = CollectiveFault().check(o)
    assert "Connection closed by peer" in f.evidence[0] and "[0, 1]" in f.evidence[-1]
    assert RankExited().check(o) == []  # only sixes: the collective rule owns it
    nccl = obs(ended=True, job_exit_code=1, lines=lines("[Rank 3] Watchdog caught collective operation timeout: "
                                                        "WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600000 ms"))
    assert CollectiveFault().check(nccl)[0].detector == "collective"


def test_hang_blames_the_stopped_rank_and_uses_the_phase_timeouts():
    timeouts = {"startup": 60, "train": 8, "checkpoint": 30, "eval": 30}
    o = obs(heartbeats={0: hb(0, step=11, t=T0 + 90), 1: hb(1, step=11, t=T0 + 91)},
            process_status={0: "stopped", 1: "sleeping"})
    (f,) = Hang(timeouts).check(o)
    assert f.rank == 0 and "process stopped" in f.evidence[0] and f.since == T0 + 90 and len(f.evidence) == 2
    # a save may take longer than a step: 9 s in phase "checkpoint" is no hang, nor 30 s of start-up
    assert Hang(timeouts).check(obs(heartbeats={0: hb(0, phase="checkpoint", t=T0 + 91), 1: hb(1)})) == []
    assert Hang(timeouts).check(obs(now=T0 + 30)) == []
    (late,) = Hang(timeouts).check(obs(now=T0 + 61))
    assert late.fault == "hang" and "phase startup" in late.evidence[0]



def test_hang_acts_on_a_stopped_process_before_its_heartbeat_goes_stale():
    timeouts = {"startup": 60, "train": 30, "checkpoint": 60, "eval": 60}
    rule = Hang(timeouts, stopped_timeout=5)
    beats = {0: hb(0, step=11, t=T0 + 99), 1: hb(1, step=11, t=T0 + 99)}
    # first seen stopped at T0 + 100: not yet (the heartbeat is 1 s old, the stop has lasted 0 s)
    assert rule.check(obs(heartbeats=beats, process_status={0: "sleeping", 1: "stopped"})) == []
    assert rule.check(obs(now=T0 + 104, heartbeats=beats, process_status={0: "sleeping", 1: "stopped"})) == []
    (f,) = rule.check(obs(now=T0 + 105.5, heartbeats=beats, process_status={0: "sleeping", 1: "stopped"}))
    assert f.rank == 1 and f.step == 11 and "process stopped" in f.evidence[0] and "5.5 s" in f.evidence[0]
    assert f.since == T0 + 99  # the last heartbeat: the stop came after it
    # a process that runs again (SIGCONT) starts over; a new process (another pid, a relaunch) too
    rule = Hang(timeouts, stopped_timeout=5)
    rule.check(obs(heartbeats=beats, process_status={1: "stopped"}))
    rule.check(obs(now=T0 + 103, heartbeats=beats, process_status={1: "running"}))
    assert rule.check(obs(now=T0 + 106, heartbeats=beats, process_status={1: "stopped"})) == []
    relaunched = {0: beats[0], 1: hb(1, step=11, t=T0 + 99, pid=999)}
    assert rule.check(obs(now=T0 + 110, heartbeats=relaunched, process_status={1: "stopped"})) == []
    assert rule.check(obs(now=T0 + 115, heartbeats=relaunched, process_status={1: "stopped"}))[0].rank == 1
    # a tracer's stop (state t: a debugger, py-spy) and a sleeping rank are not stopped; without the option the
    # rule waits for the phase timeout as before
    traced = Hang(timeouts, 5)
    for now in (T0 + 100, T0 + 110):
        assert traced.check(obs(now=now, heartbeats=beats, process_status={0: "tracing-stop", 1: "sleeping"})) == []
    plain = Hang(timeouts)
    plain.check(obs(heartbeats=beats, process_status={1: "stopped"}))
    assert plain.check(obs(now=T0 + 120, heartbeats=beats, process_status={1: "stopped"})) == []

def test_hang_blames_a_stopped_rank_whose_own_heartbeat_is_not_yet_stale():
    """The race seen in a supervised run: rank 0 beat, then was stopped; its peer's older heartbeat went stale
    first, before the stop had lasted stopped_timeout. The peer only waits for rank 0: rank 0 is the culprit."""
    timeouts = {"startup": 60, "train": 5, "checkpoint": 30, "eval": 30}
    rule = Hang(timeouts, stopped_timeout=5)
    beats = {0: hb(0, step=11, t=T0 + 96), 1: hb(1, step=11, t=T0 + 94.9)}
    (f,) = rule.check(obs(now=T0 + 100, heartbeats=beats, process_status={0: "stopped", 1: "sleeping"}))
    assert f.rank == 0 and "process stopped" in f.evidence[0] and f.since == T0 + 96, f.evidence
    assert "rank 1" in f.evidence[1] and "> the train timeout 5 s" in f.evidence[1]
    # an exited rank is never the culprit, and with no stopped rank the one furthest behind still is
    assert rule.check(obs(now=T0 + 100, heartbeats=beats, process_status={1: "sleeping"}))[0].rank == 1
    exited = {0: hb(0, step=11, t=T0 + 96, phase="exited"), 1: beats[1]}
    assert rule.check(obs(now=T0 + 100, heartbeats=exited, process_status={0: "gone", 1: "sleeping"}))[0].rank == 1


def test_gpu_hardware_maps_xid_and_amdgpu_lines_to_ranks():
    beats = {0: hb(0, device="0000:3b:00"), 1: hb(1, device="cpu:1")}
    o = obs(heartbeats=beats, new_lines=lines("NVRM: Xid (PCI:0000:3B:00): 79, pid=0, GPU has fallen off the bus.",
                                              "NVRM: Xid (PCI:cpu:1): 48, pid=0, DBE",
                                              "NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception",
                                              "NVRM: Xid (PCI:0000:3b:00): 63, row remap pending"))
    found = GpuHardware().check(o)
    assert [(f.rank, f.action_key, f.forced_action) for f in found] == [(0, "gpu_error", None),
                                                                        (1, "gpu_error", None), (0, "gpu_error",
                                                                                                 "alert")]
    amd = obs(new_lines=lines("amdgpu 0000:c1:00.0: amdgpu: 2 uncorrectable hardware errors detected in umc block"))
    (f,) = GpuHardware().check(amd)
    assert f.device == "0000:c1:00" and "uncorrectable" in f.fault
    assert normalise_device("3B:00.0") == "0000:3b:00"


def test_nic_acts_only_on_repeated_flaps_within_the_window():
    rule = NicFlap(flaps=2, window_s=300)
    assert rule.check(obs(new_lines=lines("mlx5_core 0000:17:00.0: Link down", t=T0))) == []
    assert rule.check(obs(now=T0 + 400, new_lines=lines("ionic 0000:18:00.0 enp: Link down", t=T0 + 400))) == []
    (f,) = rule.check(obs(now=T0 + 410, new_lines=lines("ionic 0000:18:00.0 enp: Link up - 400 Gbps",
                                                        "ionic 0000:18:00.0 enp: Link down", t=T0 + 405)))
    assert "2 link-down lines within 300 s" in f.evidence[-1]


def test_oom_nonfinite_and_disk_full_cite_their_lines():
    o = obs(ended=True, job_exit_code=1, lines=lines("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"))
    assert "CUDA out of memory" in OutOfMemory().check(o)[0].evidence[0]
    nan = obs(ended=True, job_exit_code=1,
              heartbeats={0: hb(0, phase="exited", exit_code=4, error="NonFiniteLossError: non-finite gradient "
                                                                      "norm at step 13 (loss 5.1, grad norm nan)")})
    (f,) = NonFiniteLoss().check(nan)
    assert f.step == 13 and f.exit_code == 4 and RankExited().check(nan) == []
    full = DiskFull(1024).check(obs(new_lines=lines("warning: checkpoint of step 8 failed: [Errno 27] File too "
                                                    "large"), disk_free_mb=50_000))
    assert "File too large" in full[0].evidence[0]
    assert "50 MB free" in DiskFull(1024).check(obs(disk_free_mb=50))[0].evidence[0]


def test_loss_spike_uses_rolling_statistics_and_forgets_rewound_steps():
    rule = LossSpike(window=8, sigma=6.0, min_steps=4)
    steady = [{"kind": "train", "step": s, "loss": 3.0 + 0.01 * (s % 2)} for s in range(1, 9)]
    assert rule.check(obs(metrics=steady)) == []
    (f,) = rule.check(obs(metrics=[{"kind": "train", "step": 9, "loss": 4.5}]))
    assert f.step == 9 and "step 9: loss 4.5000" in f.evidence[0]
    assert rule.check(obs(metrics=[{"kind": "train", "step": 9, "loss": 3.01}])) == []  # the redone step 9
    assert 9 in rule.history and rule.history[9] == 3.01


def test_straggler_by_busy_time_over_several_steps():
    rule = Straggler(factor=2.0, beats=3)
    assert rule.check(obs(heartbeats={0: hb(0, busy_recent=[0.1, 0.1]), 1: hb(1, busy_recent=[0.6, 0.6])})) == []
    beats = {0: hb(0, busy_recent=[0.1, 0.3, 0.1, 0.1]), 1: hb(1, busy_recent=[0.1, 0.6, 0.7, 0.6])}
    (f,) = rule.check(obs(heartbeats=beats))
    assert f.rank == 1 and "busy 0.600 s per step" in f.evidence[0] and "0.100 s" in f.evidence[0]
    assert rule.check(obs(heartbeats=beats)) == []  # reported once while it lasts
    beats[1]["busy_recent"] = [0.1, 0.1, 0.1]
    assert rule.check(obs(heartbeats=beats)) == []


def test_diagnose_puts_the_root_cause_first():
    o = obs(ended=True, job_exit_code=1, lines=lines(*TORCHRUN_SIGKILL, "Connection reset by peer"),
            heartbeats={0: hb(0, phase="exited", exit_code=6), 1: hb(1)})
    found = diagnose(build_detectors(AegisConfig()), o)
    assert [f.detector for f in found] == ["rank_exited", "collective"]


def test_policy_table_repeats_backoff_and_give_up():
    from zaya.aegis.detectors import Finding
    from zaya.aegis.policy import Policy

    cfg = AegisConfig(max_repeats=2, backoff_s=1.0, backoff_max_s=3.0, on_hang="backoff")
    policy = Policy(cfg)
    f = Finding("hang", "hang", ["x"], "hang", exit_code=6)
    assert [(d.action, d.wait_s) for d in (policy.decide(f), policy.decide(f))] == [("backoff", 1.0),
                                                                                      ("backoff", 2.0)]
    last = policy.decide(f)
    assert last.action == "give_up" and last.exit_code == 6 and "aegis.max_repeats = 2" in last.reason
    assert policy.decide(Finding("straggler", "s", ["x"], "straggler")).action == "alert"
    with pytest.raises(ConfigError, match="aegis.on_hang = 'reboot'"):
        AegisConfig(on_hang="reboot")


def test_config_has_an_aegis_table(tmp_path):
    from zaya.config import load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text("[aegis]\nheartbeat_timeout_s = 5\non_straggler = \"exclude\"\n")
    c = load_config(cfg)
    assert c.aegis.heartbeat_timeout_s == 5.0 and c.aegis.on_straggler == "exclude"
    cfg.write_text("[aegis]\nheartbeat_timeot_s = 5\n")
    with pytest.raises(ConfigError, match="Did you mean 'heartbeat_timeout_s'"):
        load_config(cfg)


def test_directives_skip_batches_and_cut_the_lr(tmp_path):
    from types import SimpleNamespace

    from zaya.aegis.directives import Directives, add_directive

    add_directive(tmp_path, bad_step=3, skip_steps=2, lr_cut=0.5, lr_cut_steps=2)
    add_directive(tmp_path, bad_step=3, skip_steps=2, lr_cut=1.0, lr_cut_steps=0)  # the same bad step: once
    calls = []
    trainer = SimpleNamespace(skip_batches=lambda steps: calls.append(("skip", steps)) or 4,
                              scale_lr=lambda factor: calls.append(("lr", factor)),
                              runtime=SimpleNamespace(rank=0), log=lambda m: None)
    d = Directives(tmp_path)
    for step in range(1, 6):
        calls.append(("step", step))
        d.on_step_start(trainer, step)
    assert calls == [("step", 1), ("step", 2), ("step", 3), ("skip", 2), ("lr", 0.5), ("step", 4), ("lr", 0.5),
                     ("step", 5)]
    assert d.skipped == [{"from_step": 3, "steps": 2, "micro_batches": 4, "rank": 0}]


def test_events_file_is_rewritten_whole_and_reported(tmp_path):
    from zaya.aegis.events import EventLog, format_report, summarise

    log = EventLog(tmp_path / "run" / "aegis")
    e = log.add(kind="decision", attempt=0, detector="hang", evidence=["rank 0 stale"], action="restart",
                time_to_detect_s=8.5, outcome="pending")
    e.update(outcome="recovered", time_to_recover_s=9.0, steps_redone=3)
    log.flush()
    log.add(kind="summary", outcome="finished", exit_code=0, wall_s=100.0, productive_s=90.0, ettr=0.9)
    report = summarise(tmp_path / "run")
    assert report["by_detector"]["hang"] == {"count": 1, "mean_time_to_detect_s": 8.5,
                                             "mean_time_to_recover_s": 9.0, "steps_redone": 3}
    assert "ETTR 0.900" in format_report(report) and not list((tmp_path / "run" / "aegis").glob(".*tmp*"))


def test_chaos_plan_is_checked_and_live_requests_reach_the_rank(tmp_path):
    from zaya.aegis.chaos import load_plan, request

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"kind": "explode", "step": 1}]))
    with pytest.raises(ConfigError, match="entry 0"):
        load_plan(plan)
    run = tmp_path / "run"
    (run / "aegis" / "heartbeat").mkdir(parents=True)
    assert "requested stall" in request(run, "stall", 1, seconds=2.0)
    (req,) = (run / "aegis" / "chaos-requests").glob("rank-00001-*.json")
    assert json.loads(req.read_text())["seconds"] == 2.0
    log = tmp_path / "kern.log"
    request(run, "xid", 1, log=str(log))
    assert "NVRM: Xid (PCI:cpu:1): 79" in log.read_text()
    with pytest.raises(ConfigError, match="no heartbeat of rank 3"):
        request(run, "kill", 3)


def test_heartbeat_is_written_atomically_with_phase_and_exit(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from zaya.aegis.heartbeat import Heartbeat, read_heartbeats

    monkeypatch.setenv("RANK", "1")
    beat = Heartbeat(tmp_path)
    assert read_heartbeats(tmp_path)[1]["phase"] == "startup"
    cfg = SimpleNamespace(train=SimpleNamespace(max_steps=10, eval_every=0), checkpoint=SimpleNamespace(every=4))
    trainer = SimpleNamespace(config=cfg, progress=SimpleNamespace(step=4))
    beat.on_step_end(trainer, {"step": 4, "loss": float("nan"), "step_time_s": 0.1})
    doc = read_heartbeats(tmp_path)[1]
    assert doc["phase"] == "checkpoint" and doc["loss"] == "nan" and doc["busy_s"] >= 0
    beat.on_error(trainer, errors.NonFiniteLossError("non-finite loss at step 5"))
    doc = read_heartbeats(tmp_path)[1]
    assert doc["phase"] == "exited" and doc["exit_code"] == 4 and "step 5" in doc["error"]
    assert [p.name for p in (tmp_path / "heartbeat").iterdir()] == ["rank-00001.json"]
    assert time.time() - doc["time"] < 60
