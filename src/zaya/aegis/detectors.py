"""The detectors: small rules, each over one kind of evidence, each returning findings that cite it.

The supervisor takes one ``Observation`` per look (``aegis.poll_s``): the ranks' heartbeats, the output and log
lines seen so far in this launch, the new metrics records, how the job ended (when it has), the ranks' process
states and the free disk space. Every rule is a class with ``check(obs) -> list[Finding]``; rules that need
history (NIC flaps in a window, rolling loss statistics, a straggler over several steps) keep it themselves.

Two kinds of rule. *Live* rules act on a running job: a hang, a GPU hardware line, repeated NIC flaps, a loss
spike, a straggler, a full disk. *End* rules judge a job that has ended, with every line of the launch in view,
because a dead rank's peers fail a moment later with collective errors of their own: only once the job is over is
the first cause clear (a SIGKILLed rank, then its peer's "Connection closed by peer"). ``diagnose`` ranks the
findings of one look by ``PRIORITY``, most specific first, so the root cause is what the policy acts on.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from zaya.core import errors


@dataclass
class Line:
    """One line of output or log, with where and when it was seen (``rank``: the local rank torchrun's prefix
    names, None for a log file)."""

    time: float
    source: str
    text: str
    rank: int | None = None


@dataclass
class Observation:
    now: float
    launched_at: float
    world_size: int
    heartbeats: dict[int, dict[str, Any]] = field(default_factory=dict)
    lines: list[Line] = field(default_factory=list)
    """Every line seen in this launch, oldest first."""
    new_lines: list[Line] = field(default_factory=list)
    """The lines that arrived since the previous look."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """New metrics.jsonl records since the previous look."""
    ended: bool = False
    job_exit_code: int | None = None
    process_status: dict[int, str] = field(default_factory=dict)
    """psutil status of each rank's process ("running", "sleeping", "stopped", "zombie", "gone")."""
    disk_free_mb: float | None = None


@dataclass
class Finding:
    detector: str
    fault: str
    """What repeats count by (same detector and the same kind of fault)."""
    evidence: list[str]
    action_key: str
    """The policy field ``aegis.on_<action_key>`` that says what to do."""
    exit_code: int = errors.INTERNAL_ERROR
    """The code a give-up ends with."""
    rank: int | None = None
    step: int | None = None
    """The bad step (1-based) of a non-finite loss or a spike: where a rewind skips from."""
    device: str | None = None
    since: float | None = None
    """Best estimate of when the fault began (for time to detect)."""
    forced_action: str | None = None
    """An action no policy may override (a config error is not fixed by restarting)."""


# --- end rules: the job has ended -----------------------------------------------------------------------------------
_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*$")
_TORCHRUN_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)\s*(\S*)")


def rank_exits(obs: Observation) -> dict[int, dict[str, Any]]:
    """Each failed rank's exit: from its final heartbeat (code, message, time) and from torchrun's failure report
    (the code of a rank that could not write one, e.g. after SIGKILL: a negative signal number)."""
    out: dict[int, dict[str, Any]] = {}
    for rank, hb in obs.heartbeats.items():
        if hb.get("phase") == "exited":
            out[rank] = {"code": hb.get("exit_code"), "error": hb.get("error", ""), "time": hb.get("time"),
                         "source": "heartbeat"}
    pending = None
    for line in obs.lines:
        m = _TORCHRUN_FAILURE.search(line.text)
        if m:
            pending = int(m.group(1))
            continue
        m = _TORCHRUN_EXIT.search(line.text)
        if m and pending is not None:
            code = int(m.group(1))
            seen = out.setdefault(pending, {"time": line.time, "error": "", "source": "torchrun"})
            if seen.get("code") is None or seen["source"] == "torchrun":
                seen["code"] = code
            seen["signal"] = m.group(3).strip("()") or None
            seen["pid"] = int(m.group(2))
            pending = None
    return out


_CODE_CLASS = {errors.CONFIG_ERROR: "config", errors.DATA_ERROR: "data", errors.NON_FINITE: "nonfinite",
               errors.CHECKPOINT_ERROR: "checkpoint", errors.COLLECTIVE_ERROR: "collective",
               errors.INTERNAL_ERROR: "internal", errors.INTERRUPTED: "stopped",
               errors.INTERRUPTED_AT_ONCE: "interrupted"}


