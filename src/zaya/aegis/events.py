"""``events.jsonl``: every decision Aegis makes (time, detector, evidence, action, outcome), and ``zaya aegis
report RUN_DIR``, which summarises them with the figures: time to detect, time to recover, steps redone, ETTR.

The file is rewritten whole, through a temporary file and a rename, whenever an event is added or its outcome
filled in: a crash of the supervisor leaves the previous complete file, never a torn one (the log is small: one
line per decision).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from zaya.core.errors import ConfigError
from zaya.core.fsutil import atomic_write_text, loads_json

EVENTS_FILE = "events.jsonl"


class EventLog:
    def __init__(self, aegis: Path):
        self.path = Path(aegis) / EVENTS_FILE
        self.events: list[dict[str, Any]] = read_events(aegis)

    def add(self, **event: Any) -> dict[str, Any]:
        event = {"time": time.time(), **event}
        self.events.append(event)
        self.flush()
        return event

    def flush(self) -> None:
        atomic_write_text(self.path, "".join(json.dumps(e, default=str) + "\n" for e in self.events))


def read_events(aegis: Path) -> list[dict[str, Any]]:
    """The events of ``aegis``/events.jsonl; a line that is not a JSON object is a ConfigError naming the file and
    the line (the supervisor rewrites the file whole: such a line was not written by it)."""
    path = Path(aegis) / EVENTS_FILE
    if not path.is_file():
        return []
    out = []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            event = loads_json(line)
        except ValueError as exc:
            event = exc
        if not isinstance(event, dict):
            why = event if isinstance(event, ValueError) else f"a JSON {type(event).__name__}, not an object"
            raise ConfigError(f"{path}:{number}: not an Aegis event ({why}); the file was damaged or not written by "
                              "zaya run: move it aside (zaya run then starts a new log)")
        out.append(event)
    return out


def summarise(run_dir: Path) -> dict[str, Any]:
    """The figures of a supervised run, from its events (and the chaos injections, when there were any: the time
    to detect is then measured from the injection itself)."""
    from zaya.aegis.env import aegis_dir
    from zaya.aegis.chaos import read_injections

    aegis = aegis_dir(run_dir)
    if not aegis.is_dir():
        raise FileNotFoundError(f"{aegis}: no Aegis directory: {run_dir} was not run under `zaya run`")
    events = read_events(aegis)
    decisions = [e for e in events if e.get("kind") == "decision"]
    injections = read_injections(aegis)
    per_kind: dict[str, dict[str, list[float]]] = {}
    for d in decisions:
        row = per_kind.setdefault(str(d.get("detector")), {"count": [], "detect_s": [], "recover_s": [], "redone": []})
        row["count"].append(1)
        if d.get("time_to_detect_s") is not None:
            row["detect_s"].append(d["time_to_detect_s"])
        if d.get("time_to_recover_s") is not None:
            row["recover_s"].append(d["time_to_recover_s"])
        if d.get("steps_redone") is not None:
            row["redone"].append(d["steps_redone"])
    summary = next((e for e in reversed(events) if e.get("kind") == "summary"), None)

    def stat(xs: list[float]) -> float | None:
        return round(statistics.fmean(xs), 3) if xs else None

    return {"run_dir": str(run_dir), "decisions": len(decisions), "injections": len(injections),
            "restarts": sum(1 for d in decisions if d.get("action") in ("restart", "rewind", "exclude", "backoff")),
            "warm_launches": sum(1 for e in events if e.get("kind") == "launch" and e.get("warm")),
            "by_detector": {k: {"count": len(v["count"]), "mean_time_to_detect_s": stat(v["detect_s"]),
                                "mean_time_to_recover_s": stat(v["recover_s"]),
                                "steps_redone": sum(v["redone"])} for k, v in per_kind.items()},
            "outcome": summary.get("outcome") if summary else "running or interrupted",
            "ettr": summary.get("ettr") if summary else None,
            "wall_s": summary.get("wall_s") if summary else None,
            "productive_s": summary.get("productive_s") if summary else None,
            "exit_code": summary.get("exit_code") if summary else None,
            "diagnosis": summary.get("diagnosis") if summary else None,
            "events": decisions}


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['run_dir']}: {report['outcome']}"
             + (f" (exit code {report['exit_code']})" if report["exit_code"] is not None else ""),
             f"  {report['decisions']} decision(s), {report['restarts']} relaunch(es) "
             f"({report['warm_launches']} from the warm standby), {report['injections']} injected fault(s)"]
    if report["ettr"] is not None:
        lines.append(f"  ETTR {report['ettr']:.3f} (productive step time {report['productive_s']:.1f} s of "
                     f"{report['wall_s']:.1f} s wall)")
    if report["diagnosis"]:
        lines.append(f"  diagnosis: {report['diagnosis']}")
    for name, row in report["by_detector"].items():
        detect = f"{row['mean_time_to_detect_s']:.1f} s" if row["mean_time_to_detect_s"] is not None else "-"
        recover = f"{row['mean_time_to_recover_s']:.1f} s" if row["mean_time_to_recover_s"] is not None else "-"
        lines.append(f"  {name:<18} x{row['count']}  detect {detect:>8}  recover {recover:>8}  steps redone "
                     f"{row['steps_redone']}")
    for e in report["events"]:
        when = time.strftime("%H:%M:%S", time.localtime(e["time"]))
        lines.append(f"  {when} attempt {e.get('attempt')}: {e['detector']} -> {e['action']} "
                     f"[{e.get('outcome')}] {e['evidence'][0] if e.get('evidence') else ''}")
    return "\n".join(lines)
