"""benchmarks/long_context.py's cp part as a smoke run: every configuration reports its figures, and context
parallelism divides the activation memory of a rank (a property of the split, not of this machine's speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_long_context_benchmark_smoke_run():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/long_context.py"), "--lengths", "256", "--steps",
                          "1", "--quick-model"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["ranks"], r["method"], r["activation_checkpointing"]) for r in rows] == [
        (1, "-", False), (1, "-", True), (2, "allgather", False), (2, "ring", False)]
    for row in rows:
        assert row["step_s"] > 0 and row["activation_mb_per_rank"] > 0 and "peak_rss_growth_mb_per_rank" in row
    base = rows[0]["activation_mb_per_rank"]
    assert rows[0]["activation_vs_one_process"] == 1.0
    # recomputation keeps the block inputs only; cp keeps half the tokens' activations (plus its exchanges)
    assert rows[1]["activation_mb_per_rank"] < 0.8 * base
    for row in rows[2:]:
        assert row["activation_mb_per_rank"] < 0.8 * base
