"""Per-rank heartbeats: a trainer callback writes a small JSON file per rank (``heartbeat/rank-NNNNN.json`` in the
Aegis directory), atomically (write, then rename), at start-up, after every step, around evaluations and saves,
and when the rank ends. The supervisor reads them to see progress (a hang is a heartbeat too old for its phase),
step times and losses per rank, the rank's pid (with its process start time, so that a reused pid is never
taken for the rank) and device, and how each rank ended (its exit code).

A heartbeat says which phase comes next, so the supervisor applies the right timeout: after the step that an
evaluation or a checkpoint follows, the phase is already "eval" or "checkpoint" (the trainer's loop order:
step, on_step_end, evaluation, save).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections import deque
from pathlib import Path
from typing import Any

import psutil

from zaya.core import procs
from zaya.aegis.lineage import live_process
from zaya.core.errors import exit_code_of
from zaya.core.fsutil import atomic_write_text, read_json
from zaya.train.callbacks import Callback

PHASES = ("startup", "train", "checkpoint", "eval")
"""Phases of a live rank; a rank that ended has phase "exited" and an ``exit_code``."""


def heartbeat_dir(aegis: Path) -> Path:
    return Path(aegis) / "heartbeat"


def write_json_atomic(path: Path, doc: dict[str, Any]) -> None:
    """Aegis's files (heartbeats, directives, requests) are written whole but not durably: they must survive the
    writer's crash (never a torn file), not a power cut, and an fsync per step would cost more than they are worth."""
    atomic_write_text(path, json.dumps(doc), durable=False)


def device_id(device: Any) -> str:
    """The id a kernel log line names the rank's device by: the PCI bus id on CUDA/ROCm, ``cpu:<local rank>`` on
    a CPU (so a test line can name a CPU rank the way an Xid line names a GPU)."""
    try:
        import torch

        if getattr(device, "type", "") == "cuda":
            p = torch.cuda.get_device_properties(device)
            return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}"
    except Exception:  # noqa: BLE001 - an unknown id only weakens the device mapping of a hardware finding
        pass
    return f"cpu:{os.environ.get('LOCAL_RANK', '0')}"


class Heartbeat(Callback):
    """Writes this rank's heartbeat; see the module docstring."""

    def __init__(self, aegis: Path):
        self.rank = int(os.environ.get("RANK", "0"))
        self.path = heartbeat_dir(aegis) / f"rank-{self.rank:05d}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.doc: dict[str, Any] = {"rank": self.rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                                    **procs.record(),  # host, pid and its start time
                                    "attempt": int(os.environ.get("ZAYA_AEGIS_ATTEMPT", "0")), "step": 0,
                                    "loss": None, "step_time_s": None, "busy_s": None, "phase": "startup",
                                    "device": None, "resumed_step": None, "resumed_source": None}
        self._cpu = time.process_time()
        self._busy: deque[float] = deque(maxlen=8)
        self.beat("startup")

    def beat(self, phase: str, **fields: Any) -> None:
        self.doc.update(fields, phase=phase, time=time.time())
        try:
            write_json_atomic(self.path, self.doc)
        except OSError:  # a full disk must not kill training; the supervisor sees the heartbeat go stale
            pass

    def _next_phase(self, trainer, step: int) -> str:
        tc, ck = trainer.config.train, trainer.config.checkpoint
        if step >= tc.max_steps:
            return "eval"  # the final validation, then the final save
        if tc.eval_every and step % tc.eval_every == 0:
            return "eval"
        if ck.every and step % ck.every == 0:
            return "checkpoint"
        return "train"

    def on_start(self, trainer) -> None:
        resumed = trainer.resumed_from or {}
        first_eval = trainer.progress.step == 0 and trainer.config.train.eval_every > 0
        self._cpu = time.process_time()
        self.beat("eval" if first_eval else "startup", step=trainer.progress.step,
                  device=device_id(trainer.runtime.device), resumed_step=resumed.get("step"),
                  resumed_source=resumed.get("source"), world_size=trainer.runtime.world_size)

    def on_step_end(self, trainer, record: dict[str, Any]) -> None:
        cpu = time.process_time()
        busy, self._cpu = cpu - self._cpu, cpu
        self._busy.append(round(busy, 4))
        loss = record.get("loss")
        self.beat(self._next_phase(trainer, record["step"]), step=record["step"],
                  loss=loss if loss is None or loss == loss and abs(loss) != float("inf") else str(loss),
                  step_time_s=record.get("step_time_s"), busy_s=busy, busy_recent=list(self._busy), skipped=bool(record.get("skipped")))

    def on_evaluation(self, trainer, record: dict[str, Any]) -> None:
        step, ck = record["step"], trainer.config.checkpoint
        due = step >= trainer.config.train.max_steps or (ck.every and step % ck.every == 0 and step > 0)
        self.beat("checkpoint" if due else "train", val_loss=record.get("val_loss"))
        self._cpu = time.process_time()

    def on_save(self, trainer, step: int, reason: str) -> None:
        final = reason != "periodic"
        self.beat("checkpoint" if final else "train", saved_step=step)
        self._cpu = time.process_time()

    def on_stop(self, trainer, summary: dict[str, Any]) -> None:
        self.beat("exited", exit_code=0 if summary.get("finished") else 75, step=trainer.progress.step)

    def on_error(self, trainer, error: BaseException) -> None:
        text = str(error).strip().splitlines()
        self.beat("exited", exit_code=exit_code_of(error) if isinstance(error, Exception) else 130,
                  error=f"{type(error).__name__}: {text[0] if text else ''}"[:500])


