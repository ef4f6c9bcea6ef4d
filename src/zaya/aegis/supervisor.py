"""``zaya run``: launch training through torchrun's own launcher (the elastic agent), watch it, repair it.

One supervisor per node (under Slurm or Kubernetes: one per node's task or pod). Each look (``aegis.poll_s``)
builds an ``Observation`` (heartbeats, output lines, watched logs and the kernel log, new metrics records, the
ranks' process states, free disk) and runs the detectors; the root-cause finding goes to the policy, and the
decision is carried out and recorded in ``events.jsonl`` with its evidence. A relaunch is a new torchrun (attempt
N+1); the trainer resumes from the newest good checkpoint, from the RAM tier when the newest disk checkpoint is
mirrored there. torchrun itself never restarts workers (``--max-restarts 0``): every restart is a decision here.
On a single node attempt N+1 is started ahead of time once attempt N trains (``aegis.warm_standby``): its ranks
import and wait, and a restart releases them instead of launching cold (``zaya.aegis.standby``).

Figures kept per decision: time to detect (from the fault's best-known start: the stuck rank's last heartbeat,
the failed rank's exit, the log line), time to recover (until every rank of the relaunch has trained a step past
the one it resumed at), steps redone; at the end ETTR = productive step time (the kept timeline's step times) /
wall time.
"""

from __future__ import annotations

import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import psutil

from zaya.core import errors
from zaya.aegis.env import AEGIS_DIR_ENV, ATTEMPT_ENV, CHAOS_ENV, aegis_dir
from zaya.aegis.detectors import Finding, Line, Observation, build_detectors, diagnose
from zaya.aegis.directives import add_directive
from zaya.aegis.events import EventLog
from zaya.aegis.heartbeat import clear_heartbeats, rank_process, read_heartbeats
from zaya.aegis.lineage import parent_death_signal, supervisor_env
from zaya.aegis.policy import Decision, Policy
from zaya.aegis.sources import GpuCounters, KernelLog, LogTail, disk_free_mb, process_status
from zaya.aegis.standby import STANDBY_ENV, write_go
from zaya.config import Config
from zaya.core.layout import checkpoints_dir, metrics_path
from zaya.core.metrics_file import read_metrics, stepped_records
from zaya.train.run_lock import JOB_ENV, RunLock

_RANK_PREFIX = re.compile(r"^\[[A-Za-z_]*?(\d+)\]:")


@dataclass
class Launch:
    """How to start the job on this node: ``zaya train`` arguments and torchrun's node/rendezvous options."""

    config_path: str
    train_args: list[str] = field(default_factory=list)
    """Arguments for ``zaya train`` other than --config and --resume (``--set``, ``--max-steps``, ...)."""
    resume: str = "auto"
    nproc_per_node: int = 1
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_endpoint: str = ""
    rdzv_backend: str = "c10d"
    rdzv_id: str = ""
    chaos: str | None = None
    """A chaos plan file (or "live": only ``zaya chaos inject`` requests) passed to the ranks as ZAYA_CHAOS."""


@dataclass
class Standby:
    """The next attempt's torchrun, started ahead of time; its ranks wait for ``go`` (zaya.aegis.standby)."""

    proc: subprocess.Popen
    reader: threading.Thread
    lines: "queue.Queue[Line]"
    attempt: int
    slots: list[int]
    go: Path
    command: list[str]