def exit_class(code: int | None) -> str:
    """The class of an exit code (``zaya.core.errors``); a negative code is the signal that killed the rank."""
    if code is None:
        return "unknown"
    if code < 0 or code > 128 and code != errors.INTERRUPTED_AT_ONCE:
        return "signal"
    return _CODE_CLASS.get(code, "internal")


class RankExited:
    """A rank ended with an error: its exit code's class says what it was (config and data errors are given up on
    at once: no relaunch fixes them). Collective errors (6) are left to ``CollectiveFault`` when a rank failed
    for a reason of its own first: a peer's exit 6 is the echo of that."""

    name = "rank_exited"

    def check(self, obs: Observation) -> list[Finding]:
        if not obs.ended or obs.job_exit_code == 0:
            return []
        exits = {r: e for r, e in rank_exits(obs).items() if e.get("code") not in (0, None)}
        if not exits:
            if obs.job_exit_code is None:
                return []
            return [Finding(self.name, "launcher", [f"torchrun exited with code {obs.job_exit_code} and no rank "
                                                    "reported how it ended"], "rank_exit", since=obs.now)]
        own = {r: e for r, e in exits.items() if exit_class(e["code"]) not in ("collective", "nonfinite")}
        if not own:
            return []
        rank, e = min(own.items(), key=lambda kv: (kv[1].get("time") or math.inf, kv[0]))
        klass = exit_class(e["code"])
        detail = f"signal {e['signal']}" if e.get("signal") else klass
        evidence = [f"rank {rank} exited with code {e['code']} ({detail}, from its {e['source']})"]
        if e.get("error"):
            evidence.append(f"rank {rank}: {e['error']}")
        others = sorted(f"rank {r}: {x['code']}" for r, x in exits.items() if r != rank)
        if others:
            evidence.append("then " + ", ".join(others))
        hb = obs.heartbeats.get(rank, {})
        code = e["code"] if e["code"] > 0 else errors.COLLECTIVE_ERROR  # a killed rank: "a lost rank" (6)
        forced = "give_up" if klass in ("config", "data") else None
        return [Finding(self.name, f"exit:{klass}", evidence, "rank_exit", exit_code=code, rank=rank,
                        step=hb.get("step"), since=hb.get("time") if e["source"] == "torchrun" else e.get("time"),
                        forced_action=forced)]


def failed_job_lines(obs: Observation, pattern: re.Pattern) -> list[Line] | None:
    """The launch's lines matching ``pattern`` once the job has ended with an error; None while it runs or after
    it finished well (an end rule judges only a failed job)."""
    if not obs.ended or obs.job_exit_code == 0:
        return None
    return [ln for ln in obs.lines if pattern.search(ln.text)]


_COLLECTIVE = re.compile(r"NCCL WARN|ncclRemoteError|ncclSystemError|Watchdog caught collective operation timeout|"
                         r"ProcessGroupNCCL's watchdog got stuck|Connection closed by peer|Connection reset by peer|"
                         r"a collective failed during|RCCL WARN|Gloo.*timed out|ProcessGroupGloo.*Timed out",
                         re.IGNORECASE)


class CollectiveFault:
    """A collective timed out or lost a peer (NCCL/RCCL/gloo messages, or exit code 6 on every failed rank)."""

    name = "collective"

    def check(self, obs: Observation) -> list[Finding]:
        hits = failed_job_lines(obs, _COLLECTIVE)
        if hits is None:
            return []
        exits = {r: e for r, e in rank_exits(obs).items() if e.get("code") not in (0, None)}
        sixes = sorted(r for r, e in exits.items() if e["code"] == errors.COLLECTIVE_ERROR)
        if not hits and not sixes:
            return []
        evidence = [f"{ln.source}: {ln.text.strip()[:300]}" for ln in hits[:3]]
        if sixes:
            evidence.append(f"ranks {sixes} exited with code 6 (collective timeout or lost peer)")
        since = min((ln.time for ln in hits), default=obs.now)
        return [Finding(self.name, "collective", evidence, "collective", exit_code=errors.COLLECTIVE_ERROR,
                        since=since)]


_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|HIP out of memory|out of memory: Killed process|"
                  r"Out of memory: Killed process|oom-kill|oom_reaper|Cannot allocate memory", re.IGNORECASE)