_NUMBER = (int, float)
_FIELDS: dict[str, tuple[Any, ...]] = {
    "rank": (int,), "time": _NUMBER, "phase": (str,),  # required: who, when, doing what
    "local_rank": (int,), "attempt": (int,), "step": (int,), "world_size": (int,), "saved_step": (int,),
    "exit_code": (int, None), "resumed_step": (int, None), "host": (str, None), "device": (str, None),
    "error": (str,), "resumed_source": (str, None), "loss": (*_NUMBER, str, None), "val_loss": (*_NUMBER, None),
    "step_time_s": (*_NUMBER, None), "busy_s": (*_NUMBER, None), "busy_recent": (list,), "skipped": (bool,),
}
"""The heartbeat fields the supervisor and ``zaya chaos`` compute with, and the JSON types each may have (bools
are not ints here). ``pid`` and ``started`` are judged by ``rank_process``, which names what is wrong with them."""


def _kind_ok(value: Any, kinds: tuple[Any, ...]) -> bool:
    """``value`` is of one of ``kinds`` (None for JSON null); an int only within int64 (what a rank writes: a
    larger one overflows the float arithmetic of ages and step times)."""
    if value is None or isinstance(value, bool):
        return (value is None and None in kinds) or (isinstance(value, bool) and bool in kinds)
    if isinstance(value, int) and not -2**63 <= value < 2**63:
        return False
    return isinstance(value, tuple(k for k in kinds if isinstance(k, type)))


def parse_heartbeat(path: Path) -> dict[str, Any]:
    """The heartbeat in ``path`` (``rank-NNNNN.json``), checked: a JSON object naming the file's rank, a finite
    time, a known phase, and every field of ``_FIELDS`` of its type. ValueError saying what is wrong otherwise,
    OSError when it cannot be read: a file a rank did not write (or a damaged one) must never be computed with."""
    doc = read_json(path, max_bytes=1 << 20)  # a heartbeat is a few hundred bytes
    if not isinstance(doc, dict):
        raise ValueError(f"a JSON {type(doc).__name__}, not an object")
    for key, kinds in _FIELDS.items():
        if key in ("rank", "time", "phase") and key not in doc:
            raise ValueError(f"no {key!r}")
        if key in doc and not _kind_ok(doc[key], kinds):
            raise ValueError(f"{key} = {str(doc[key])[:80]!r} is not of a heartbeat's kind")
    if path.name != f"rank-{doc['rank']:05d}.json":
        raise ValueError(f"rank {doc['rank']} in a file named {path.name}")
    if not math.isfinite(doc["time"]) or doc["phase"] not in (*PHASES, "exited"):
        raise ValueError(f"time {doc['time']!r} or phase {str(doc['phase'])[:40]!r} is not a heartbeat's")
    if not all(_kind_ok(b, _NUMBER) for b in doc.get("busy_recent", [])):
        raise ValueError("busy_recent holds something other than numbers")
    return doc


def read_heartbeats(aegis: Path, problems: dict[Path, str] | None = None) -> dict[int, dict[str, Any]]:
    """Every rank's newest heartbeat, by rank (a file being replaced is simply read on the next look). A file that
    is not a heartbeat (``parse_heartbeat``) is skipped; ``problems``, when given, gets its path and why."""
    out: dict[int, dict[str, Any]] = {}
    directory = heartbeat_dir(aegis)
    if not directory.is_dir():
        return out
    for path in directory.glob("rank-*.json"):
        try:
            doc = parse_heartbeat(path)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            if problems is not None:
                problems[path] = str(exc)
            continue
        out[doc["rank"]] = doc
    return out


def rank_process(hb: dict[str, Any]) -> tuple[psutil.Process | None, str]:
    """The process a heartbeat names, when it still is that rank: on this host, running, started when the
    heartbeat says (its pid was not reused) and running ``zaya train``; else (None, why). Whatever is about to
    signal a heartbeat's pid asks this first."""
    pid, host = hb.get("pid"), hb.get("host")
    if host != socket.gethostname():
        return None, f"it runs on host {host}, not on this one ({socket.gethostname()})"
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None, f"its heartbeat names no valid pid ({pid!r})"
    started = hb.get("started")
    if not isinstance(started, (int, float)) or isinstance(started, bool):
        return None, f"its heartbeat has no process start time to check pid {pid} against"
    proc = live_process(pid, started)
    if proc is None:
        return None, f"pid {pid} no longer runs the process started at {started:.2f} (it exited, or the pid now " \
                     "names another process)"
    try:
        args = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied) as exc:
        return None, f"the command line of pid {pid} cannot be read ({type(exc).__name__})"
    if not is_rank_command(args):
        return None, f"pid {pid} is not a zaya rank (it runs: {' '.join(args)[:200]})"
    return proc, ""


def is_rank_command(args: list[str]) -> bool:
    """A ``zaya train`` command line: ``python -m zaya train ...`` (torchrun's ranks) or ``.../zaya train ...``."""
    names = [os.path.basename(a) for a in args]
    return any(n in ("zaya", "zaya.__main__") and "train" in args[i + 1:] for i, n in enumerate(names))


def clear_heartbeats(aegis: Path) -> None:
    """Before a relaunch: the old attempt's heartbeats must not be mistaken for the new one's."""
    directory = heartbeat_dir(aegis)
    for path in directory.glob("*.json") if directory.is_dir() else []:
        path.unlink(missing_ok=True)
