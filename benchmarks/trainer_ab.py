"""A/B of the training path between two commits: ``configs/tiny.toml`` for N steps through ``zaya train``, with a
base commit's code and this checkout's, alternating run by run in the same environment.

Why a whole-CLI A/B: a refactor of the trainer (parts, callbacks, collectives through the runtime) must neither slow
a step nor change a loss. Both sides get the same data cache, seed and settings; each run's step time is the median
over its steps after the first. Prints one JSON line per run and a summary line (median step time per side, their
ratio, and whether the per-step losses agree).

    python benchmarks/trainer_ab.py --base ee491c6 --dtype float32 --steps 30 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zaya.core.layout import metrics_path
from zaya.core.metrics_file import read_metrics

ROOT = Path(__file__).resolve().parent.parent


def run_once(src: Path, work: Path, name: str, args: argparse.Namespace) -> dict:
    """One ``zaya train`` run with the code under ``src``; returns its step time, throughput and losses."""
    run_dir = work / f"{name}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(src), "ZAYA_CACHE_DIR": str(work / "cache")}
    settings = [f'train.dtype="{args.dtype}"', "train.eval_every=0", "checkpoint.every=0", "train.sample_tokens=0",
                "optim.schedule_steps=300", f'optim.muon_ns_dtype="{args.dtype}"']
    cmd = [sys.executable, "-m", "zaya", "train", "--config", str(ROOT / "configs/tiny.toml"), "--run-dir",
           str(run_dir), "--max-steps", str(args.steps), "--resume", "never"]
    for setting in settings:
        cmd += ["--set", setting]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)
    if done.returncode != 0:
        raise SystemExit(f"{name} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    steps = read_metrics(metrics_path(run_dir), ["train"])["train"]
    step_s = statistics.median(r["step_time_s"] for r in steps[1:])
    return {"side": name, "step_s": round(step_s, 4), "tokens_per_s": round(steps[-1]["global_batch_tokens"] / step_s),
            "losses": [round(r["loss"], 5) for r in steps], "wall_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare against (any git revision)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="train.dtype of both sides (float32 on CPUs without native bf16)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=4, help="runs per side, alternating base/new")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="zaya-ab-") as tmp:
        work = Path(tmp)
        base_tree = work / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_tree), args.base],
                       check=True, capture_output=True)
        try:
            sides = {"base": base_tree / "src", "new": ROOT / "src"}
            runs: dict[str, list[dict]] = {"base": [], "new": []}
            for round_index in range(args.rounds):
                order = ("base", "new") if round_index % 2 == 0 else ("new", "base")
                for name in order:
                    result = run_once(sides[name], work, name, args)
                    runs[name].append(result)
                    print(json.dumps(result), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)],
                           capture_output=True)
    medians = {name: statistics.median(r["step_s"] for r in results) for name, results in runs.items()}
    reference = runs["base"][0]["losses"]
    max_loss_gap = max(abs(a - b) for results in runs.values() for r in results for a, b in zip(r["losses"], reference))
    print(json.dumps({"summary": True, "base": args.base, "dtype": args.dtype, "steps": args.steps,
                      "median_step_s": medians, "new_over_base": round(medians["new"] / medians["base"], 3),
                      "max_loss_gap": max_loss_gap, "final_loss": reference[-1]}))


if __name__ == "__main__":
    main()