class OutOfMemory:
    """Device or host memory ran out: a torch OutOfMemoryError, or the kernel's OOM killer took a rank."""

    name = "oom"

    def check(self, obs: Observation) -> list[Finding]:
        hits = failed_job_lines(obs, _OOM)
        if not hits:
            return []
        return [Finding(self.name, "oom", [f"{ln.source}: {ln.text.strip()[:300]}" for ln in hits[:3]], "oom",
                        exit_code=errors.INTERNAL_ERROR, rank=hits[0].rank, since=hits[0].time)]


_NON_FINITE = re.compile(r"non-finite (?:loss|gradient norm) at step (\d+)")


class NonFiniteLoss:
    """The trainer stopped on a non-finite loss or gradient norm (exit code 4; its message names the step)."""

    name = "nonfinite"

    def check(self, obs: Observation) -> list[Finding]:
        if not obs.ended:
            return []
        exits = {r: e for r, e in rank_exits(obs).items() if e.get("code") == errors.NON_FINITE}
        texts = [e.get("error", "") for e in exits.values()] + [ln.text for ln in obs.lines]
        steps = [int(m.group(1)) for t in texts for m in [_NON_FINITE.search(t)] if m]
        if not exits and not steps:
            return []
        step = min(steps) if steps else None
        evidence = [f"ranks {sorted(exits)} exited with code 4"] if exits else []
        evidence += [t.strip()[:300] for t in texts if _NON_FINITE.search(t)][:2]
        since = min((e["time"] for e in exits.values() if e.get("time")), default=obs.now)
        return [Finding(self.name, "nonfinite", evidence, "nonfinite", exit_code=errors.NON_FINITE, step=step,
                        since=since)]


# --- live rules -------------------------------------------------------------------------------------------------
class Hang:
    """No heartbeat within the phase's timeout (start-up and checkpoint saves get longer ones). The culprit is a
    rank whose process is stopped or gone, else the one that is furthest behind: its peers wait for it in a
    collective, so their heartbeats go stale too.

    A rank whose process has been *stopped* (state T: SIGSTOP/SIGTSTP, a job-control stop, which never ends by
    itself) for ``stopped_timeout`` seconds is hung at once, without waiting for its heartbeat to go stale: the
    state is direct evidence, and the phase timeouts must be long enough for a slow step or save. A rank that is
    merely silent (a deadlock in a collective: its process sleeps or spins) is only caught by the timeouts."""

    name = "hang"

    def __init__(self, timeouts: dict[str, float], stopped_timeout: float | None = None):
        self.timeouts = timeouts
        self.stopped_timeout = stopped_timeout
        self._stopped_since: dict[tuple[int, Any], float] = {}
        """(rank, pid) -> when its process was first seen stopped (forgotten as soon as it is not)."""

    def check(self, obs: Observation) -> list[Finding]:
        if obs.ended:
            return []
        stale = []
        for rank in range(obs.world_size):
            hb = obs.heartbeats.get(rank)
            if hb is not None and hb.get("phase") == "exited":
                continue
            phase = hb.get("phase", "startup") if hb else "startup"
            last = hb["time"] if hb else obs.launched_at
            limit = self.timeouts.get(phase, self.timeouts["train"])
            age = obs.now - last
            if age > limit:
                stale.append((rank, phase, hb.get("step", 0) if hb else None, age, limit, last))
        stopped = self._stopped(obs)
        if stopped and not stale:
            rank, seconds = stopped[0]
            hb = obs.heartbeats[rank]
            last = hb["time"]
            evidence = [f"rank {r}: process stopped (pid {obs.heartbeats[r].get('pid')}, state T: SIGSTOP or SIGTSTP) "
                        f"for {s:.1f} s >= aegis.stopped_timeout_s {self.stopped_timeout:g} s; phase "
                        f"{obs.heartbeats[r].get('phase')}, step {obs.heartbeats[r].get('step', 0)}, last heartbeat "
                        f"{obs.now - obs.heartbeats[r]['time']:.1f} s ago" for r, s in stopped]
            return [Finding(self.name, "hang", evidence, "hang", exit_code=errors.COLLECTIVE_ERROR, rank=rank,
                            step=hb.get("step", 0), since=min(last, obs.now - seconds))]
        if not stale:
            return []
        # A stopped or gone rank is the culprit even while its own heartbeat is younger than its peers' (it may
        # have beaten last, then stopped): the stale ranks are waiting for it in a collective.
        bad = {"stopped", "zombie", "gone", "dead", "tracing-stop"}
        waited_on = [(r, hb.get("phase", "train"), hb.get("step", 0), obs.now - hb["time"], None, hb["time"])
                     for r, hb in sorted(obs.heartbeats.items()) if obs.process_status.get(r) in bad
                     and hb.get("phase") != "exited" and r not in {s[0] for s in stale}]
        culprit = min(waited_on + stale, key=lambda s: (obs.process_status.get(s[0]) not in bad, s[2] or 0, s[5]))
        rank, phase, step, age, limit, last = culprit
        evidence = [f"rank {r}: phase {ph}, step {st}, last heartbeat {a:.1f} s ago"
                    + (f" > the {ph} timeout {lim:g} s" if lim is not None else "")
                    + f" (process {obs.process_status.get(r, 'unknown')})"
                    for r, ph, st, a, lim, _ in sorted(waited_on + stale, key=lambda s: s[0] != rank)]
        return [Finding(self.name, "hang", evidence, "hang", exit_code=errors.COLLECTIVE_ERROR, rank=rank,
                        step=step, since=last)]

    def _stopped(self, obs: Observation) -> list[tuple[int, float]]:
        """Ranks stopped for at least ``stopped_timeout`` (rank, seconds), longest first; updates the history."""
        if self.stopped_timeout is None:
            return []
        now_stopped = {(r, obs.heartbeats[r].get("pid")) for r, status in obs.process_status.items()
                       if status == "stopped" and r in obs.heartbeats
                       and obs.heartbeats[r].get("phase") != "exited"}
        self._stopped_since = {key: self._stopped_since.get(key, obs.now) for key in now_stopped}
        due = [(key[0], obs.now - t) for key, t in self._stopped_since.items()
               if obs.now - t >= self.stopped_timeout]
        return sorted(due, key=lambda d: -d[1])


