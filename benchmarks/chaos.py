"""Aegis under fire: a `zaya run` of the tiny model on 2 CPU ranks with a fault every ``--every`` seconds, of
mixed kinds in turn (SIGKILL of a rank, SIGSTOP of a rank (a hang), a NaN gradient, a collective stall shorter
than the hang timeout), for ``--minutes`` minutes; then SIGTERM to the supervisor (it stops the ranks with a
checkpoint, exit 75).

Printed (and with ``--json`` one JSON line): faults injected and decisions per kind, whether each was recovered,
mean time to detect (from the injection: ``aegis/chaos.jsonl``) and to recover, steps redone, ETTR (productive step
time / wall time, from the first launch to the end), and "nothing lost": the kept timeline's steps are 1..N
without a gap, and the last checkpoint is the last step. A stall must cause no decision. Also: relaunches served
by the warm standby, seconds of steps trained twice, and the median step time with and without a periodic save
just before it (that cost counts as productive step time, so ETTR does not show it).

    python benchmarks/chaos.py                      # 10 minutes, a fault every 2 minutes (the issue's setting)
    python benchmarks/chaos.py --set aegis.warm_standby=false   # the same, every relaunch cold
    python benchmarks/chaos.py --minutes 4 --every 60
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zaya.core.layout import checkpoints_dir, metrics_path
from zaya.core.metrics_file import stepped_records

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["kill", "hang", "nan", "stall"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=120.0, help="seconds between faults")
    ap.add_argument("--config", default=str(ROOT / "configs/tiny.toml"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--hang-timeout", type=float, default=20.0, help="aegis.heartbeat_timeout_s")
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another config override, e.g. --set aegis.warm_standby=false (repeatable)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT / "src"))
    from zaya.aegis.env import aegis_dir
    from zaya.aegis.chaos import read_injections, request
    from zaya.aegis.events import read_events, summarise
    from zaya.aegis.heartbeat import read_heartbeats

    run = Path(args.run_dir or tempfile.mkdtemp(prefix="aegis-chaos-")) / "run"
    sets = ['train.dtype="float32"', 'optim.muon_ns_dtype="float32"', "train.sample_tokens=0",
            "train.eval_every=0", f"checkpoint.every={args.checkpoint_every}", "train.log_every=10",
            "optim.schedule_steps=100000", f"aegis.heartbeat_timeout_s={args.hang_timeout}",
            "aegis.startup_timeout_s=300", "aegis.max_repeats=1000", "aegis.poll_s=0.5",
            f'checkpoint.ram_dir="{run}.ram"', *args.set]
    cmd = [sys.executable, "-m", "zaya", "run", "--config", args.config, "--run-dir", str(run), "--max-steps",
           "1000000", "--nproc-per-node", str(args.nproc), "--chaos", "live", "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sup = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    start = time.time()
    end = start + args.minutes * 60
    next_fault, i = start + args.every, 0
    aegis = aegis_dir(run)
    while time.time() < end and sup.poll() is None:
        time.sleep(0.5)
        if time.time() < next_fault:
            continue
        beats = read_heartbeats(aegis)
        if len(beats) < args.nproc or any(b.get("phase") not in ("train", "checkpoint") for b in beats.values()):
            continue  # inject into a training job, not one starting up
        kind = KINDS[i % len(KINDS)]
        rank = 1 if i % 2 == 0 else 0
        request(run, kind, rank, **({"seconds": args.hang_timeout / 3} if kind == "stall" else {}))
        i += 1
        next_fault = time.time() + args.every
    sup.send_signal(signal.SIGTERM)
    _, err = sup.communicate(timeout=300)
    wall = time.time() - start

    report = summarise(run)
    events = read_events(aegis)
    injections = read_injections(aegis)
    decisions = [e for e in events if e.get("kind") == "decision"]
    per_kind = {}
    for inj in injections:
        after = [d for d in decisions if d["time"] >= inj["time"]]
        d = after[0] if after and inj["kind"] != "stall" else None
        if inj["kind"] == "stall":
            stall_decisions = [x for x in decisions if inj["time"] <= x["time"] <= inj["time"] + 30
                               and x["action"] != "alert"]
            row = per_kind.setdefault("stall", {"injected": 0, "restarts_caused": 0})
            row["injected"] += 1
            row["restarts_caused"] += len(stall_decisions)
            continue
        row = per_kind.setdefault(inj["kind"], {"injected": 0, "recovered": 0, "detect_s": [], "recover_s": [],
                                                "redone": 0, "detectors": []})
        row["injected"] += 1
        if d is not None:
            row["detectors"].append(d["detector"])
            row["detect_s"].append(round(d["time"] - inj["time"], 2))
            if d.get("outcome") == "recovered":
                row["recovered"] += 1
                row["recover_s"].append(d.get("time_to_recover_s"))
                row["redone"] += d.get("steps_redone") or 0
    records, timeline = {}, []
    for r in stepped_records(metrics_path(run).read_bytes()):
        if r.get("kind") == "train":
            records[r["step"]] = r
            timeline.append(r)
    steps = sorted(records)
    # Where the rest of the wall time went: steps trained twice (the superseded records), and what a periodic
    # save costs the step after it (counted as productive step time, so ETTR does not show it).
    redone_s = sum(r.get("step_time_s", 0) for r in timeline) - sum(r.get("step_time_s", 0) for r in records.values())
    every = args.checkpoint_every
    after = [b["step_time_s"] for a, b in zip(timeline, timeline[1:]) if b["step"] == a["step"] + 1
             and a["step"] % every == 0 and "step_time_s" in b]
    plain = [b["step_time_s"] for a, b in zip(timeline, timeline[1:]) if b["step"] == a["step"] + 1
             and a["step"] % every != 0 and "step_time_s" in b]
    from zaya.checkpoint.store import latest_checkpoint, read_meta

    newest = latest_checkpoint(checkpoints_dir(run))
    last_saved = read_meta(newest)["step"] if newest else None
    result = {"minutes": args.minutes, "every_s": args.every, "wall_s": round(wall, 1), "steps": len(steps),
              "no_gap": steps == list(range(1, len(steps) + 1)), "last_checkpoint_step": last_saved,
              "nothing_lost": steps == list(range(1, len(steps) + 1)) and last_saved == (steps[-1] if steps else None),
              "supervisor_exit": sup.returncode, "ettr": report["ettr"], "productive_s": report["productive_s"],
              "warm_launches": report["warm_launches"], "redone_s": round(redone_s, 1),
              "median_step_s": round(statistics.median(plain), 3) if plain else None,
              "median_step_after_save_s": round(statistics.median(after), 3) if after else None,
              "per_kind": per_kind, "decisions": [(d["detector"], d["action"], d.get("outcome")) for d in decisions]}
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    return 0 if result["nothing_lost"] else 1


if __name__ == "__main__":
    sys.exit(main())
