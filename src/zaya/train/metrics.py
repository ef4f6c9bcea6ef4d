"""What a run reports: its ``metrics.jsonl`` records (``zaya.core.metrics_file`` writes them; the fields are listed
in docs/training.md), optionally as TensorBoard scalars too, the experts' load figures, and the live progress line.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from zaya.core.errors import writing
from zaya.core.metrics_file import MetricsWriter

RUN_DIR_ELSEWHERE = "point train.run_dir (--run-dir) elsewhere"
"""The fix a full disk under the run directory names, beside freeing space."""


def expert_load_stats(counts: list[list[float]], num_experts: int) -> dict[str, Any]:
    """From global per-layer router-class counts (host numbers, [layers][classes]), per layer: each class's share of
    the layer's tokens, the busiest expert's load over the mean, the coefficient of variation of the experts' loads
    (std / mean), the entropy of the load distribution over the experts divided by log(experts) (1 = even), and
    the skip class's share (0 without one). A layer whose experts got no tokens gets None for the expert figures."""
    load, over_mean, cv, entropy, skip = [], [], [], [], []
    for row in counts:
        total = max(sum(row), 1)
        load.append([round(x / total, 5) for x in row])
        real = row[:num_experts]
        routed = sum(real)
        skip.append(round(sum(row[num_experts:]) / total, 5))
        if routed <= 0:
            over_mean.append(None), cv.append(None), entropy.append(None)
            continue
        mean = routed / len(real)
        over_mean.append(round(max(real) / mean, 4))
        cv.append(round(math.sqrt(sum((x - mean) ** 2 for x in real) / len(real)) / mean, 4))
        shares = [x / routed for x in real if x > 0]
        entropy.append(round(abs(sum(q * math.log(q) for q in shares)) / math.log(len(real)), 4) if len(real) > 1
                       else 1.0)
    return {"expert_load": load, "expert_load_max_over_mean": over_mean, "expert_load_cv": cv,
            "expert_load_entropy": entropy, "skip_fraction": skip}


class MetricsLog:
    """Appends records to ``metrics.jsonl`` (rank 0 only) and, optionally, TensorBoard scalars. A full disk is a
    DiskFullError (exit 5) naming the file: a run whose record cannot be kept stops instead of losing it."""

    def __init__(self, path: Path, enabled: bool, tensorboard_dir: Path | None = None):
        self.path = path
        self.enabled = enabled
        self._file = None
        if enabled:
            with self._writing():
                self._file = MetricsWriter(path)
        self._tb = None
        if enabled and tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError("train.tensorboard = true needs the tensorboard package: "
                                  "pip install tensorboard") from exc
            self._tb = SummaryWriter(str(tensorboard_dir))

    def _writing(self):
        return writing(self.path.parent, f"writing {self.path.name}", RUN_DIR_ELSEWHERE)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self._writing():
            self._file.write(record)
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "time"):
                    self._tb.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:  # what it still held could not be written: write() has raised that already
                pass
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class Progress:
    """A live line (rich) on a terminal; plain log lines every ``log_every`` steps otherwise."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool, log_every: int):
        self.enabled = enabled
        self.log_every = log_every
        self.total = total_steps
        self._bar = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn
            from rich.progress import TimeRemainingColumn

            self._bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, info="")
            self._bar.start()

    def log(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = format_step(record, self.total)
        if self._bar is not None:
            self._bar.update(self._task, completed=record["step"], info=line.split("  ", 1)[1])
            if record["step"] % self.log_every == 0:
                self._bar.console.print(line, markup=False, highlight=False)
        elif record["step"] % self.log_every == 0 or record["step"] in (1, self.total):
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def format_step(r: dict[str, Any], total: int) -> str:
    load = max((x for x in r.get("expert_load_max_over_mean") or [] if x is not None), default=float("nan"))
    return (f"step {r['step']:>6}/{total}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  grad {r['grad_norm']:.3f}  "
            f"{r['tokens_per_s']:,.0f} tok/s  mfu {100 * r['mfu']:.1f}%  load {load:.2f}  [{r['stage']}]")
