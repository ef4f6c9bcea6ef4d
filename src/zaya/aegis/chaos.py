"""Fault injection (``zaya chaos``, the tests, benchmarks/chaos.py): the faults long runs suffer, made on purpose.

A plan is a JSON list of faults, each ``{"kind": K, "step": S, "rank": R, "attempt": A, ...}``: inject K on rank R
(null: every rank) right after step S of launch A (null: every launch; "repeat past the limit" tests use that).
``ZAYA_CHAOS=PLAN`` makes every rank run ``ChaosHook``, a trainer callback, so injection needs no edits across the
trainer. ``zaya chaos inject RUN_DIR KIND`` injects into a live supervised run at once: signals go straight to the
rank's pid (from its heartbeat, once the pid is checked to still be that rank: not exited, on this host, the same
process start time, a ``zaya train`` command line), log lines into the watched log, and in-trainer kinds as a
request file the hook picks up after the next step (the run must have been started with ``zaya run --chaos``).

Kinds: ``kill`` (SIGKILL), ``hang`` (SIGSTOP), ``raise`` (an exception: exit 70), ``nan`` (the next step's
gradient is NaN), ``slow`` (``seconds`` of busy CPU work in each of ``steps`` steps: a straggler), ``stall`` (one
pause of ``seconds``, shorter than the hang timeout: must cause no restart), ``corrupt_checkpoint`` (rank 0 waits
for the save in flight, flips bytes in the newest checkpoint, drops the RAM-tier copy as a reboot would, then
SIGKILLs itself), ``disk_full`` (RLIMIT_FSIZE of ``bytes``: the next checkpoint write fails with EFBIG),
``xid`` / ``ecc`` / ``link_down`` / ``oom`` (a fake kernel-log line appended to ``log``, by default the first
``aegis.watch_logs`` file).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil

from zaya.aegis.env import ATTEMPT_ENV, CHAOS_ENV
from zaya.core.errors import ConfigError
from zaya.core.layout import checkpoints_dir
from zaya.core.fsutil import loads_json, read_json
from zaya.train.callbacks import Callback

KINDS = ("kill", "hang", "raise", "nan", "slow", "stall", "corrupt_checkpoint", "disk_full", "xid", "ecc",
         "link_down", "oom")
IN_TRAINER = ("raise", "nan", "slow", "stall", "corrupt_checkpoint", "disk_full")
REQUESTS = "chaos-requests"
LOG_LINES = {
    "xid": "NVRM: Xid (PCI:{device}): 79, pid=0, GPU has fallen off the bus.",
    "ecc": "NVRM: Xid (PCI:{device}): 48, pid=0, An uncorrectable double bit error (DBE) has been detected.",
    "link_down": "mlx5_core 0000:17:00.0: mlx5_port_module_event: Link down",
    "oom": "Out of memory: Killed process {pid} (python) total-vm:1024kB",
}


def load_plan(path: str | Path) -> list[dict[str, Any]]:
    """Read and check a chaos plan; errors name the file and the entry."""
    path = Path(path)
    try:
        plan = read_json(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"chaos plan {path}: cannot be read as JSON ({exc}); expected a list of "
                          '{"kind": ..., "step": ..., "rank": ...}') from None
    if not isinstance(plan, list):
        raise ConfigError(f"chaos plan {path}: expected a JSON list of faults")
    for i, fault in enumerate(plan):
        if not isinstance(fault, dict) or fault.get("kind") not in KINDS:
            raise ConfigError(f"chaos plan {path}: entry {i} ({fault!r}) needs a kind among {', '.join(KINDS)}")
        if not isinstance(fault.get("step", 0), int) or fault.get("step", 0) < 0:
            raise ConfigError(f"chaos plan {path}: entry {i}: step must be an integer >= 0")
    return plan


def chaos_log(aegis: Path) -> Path:
    return Path(aegis) / "chaos.jsonl"


def record_injection(aegis: Path, fault: dict[str, Any], **extra: Any) -> None:
    """Append what was injected and when (one line, one write), so the report can time detection against it."""
    line = json.dumps({"time": time.time(), **fault, **extra}) + "\n"
    Path(aegis).mkdir(parents=True, exist_ok=True)
    with open(chaos_log(aegis), "a", encoding="utf-8") as fh:
        fh.write(line)


def read_injections(aegis: Path) -> list[dict[str, Any]]:
    path = chaos_log(aegis)
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(loads_json(line))
        except ValueError:  # a torn last line of a killed writer
            continue
    return [rec for rec in out if isinstance(rec, dict)]


def append_log_line(path: str | Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text.rstrip("\n") + "\n")


def corrupt_newest_checkpoint(run_dir: Path, ram_dir: Path | None = None) -> Path | None:
    """Flip bytes in the middle of the newest checkpoint's largest data file, and drop the RAM-tier copies (as a
    node reboot would: otherwise the restart reads RAM and never sees the disk copy). Returns the file."""
    from zaya.checkpoint.store import latest_checkpoint

    newest = latest_checkpoint(checkpoints_dir(run_dir))
    if newest is None:
        return None
    files = sorted((p for p in newest.rglob("*") if p.is_file() and p.suffix == ".distcp"),
                   key=lambda p: p.stat().st_size)
    target = files[-1] if files else max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(target, "r+b") as fh:
        fh.seek(target.stat().st_size // 2)
        chunk = fh.read(64)
        fh.seek(target.stat().st_size // 2)
        fh.write(bytes(b ^ 0xFF for b in chunk))
    if ram_dir is not None and ram_dir.is_dir():
        import shutil

        shutil.rmtree(ram_dir, ignore_errors=True)
    return target


class ChaosHook(Callback):
    """Injects the plan's faults (and live requests) on this rank; see the module docstring."""

    def __init__(self, plan: list[dict[str, Any]], aegis: Path | None):
        self.plan, self.aegis = plan, aegis
        self.rank = int(os.environ.get("RANK", "0"))
        self.attempt = int(os.environ.get(ATTEMPT_ENV, "0"))
        self.slow: list[tuple[int, float]] = []  # (until step, seconds)
        self.poison = None

    @classmethod
    def from_env(cls) -> "ChaosHook":
        from zaya.aegis.env import AEGIS_DIR_ENV

        where = os.environ.get(AEGIS_DIR_ENV)
        spec = os.environ[CHAOS_ENV]
        plan = [] if spec in ("", "live") else load_plan(spec)
        return cls(plan, Path(where) if where else None)

    def _mine(self, fault: dict[str, Any]) -> bool:
        rank, attempt = fault.get("rank", 0), fault.get("attempt", 0)
        return (rank is None or rank == self.rank) and (attempt is None or attempt == self.attempt)

    def _requests(self) -> list[dict[str, Any]]:
        """Live requests from ``zaya chaos inject`` for this rank (each file taken once, by its rank)."""
        if self.aegis is None or not (self.aegis / REQUESTS).is_dir():
            return []
        out = []
        for path in sorted((self.aegis / REQUESTS).glob(f"rank-{self.rank:05d}-*.json")):
            try:
                fault = read_json(path)
            except OSError:
                continue
            except ValueError:  # not a request `zaya chaos inject` writes: dropped, never injected
                fault = None
            path.unlink(missing_ok=True)
            if isinstance(fault, dict) and fault.get("kind") in IN_TRAINER:
                out.append(fault)
        return out

    def on_step_end(self, trainer, record: dict[str, Any]) -> None:
        step = record["step"]
        if self.poison is not None:
            self.poison.remove()
            self.poison = None
        for until, seconds in self.slow:
            if step <= until:
                _busy(seconds)
        faults = [f for f in self.plan if f.get("step", 0) == step and self._mine(f)] + self._requests()
        for fault in faults:
            self.inject(trainer, fault, step)

    def inject(self, trainer, fault: dict[str, Any], step: int) -> None:
        kind = fault["kind"]
        if self.aegis is not None:
            record_injection(self.aegis, fault, injected_rank=self.rank, injected_step=step, attempt=self.attempt)
        trainer.log(f"chaos: injecting {kind} on rank {self.rank} after step {step}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "raise":
            raise RuntimeError(f"chaos: injected exception on rank {self.rank} after step {step}")
        elif kind == "nan":
            self._poison_next_gradient(trainer)
        elif kind == "slow":
            self.slow.append((step + int(fault.get("steps", 5)), float(fault.get("seconds", 1.0))))
        elif kind == "stall":
            time.sleep(float(fault.get("seconds", 3.0)))
        elif kind == "disk_full":
            import resource

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
            limit = int(fault.get("bytes", 1 << 20))
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        elif kind == "corrupt_checkpoint":
            trainer.store.wait_quietly()
            ram = getattr(trainer.store, "ram", None)
            corrupt_newest_checkpoint(trainer.run_dir, ram.directory if ram is not None else None)
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind in LOG_LINES:
            log = fault.get("log") or (trainer.config.aegis.watch_logs or [None])[0]
            if not log:
                raise ConfigError(f"chaos {kind}: no log to write to: give the fault a \"log\" or set "
                                  "aegis.watch_logs")
            append_log_line(log, LOG_LINES[kind].format(device=fault.get("device", f"cpu:{self.rank}"),
                                                        pid=os.getpid()))

    def _poison_next_gradient(self, trainer) -> None:
        param = next(p for p in trainer.parallel.wrapped.parameters() if p.requires_grad)
        state = {"armed": True}

        def hook(grad):
            if state["armed"]:
                state["armed"] = False
                return grad * float("nan")
            return grad

        self.poison = param.register_hook(hook)


def _busy(seconds: float) -> None:
    """Burn CPU for ``seconds`` (a slow device keeps its host busy too; sleeping would look idle)."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def _live_rank(run_dir: Path, rank: int, hb: dict[str, Any] | None) -> psutil.Process:
    """The live process of ``rank``, checked against its heartbeat (phase, host, pid, start time, command line):
    a signal goes to that rank or nowhere."""
    from zaya.aegis.heartbeat import rank_process

    if hb is None:
        raise ConfigError(f"{run_dir}: no heartbeat of rank {rank} (is `zaya run` training there?)")
    if hb.get("phase") == "exited":
        raise ConfigError(f"{run_dir}: rank {rank} has exited (its heartbeat says exit code {hb.get('exit_code')}); "
                          "there is no live rank to signal: inject into a run that is training")
    proc, why = rank_process(hb)
    if proc is None:
        raise ConfigError(f"{run_dir}: refusing to signal rank {rank}: {why}. Its heartbeat is stale: inject into "
                          "a run that is training now (run `zaya chaos` on the rank's host)")
    return proc


def request(run_dir: Path, kind: str, rank: int, **options: Any) -> str:
    """Inject ``kind`` into a live supervised run now (``zaya chaos inject``); returns what was done."""
    from zaya.aegis.env import aegis_dir
    from zaya.aegis.heartbeat import heartbeat_dir, read_heartbeats

    if kind not in KINDS:
        raise ConfigError(f"chaos kind {kind!r}: choose one of {', '.join(KINDS)}")
    aegis = aegis_dir(run_dir)
    problems: dict[Path, str] = {}
    beats = read_heartbeats(aegis, problems)
    fault = {"kind": kind, "rank": rank, **options}
    if kind in ("kill", "hang"):
        own = heartbeat_dir(aegis) / f"rank-{rank:05d}.json"
        if rank not in beats and own in problems:
            raise ConfigError(f"{run_dir}: refusing to signal rank {rank}: its heartbeat {own} is not one a rank "
                              f"writes ({problems[own]}); nothing was sent. Inject into a run that is training now")
        proc = _live_rank(run_dir, rank, beats.get(rank))
        record_injection(aegis, fault, injected_rank=rank, injected_step=beats[rank].get("step"),
                         attempt=beats[rank].get("attempt"))
        try:
            proc.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        except psutil.NoSuchProcess:  # it ended (or its pid was taken) since the check: psutil signals nothing
            raise ConfigError(f"{run_dir}: rank {rank} (pid {proc.pid}) ended before the signal; nothing was "
                              "sent") from None
        return f"sent {'SIGKILL' if kind == 'kill' else 'SIGSTOP'} to rank {rank} (pid {proc.pid})"
    if kind in LOG_LINES:
        log = options.get("log")
        if not log:
            raise ConfigError(f"chaos {kind}: pass --log FILE (a log the supervisor watches: aegis.watch_logs)")
        append_log_line(log, LOG_LINES[kind].format(device=options.get("device") or f"cpu:{rank}", pid=0))
        record_injection(aegis, fault, injected_rank=rank, injected_step=beats.get(rank, {}).get("step"))
        return f"appended a {kind} line to {log}"
    directory = aegis / REQUESTS
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank-{rank:05d}-{time.time_ns()}.json"
    from zaya.aegis.heartbeat import write_json_atomic

    write_json_atomic(path, fault)
    return f"requested {kind} on rank {rank} after its next step ({path})"