_XID = re.compile(r"NVRM: Xid \(PCI:([^)]+)\): (\d+)")
_AMD = re.compile(r"amdgpu[ :]+([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.\d)?.*?(uncorrectable hardware errors detected"
                  r"|GPU reset\(\d+\) failed|Accelerator Check Architecture|GPU reset begin)", re.IGNORECASE)
_COUNTER = re.compile(r"aegis: (?:NVML|amd-smi) uncorrectable ECC count of GPU (\S+) rose")
XID_ACTIONS = {48: "gpu_error", 64: "gpu_error", 74: "gpu_error", 79: "gpu_error", 95: "gpu_error",
               119: "gpu_error", 94: "rank_exit", 63: None}
"""Xid codes (faults.md): 48 double-bit ECC, 64 remap failed, 74 NVLink, 79 fallen off the bus, 95 uncontained
ECC, 119 GSP timeout: the device is bad (exclude it). 94 contained ECC: restart the application. 63 row remap
pending: reset when convenient (noted, no action)."""


def normalise_device(text: str) -> str:
    """PCI ids as the kernel and torch print them compare equal: "0000:3B:00.0" and "0000:3b:00" -> "0000:3b:00"."""
    text = text.strip().lower()
    if text.startswith("cpu:"):
        return text
    parts = text.split(".")[0].split(":")
    if len(parts) == 2:
        parts = ["0000"] + parts
    return ":".join(p.zfill(2) if i else p.zfill(4) for i, p in enumerate(parts[-3:]))


class GpuHardware:
    """Uncorrectable ECC, Xid and amdgpu RAS events (kernel log, watched logs, NVML/amd-smi counters). The device
    is mapped to a rank through the ranks' heartbeats (their device's PCI id)."""

    name = "gpu_hardware"

    def check(self, obs: Observation) -> list[Finding]:
        out = []
        by_device = {normalise_device(hb["device"]): r for r, hb in obs.heartbeats.items() if hb.get("device")}
        for ln in obs.new_lines:
            device, key, what = None, "gpu_error", ""
            m = _XID.search(ln.text)
            if m:
                device, code = m.group(1), int(m.group(2))
                if code not in XID_ACTIONS:
                    continue  # an application fault (13, 31, 43...): the process's own error, seen elsewhere
                key, what = XID_ACTIONS[code], f"Xid {code}"
            elif _AMD.search(ln.text):
                m2 = _AMD.search(ln.text)
                device, what = m2.group(1), m2.group(2)
                key = None if what.lower() == "gpu reset begin" else "gpu_error"
            elif _COUNTER.search(ln.text):
                device, what = _COUNTER.search(ln.text).group(1), "ECC counter"
            else:
                continue
            dev = normalise_device(device) if device else None
            rank = by_device.get(dev) if dev else None
            evidence = [f"{ln.source}: {ln.text.strip()[:300]}",
                        f"device {dev or 'unknown'} is rank {rank}" if rank is not None else
                        f"device {dev or 'unknown'} matches no rank's heartbeat"]
            out.append(Finding(self.name, f"gpu:{dev}:{what}", evidence, key or "gpu_error", rank=rank,
                               device=dev, exit_code=errors.COLLECTIVE_ERROR, since=ln.time,
                               forced_action="alert" if key is None else None))
        return out