class Supervisor:
    def __init__(self, config: Config, launch: Launch, echo: bool = True):
        self.config, self.cfg, self.launch, self.echo = config, config.aegis, launch, echo
        self.run_dir = Path(config.train.run_dir)
        self.aegis = aegis_dir(self.run_dir)
        self.events: EventLog | None = None
        self.policy = Policy(self.cfg)
        self.detectors = build_detectors(self.cfg)
        self.slots = list(range(launch.nproc_per_node))
        self.spares = list(range(launch.nproc_per_node, launch.nproc_per_node + self.cfg.spares))
        self.proc: subprocess.Popen | None = None
        self.lines: "queue.Queue[Line]" = queue.Queue()
        self.reader: threading.Thread | None = None
        self.stop_signal: str = ""
        self.metrics_offset = 0
        self.on_gpu = False
        self.nodes = int(str(launch.nnodes).split(":")[-1])
        self.standby: Standby | None = None
        # The job id in the run directory's lock, handed to the ranks (zaya.train.run_lock): fresh per supervisor
        # on one node; on several, the same on every node's supervisor (rank 0 may start on any node).
        multi = self.nodes > 1 or bool(launch.rdzv_endpoint)
        self.job = f"rdzv:{launch.rdzv_id or 'zaya'}@{launch.rdzv_endpoint}" if multi else uuid.uuid4().hex
        self.lock: RunLock | None = None

    # --- the loop -------------------------------------------------------------------------------------------
    def run(self) -> int:
        from zaya.train.run_dir import prepare_run_dir

        start = time.time()
        # The trainer's own check, done first here: the Aegis directory then lives in a valid run directory, a
        # config mismatch fails before anything is launched, and --resume never moves the old run aside once.
        # It takes the run directory's lock, held until the supervisor exits: a second job there is refused.
        if self.launch.node_rank in (None, 0):
            self.lock = prepare_run_dir(self.run_dir, self.config, self.launch.resume, self._say, role="supervisor",
                                        job=self.job, accept=self.job if self.job.startswith("rdzv:") else None)
        try:
            return self._supervise(start)
        finally:
            if self.lock is not None:
                self.lock.release()

    def _supervise(self, start: float) -> int:
        """Launch, watch, repair until the job finishes or is given up; returns the exit code."""
        self.aegis.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.aegis)
        resume = "auto" if self.launch.resume == "never" else self.launch.resume
        tails = [LogTail(p) for p in self.cfg.watch_logs]
        kernel = KernelLog() if self.cfg.kernel_log else None
        gpus = GpuCounters()
        self.events.add(kind="start", host=socket.gethostname(), nproc=len(self.slots), nnodes=self.launch.nnodes,
                        kernel_log=kernel.available if kernel else False,
                        kernel_log_note=(kernel.why if kernel else "aegis.kernel_log = false"),
                        gpu_counters=gpus.kind or gpus.why, watch_logs=self.cfg.watch_logs)
        self._install_signals()
        attempt, pending = self._next_attempt(), None
        try:
            while True:
                launched = self._start(attempt, resume)
                result = self._watch(attempt, launched, tails, kernel, gpus, pending)
                if result is None:
                    return self._finish(start, "finished", errors.FINISHED)
                finding, decision, event, last_step = result
                if decision.action == "give_up":
                    self._kill()
                    event["outcome"] = "gave up"
                    self.events.flush()
                    return self._finish(start, "gave up", decision.exit_code or errors.INTERNAL_ERROR,
                                        diagnosis=f"{finding.detector}: {finding.evidence[0]} ({decision.reason})")
                if finding.detector == "stop":
                    return self._finish(start, "stopped", errors.INTERRUPTED)
                resume, reason = self._repair(finding, decision, event)
                if resume is None:
                    event["outcome"] = "gave up"
                    self.events.flush()
                    return self._finish(start, "gave up", finding.exit_code, diagnosis=reason)
                event.update(outcome="relaunching", relaunch_resume=resume, repair=reason, last_step=last_step)
                self.events.flush()
                pending = event
                attempt += 1
        finally:
            self._kill()
            self._discard(self.standby)
            self.standby = None
            self._clear_go_files()
            if kernel:
                kernel.close()

    def _next_attempt(self) -> int:
        """Attempts count on across supervisor restarts (a chaos plan names attempts)."""
        return 1 + max((e["attempt"] for e in self.events.events if e.get("kind") == "launch"
                        and isinstance(e.get("attempt"), int)), default=-1)

    def _start(self, attempt: int, resume: str) -> float:
        """Launch attempt ``attempt``: release the warm standby when it fits (same attempt, same slots, alive),
        else start torchrun cold. Returns the launch time."""
        clear_heartbeats(self.aegis)
        self._clear_go_files()  # a released standby's go file has done its work
        standby, self.standby = self.standby, None
        if standby is not None and not (standby.attempt == attempt and standby.slots == self.slots
                                        and standby.proc.poll() is None):
            if standby.proc.poll() is not None:
                self.events.add(kind="standby", attempt=standby.attempt, outcome="exited before its release",
                                exit_code=standby.proc.returncode,
                                last_lines=[line.text for line in self._drain_from(standby.lines)[-5:]])
            self._discard(standby)
            standby = None
        if standby is not None:
            write_go(standby.go, resume)
            self.proc, self.reader, self.lines, cmd = standby.proc, standby.reader, standby.lines, standby.command
        else:
            cmd = self._command(resume)
            self.proc, self.reader, self.lines = self._spawn(cmd, attempt, {})
        self.events.add(kind="launch", attempt=attempt, resume=resume, nproc=len(self.slots), slots=self.slots,
                        warm=standby is not None, command=cmd)
        self._say(f"aegis: attempt {attempt}: {len(self.slots)} rank(s) on this node, resume {resume}"
                  + (" (warm standby)" if standby is not None else ""))
        return time.time()

    def _spawn(self, cmd: list[str], attempt: int, extra_env: dict[str, str]):
        """Start a torchrun for ``attempt`` with its output read into attempt-NNN.log and a queue of lines."""
        env = {**os.environ, AEGIS_DIR_ENV: str(self.aegis), ATTEMPT_ENV: str(attempt), "PYTHONUNBUFFERED": "1",
               JOB_ENV: self.job, **supervisor_env(self.cfg.graceful_stop_s), **extra_env}
        if self.launch.chaos:
            env[CHAOS_ENV] = self.launch.chaos
        if self.on_gpu and self.slots != list(range(self.launch.nproc_per_node)):
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            physical = visible.split(",") if visible else [str(i) for i in range(256)]
            env["CUDA_VISIBLE_DEVICES"] = env["HIP_VISIBLE_DEVICES"] = ",".join(physical[s] for s in self.slots)
        log = open(self.aegis / f"attempt-{attempt:03d}.log", "w", encoding="utf-8")
        # The agent dies with this process, however this one dies; its ranks watch this process themselves and
        # stop with a checkpoint (zaya.aegis.lineage).
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, bufsize=1, errors="replace",
                                preexec_fn=parent_death_signal())
        lines: "queue.Queue[Line]" = queue.Queue()
        reader = threading.Thread(target=self._read_output, args=(proc, log, lines), daemon=True)
        reader.start()
        return proc, reader, lines

    # --- the warm standby (zaya.aegis.standby) ------------------------------------------------------------
    def _standby_wanted(self, beats: dict, world: int) -> bool:
        """Start one when none is waiting, the job is single-node and every rank has trained a step in it (so
        the standby's imports never compete with the job's own start-up)."""
        return (self.cfg.warm_standby and self.standby is None and self.nodes == 1 and not self.launch.rdzv_endpoint
                and len(beats) == world
                and all((hb.get("step") or 0) > (hb.get("resumed_step") or 0) for hb in beats.values()))

    def _start_standby(self, attempt: int) -> None:
        go = self.aegis / f"standby-{attempt:03d}.go"
        go.unlink(missing_ok=True)
        cmd = self._command("auto")  # the go file carries the real --resume
        proc, reader, lines = self._spawn(cmd, attempt, {STANDBY_ENV: str(go)})
        self.standby = Standby(proc, reader, lines, attempt, list(self.slots), go, cmd)
        self.events.add(kind="standby", attempt=attempt, slots=self.slots)

    def _clear_go_files(self) -> None:
        for go in self.aegis.glob("standby-*.go"):
            go.unlink(missing_ok=True)

    def _discard(self, standby: "Standby | None") -> None:
        """Stop a standby that was never released; its attempt log goes too (that attempt never ran)."""
        if standby is None:
            return
        _kill_tree(standby.proc)
        standby.reader.join(timeout=10)
        standby.go.unlink(missing_ok=True)
        (self.aegis / f"attempt-{standby.attempt:03d}.log").unlink(missing_ok=True)

    def _command(self, resume: str) -> list[str]:
        L = self.launch
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(len(self.slots)),
               "--max-restarts", "0", "--tee", "3", "--monitor-interval", "0.5"]
        if self.nodes > 1 or L.rdzv_endpoint:
            cmd += ["--nnodes", str(L.nnodes), "--rdzv-backend", L.rdzv_backend, "--rdzv-endpoint", L.rdzv_endpoint,
                    "--rdzv-id", L.rdzv_id or "zaya"]
            if L.node_rank is not None and L.rdzv_backend == "static":
                cmd += ["--node-rank", str(L.node_rank)]
        else:
            cmd += ["--standalone"]
        return cmd + ["-m", "zaya", "train", "--config", L.config_path, *L.train_args, "--resume", resume]

    def _read_output(self, proc: subprocess.Popen, log, out: "queue.Queue[Line]") -> None:
        with log:
            for text in proc.stdout:
                log.write(text)
                log.flush()
                if self.echo:
                    sys.stdout.write(text)
                    sys.stdout.flush()
                m = _RANK_PREFIX.match(text)
                out.put(Line(time.time(), "output", text.rstrip("\n"), int(m.group(1)) if m else None))

    def _watch(self, attempt: int, launched: float, tails, kernel, gpus, pending):
        """Look until the job finishes (None) or a finding needs an action: (finding, decision, event, step)."""
        seen: list[Line] = []
        world = len(self.slots) * self.nodes
        noted: set[str] = set()
        while True:
            time.sleep(self.cfg.poll_s)
            now = time.time()
            code = self.proc.poll()
            if code is not None:
                self.reader.join(timeout=10)  # every line of the failure report is read before judging
            new = self._drain()
            for source in tails + ([kernel] if kernel else []) + [gpus]:
                new += source.read()
            seen += new
            problems: dict[Path, str] = {}
            beats = {r: hb for r, hb in read_heartbeats(self.aegis, problems).items() if hb.get("attempt") == attempt}
            for path, why in problems.items():  # skipped: such a rank counts as not heard from (its timeouts apply)
                if str(path) not in noted:  # once per file and attempt
                    noted.add(str(path))
                    self._say(f"aegis: warning: {path} is not a heartbeat a rank writes ({why}); it is ignored")
            self.on_gpu = self.on_gpu or any(not str(hb.get("device") or "cpu").startswith("cpu")
                                             for hb in beats.values())
            if pending is not None and self._recovered(pending, beats, world, now):
                pending = None
            if pending is None and code is None and self._standby_wanted(beats, world):
                self._start_standby(attempt + 1)
            obs = Observation(now=now, launched_at=launched, world_size=world, heartbeats=beats, lines=seen,
                              new_lines=new, metrics=self._new_metrics(), ended=code is not None,
                              job_exit_code=code,
                              process_status=process_status(beats),
                              disk_free_mb=disk_free_mb(self.run_dir))
            if self.stop_signal:
                self._stop_gracefully()
                return Finding("stop", "stop", [f"the supervisor got {self.stop_signal}"], "rank_exit"), \
                    Decision("stop", "signal", 0), {}, None
            for finding in diagnose(self.detectors, obs):
                decision = self.policy.decide(finding)
                if decision.action == "alert":
                    key = f"{finding.fault}|{finding.evidence[0]}"
                    if key in noted:
                        continue
                    noted.add(key)
                last_step = max((hb.get("step", 0) for hb in beats.values()), default=0)
                event = self.events.add(kind="decision", attempt=attempt, detector=finding.detector,
                                        fault=finding.fault, evidence=finding.evidence, action=decision.action,
                                        reason=decision.reason, rank=finding.rank, step=finding.step,
                                        device=finding.device, repeat=decision.repeat,
                                        time_to_detect_s=round(now - finding.since, 3) if finding.since else None,
                                        outcome="noted" if decision.action == "alert" else "pending")
                self._say(f"aegis: {finding.detector} -> {decision.action}: {finding.evidence[0]}")
                if decision.action == "alert":
                    continue
                if pending is not None:
                    pending.update(outcome="not recovered (failed again)")
                    self.events.flush()
                return finding, decision, event, last_step
            if code is not None:
                if pending is not None:
                    self._recovered(pending, beats, world, now, final=True)
                return None

    def _drain(self) -> list[Line]:
        return self._drain_from(self.lines)

    @staticmethod
    def _drain_from(lines: "queue.Queue[Line]") -> list[Line]:
        out = []
        while True:
            try:
                out.append(lines.get_nowait())
            except queue.Empty:
                return out

    def _new_metrics(self) -> list[dict[str, Any]]:
        path = metrics_path(self.run_dir)
        if not path.is_file():
            return []
        with open(path, "rb") as fh:
            fh.seek(self.metrics_offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1
        self.metrics_offset += end
        return stepped_records(data[:end])

    def _recovered(self, event: dict, beats: dict, world: int, now: float, final: bool = False) -> bool:
        """Whether every rank of the relaunch has trained past its resume step; fills in the event's figures."""
        if len(beats) < world:
            return False
        resumed = [hb.get("resumed_step") or 0 for hb in beats.values()]
        done = all(hb.get("step", 0) > (hb.get("resumed_step") or 0) or hb.get("exit_code") == 0
                   for hb in beats.values())
        if not done:
            return False
        resumed_step = min(resumed)
        sources = sorted({str(hb.get("resumed_source")) for hb in beats.values()})
        event.update(outcome="recovered", time_to_recover_s=round(now - event["time"], 3),
                     resumed_step=resumed_step, resumed_from=",".join(sources),
                     steps_redone=max(0, (event.get("last_step") or 0) - resumed_step))
        self.events.flush()
        self._say(f"aegis: recovered from {event['detector']} in {now - event['time']:.1f} s (resumed at step "
                  f"{resumed_step} from {','.join(sources)}, {event['steps_redone']} step(s) redone)")
        return True

    # --- actions --------------------------------------------------------------------------------------------
    def _repair(self, finding: Finding, decision: Decision, event: dict) -> tuple[str | None, str]:
        """Carry out a decision on the job; returns (the next launch's --resume, what was done), or (None, why)
        when it cannot be done (then the run gives up)."""
        action = decision.action
        if action == "exclude":
            self._stop_gracefully()
            return self._exclude(finding)
        self._kill()
        if action == "backoff":
            self._say(f"aegis: backing off {decision.wait_s:g} s before relaunching")
            time.sleep(decision.wait_s)
        if finding.detector == "disk_full" and not self._wait_for_space():
            return None, (f"the disk under {self.run_dir} stays below aegis.min_free_mb = {self.cfg.min_free_mb:g} "
                          "MB free: free space, then run the same command again")
        if action == "rewind":
            return self._rewind(finding)
        return "auto", f"{action}: relaunch from the newest good checkpoint"

    def _rewind(self, finding: Finding) -> tuple[str, str]:
        from zaya.checkpoint.store import STEP_DIR, list_checkpoints

        if finding.step is None:
            return "auto", "rewind without a known bad step: relaunch from the newest good checkpoint"
        cfg = self.cfg
        added = add_directive(self.aegis, bad_step=finding.step, skip_steps=cfg.skip_steps, lr_cut=cfg.lr_cut,
                              lr_cut_steps=cfg.lr_cut_steps)
        limit = finding.step - 1 - cfg.rewind_steps
        ckpts = checkpoints_dir(self.run_dir)
        older = [p for p in list_checkpoints(ckpts) if int(STEP_DIR.match(p.name).group(1)) <= limit]
        what = f"rewind to step <= {limit}, directives {added or 'already recorded'}"
        if older:
            return str(older[-1]), f"{what}: resume from {older[-1].name}"
        for p in list_checkpoints(ckpts):  # none old enough: start over, keeping the newer ones aside
            p.rename(p.with_name(f"abandoned-{p.name}"))
        return "auto", f"{what}: no checkpoint that old, start from step 0"

    def _exclude(self, finding: Finding) -> tuple[str | None, str]:
        beats = read_heartbeats(self.aegis)
        hb = beats.get(finding.rank) if finding.rank is not None else None
        if hb is not None and hb.get("host") not in (None, socket.gethostname()):
            return "auto", f"the bad device is on {hb['host']} (its supervisor excludes it); relaunch here"
        local = hb.get("local_rank") if hb else None
        slot = self.slots[local] if local is not None and local < len(self.slots) else self.slots[-1]
        self.slots.remove(slot)
        how = f"slot {slot} excluded"
        if self.spares:
            spare = self.spares.pop(0)
            self.slots.append(spare)
            self.slots.sort()
            how += f", spare {spare} takes its place"
        if len(self.slots) < self.cfg.min_nproc:
            return None, f"{how}: {len(self.slots)} rank(s) left < aegis.min_nproc = {self.cfg.min_nproc}"
        return "auto", f"{how}: continue on {len(self.slots)} rank(s) (the checkpoint reshards)"

    def _wait_for_space(self) -> bool:
        deadline = time.time() + self.cfg.backoff_max_s
        while True:
            free = disk_free_mb(self.run_dir)
            if free is None or free >= self.cfg.min_free_mb:
                return True
            if time.time() > deadline:
                return False
            time.sleep(self.cfg.poll_s)

    def _workers(self) -> list[psutil.Process]:
        procs = []
        if self.proc is not None:
            try:
                procs = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for hb in read_heartbeats(self.aegis).values():
            proc, _ = rank_process(hb)  # never a pid the rank no longer holds
            if proc is not None and proc.pid not in [p.pid for p in procs]:
                procs.append(proc)
        return procs

    def _stop_gracefully(self) -> None:
        """SIGTERM the ranks (each finishes its step and checkpoints, exit 75); SIGKILL what is left after
        aegis.graceful_stop_s."""
        if self.proc is None or self.proc.poll() is not None:
            return self._kill()
        for p in self._workers():
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        try:
            self.proc.wait(timeout=self.cfg.graceful_stop_s)
        except subprocess.TimeoutExpired:
            pass
        self._kill()

    def _kill(self) -> None:
        """SIGKILL the launcher and every worker (each worker leads its own session: torchrun starts them so)."""
        if self.proc is None:
            return
        _kill_tree(self.proc, also=self._workers())
        if self.reader is not None:
            self.reader.join(timeout=10)

    def _install_signals(self) -> None:
        def handle(signum, frame):
            self.stop_signal = signal.Signals(signum).name

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, handle)
            except ValueError:  # not the main thread (a test driving the supervisor from a thread)
                pass

    def _finish(self, start: float, outcome: str, code: int, diagnosis: str = "") -> int:
        if outcome == "gave up":
            self._kill()
            self._forget_ram_tier()
        wall = time.time() - start
        productive = productive_seconds(self.run_dir)
        ettr = productive / wall if wall > 0 else None
        self.events.add(kind="summary", outcome=outcome, exit_code=code, diagnosis=diagnosis or None,
                        wall_s=round(wall, 3), productive_s=round(productive, 3),
                        ettr=round(ettr, 4) if ettr is not None else None)
        self._say(f"aegis: {outcome} (exit code {code}); ETTR {ettr:.3f}" + (f"; {diagnosis}" if diagnosis else ""))
        return code

    def _forget_ram_tier(self) -> None:
        """Remove this node's RAM-tier copies of the run given up (its ranks are gone and none will be restarted;
        the disk checkpoints stay for a later resume)."""
        from zaya.checkpoint import ram_owners
        from zaya.checkpoint.ram_tier import ram_tier_directory

        if not self.config.checkpoint.ram_tier:
            return
        directory = ram_tier_directory(self.run_dir, self.config.checkpoint.ram_dir)
        if ram_owners.remove(directory):
            self._say(f"aegis: removed the run's RAM-tier copies ({directory}): no relaunch will read them")

    def _say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)


def _kill_tree(proc: subprocess.Popen, also: Sequence[psutil.Process] = ()) -> None:
    """SIGKILL a launcher, every process under it and ``also``, then reap the launcher. A launcher that has already
    exited is not looked up again (its pid may belong to someone else by now)."""
    procs = list(also)
    if proc.poll() is None:
        try:
            root = psutil.Process(proc.pid)
            procs += root.children(recursive=True) + [root]
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
        pass


def productive_seconds(run_dir: Path) -> float:
    """The kept timeline's step time: the step times of the train records a resumed run's later ones did not
    supersede (a redone step counts once, as its final version), summed."""
    path = metrics_path(run_dir)
    train = read_metrics(path, kinds=("train",))["train"] if path.is_file() else []
    return sum(r["step_time_s"] for r in train if isinstance(r.get("step_time_s"), float)
               and math.isfinite(r["step_time_s"]))