_LINK_DOWN = re.compile(r"\bLink (?:is )?down\b", re.IGNORECASE)


class NicFlap:
    """NIC link down (mlx5_core, ionic, ...): acts only when ``flaps`` downs come within ``window_s``; a single
    flap usually heals by itself (ByteRobust waits for two within 5 minutes)."""

    name = "nic"

    def __init__(self, flaps: int, window_s: float):
        self.flaps, self.window_s = max(1, flaps), window_s
        self.downs: deque[Line] = deque()

    def check(self, obs: Observation) -> list[Finding]:
        for ln in obs.new_lines:
            if _LINK_DOWN.search(ln.text):
                self.downs.append(ln)
        while self.downs and obs.now - self.downs[0].time > self.window_s:
            self.downs.popleft()
        if len(self.downs) < self.flaps:
            return []
        evidence = [f"{ln.source}: {ln.text.strip()[:200]}" for ln in self.downs]
        evidence.append(f"{len(self.downs)} link-down lines within {self.window_s:g} s (threshold {self.flaps})")
        since = self.downs[0].time
        self.downs.clear()
        return [Finding(self.name, "nic", evidence, "nic", exit_code=errors.COLLECTIVE_ERROR, since=since)]


class LossSpike:
    """A loss above mean + sigma x std of the previous ``window`` steps (OLMo-core's rule), once there are
    ``min_steps`` of them. A rewound run's repeated steps replace the history from there."""

    name = "loss_spike"

    def __init__(self, window: int, sigma: float, min_steps: int):
        self.window, self.sigma, self.min_steps = window, sigma, max(2, min_steps)
        self.history: dict[int, float] = {}

    def check(self, obs: Observation) -> list[Finding]:
        out = []
        for rec in obs.metrics:
            if rec.get("kind") != "train" or rec.get("skipped") or not isinstance(rec.get("loss"), float):
                continue  # the trainer writes a loss as a float (a non-finite one as a string)
            step, loss = int(rec["step"]), rec["loss"]
            if not math.isfinite(loss):
                continue
            for s in [s for s in self.history if s >= step]:
                del self.history[s]
            past = [self.history[s] for s in sorted(self.history)[-self.window:]]
            self.history[step] = loss
            if len(past) < self.min_steps:
                continue
            mean, std = statistics.fmean(past), statistics.pstdev(past)
            if loss > mean + self.sigma * max(std, 1e-6 * abs(mean)):
                out.append(Finding(self.name, "loss_spike",
                                   [f"step {step}: loss {loss:.4f} > mean {mean:.4f} + {self.sigma:g} x std "
                                    f"{std:.4f} of the previous {len(past)} steps"], "loss_spike",
                                   exit_code=errors.NON_FINITE, step=step, since=rec.get("time", obs.now)))
        return out


class Straggler:
    """One rank's busy (CPU) time per step far above the others' for ``beats`` steps: the median of its last
    ``beats`` steps (each heartbeat carries its recent per-step busy times, so a look that misses a step misses
    nothing) above ``factor`` x the median of the other ranks'. Step times alone cannot show it under data
    parallelism: every rank waits for the slowest in the gradient reduction, so the fast ones report the long
    step times; the slow rank is the one that is busy for longer."""

    name = "straggler"

    def __init__(self, factor: float, beats: int):
        self.factor, self.beats = factor, max(1, beats)
        self.reported: set[int] = set()

    def check(self, obs: Observation) -> list[Finding]:
        recent = {r: hb["busy_recent"][-self.beats:] for r, hb in obs.heartbeats.items()
                  if len(hb.get("busy_recent") or []) >= self.beats and hb.get("phase") != "exited"}
        if len(recent) < 2:
            return []
        medians = {r: statistics.median(v) for r, v in recent.items()}
        out = []
        for rank, mine in medians.items():
            others = statistics.median(m for r, m in medians.items() if r != rank)
            slow = mine > self.factor * others and mine - others > 0.05
            if mine < (1 + self.factor) / 2 * others:  # hysteresis: a report is not repeated while it wavers
                self.reported.discard(rank)
            if not slow:
                continue
            if rank not in self.reported:
                self.reported.add(rank)
                hb = obs.heartbeats[rank]
                out.append(Finding(self.name, f"straggler:{rank}",
                                   [f"rank {rank}: busy {mine:.3f} s per step (median of its last {self.beats} "
                                    f"steps, to step {hb.get('step')}) > {self.factor:g} x the others' "
                                    f"{others:.3f} s"], "straggler", rank=rank, step=hb.get("step"),
                                   since=obs.now, exit_code=errors.COLLECTIVE_ERROR))
        return out


_DISK_FULL = re.compile(r"No space left on device|File too large|Disk quota exceeded|\bENOSPC\b|\bEFBIG\b|"
                        r"errno 28\b|errno 27\b", re.IGNORECASE)


class DiskFull:
    """The run directory's filesystem is full (or a file-size limit or quota hit): a failed write in the output,
    or free space below ``min_free_mb``."""

    name = "disk_full"

    def __init__(self, min_free_mb: float):
        self.min_free_mb = min_free_mb

    def check(self, obs: Observation) -> list[Finding]:
        hits = [ln for ln in obs.new_lines if _DISK_FULL.search(ln.text)]
        low = obs.disk_free_mb is not None and obs.disk_free_mb < self.min_free_mb
        if not hits and not low:
            return []
        evidence = [f"{ln.source}: {ln.text.strip()[:300]}" for ln in hits[:3]]
        if low:
            evidence.append(f"{obs.disk_free_mb:,.0f} MB free under the run directory < aegis.min_free_mb "
                            f"{self.min_free_mb:g}")
        return [Finding(self.name, "disk_full", evidence, "disk_full", exit_code=errors.CHECKPOINT_ERROR,
                        rank=hits[0].rank if hits else None, since=hits[0].time if hits else obs.now)]


_CORRUPT = re.compile(r"checkpoint (\S+) failed verification")


class CheckpointCorrupt:
    """The trainer found its newest checkpoint corrupt and fell back to the previous one (noted: it repaired
    itself; the steps since that one are redone)."""

    name = "checkpoint_corrupt"

    def check(self, obs: Observation) -> list[Finding]:
        return [Finding(self.name, "checkpoint_corrupt", [f"{ln.source}: {ln.text.strip()[:300]}"], "rank_exit",
                        forced_action="alert", since=ln.time, exit_code=errors.CHECKPOINT_ERROR)
                for ln in obs.new_lines if _CORRUPT.search(ln.text)]


PRIORITY = ["gpu_hardware", "disk_full", "oom", "nonfinite", "loss_spike", "rank_exited", "hang", "collective",
            "nic", "checkpoint_corrupt", "straggler"]
"""Most specific first: when several rules fire in one look, the first is taken as the cause."""


def build_detectors(cfg) -> list:
    """Every rule, configured from ``[aegis]``."""
    timeouts = {"startup": cfg.startup_timeout_s, "train": cfg.heartbeat_timeout_s,
                "checkpoint": cfg.checkpoint_timeout_s, "eval": cfg.eval_timeout_s}
    return [RankExited(), CollectiveFault(), OutOfMemory(), NonFiniteLoss(), Hang(timeouts, cfg.stopped_timeout_s),
            GpuHardware(),
            NicFlap(cfg.nic_flaps, cfg.nic_window_s), LossSpike(cfg.spike_window, cfg.spike_sigma,
                                                               cfg.spike_min_steps),
            Straggler(cfg.straggler_factor, cfg.straggler_beats), DiskFull(cfg.min_free_mb), CheckpointCorrupt()]


def diagnose(detectors: list, obs: Observation) -> list[Finding]:
    """Every finding of one look, the root cause first (``PRIORITY``)."""
    found = [f for d in detectors for f in d.check(obs)]
    return sorted(found, key=lambda f: PRIORITY.index(f.detector) if f.detector in PRIORITY else len(PRIORITY))
