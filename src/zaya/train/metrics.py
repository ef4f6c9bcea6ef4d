"""What a run reports: ``metrics.jsonl`` records, the live progress line, MFU and the device's peak FLOP/s.

``metrics.jsonl`` holds one JSON object per line, appended and flushed as they happen (a crash loses at most the
line being written; ``zaya plot`` skips a torn last line). Records have ``kind`` "train" (every step) or "val"
(every ``eval_every`` steps); the fields are listed in docs/training.md.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zaya.core.errors import writing
from zaya.core.hardware import DATASHEET_PEAK_FLOPS, load_profile

RUN_DIR_ELSEWHERE = "point train.run_dir (--run-dir) elsewhere"
"""The fix a full disk under the run directory names, beside freeing space."""


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.bfloat16, size: int = 1024,
                        seconds: float = 0.5) -> float:
    """FLOP/s of a square ``dtype`` matmul on ``device``, the best of a few timed windows (our 'peak')."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    flops = 2 * size**3
    best = 0.0
    deadline = time.perf_counter() + seconds
    torch.mm(a, b)
    while time.perf_counter() < deadline or best == 0.0:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 4 * flops / (time.perf_counter() - start))
    return best


def device_peak_flops(device: torch.device, configured: float = 0.0,
                      dtype: torch.dtype | str = torch.bfloat16) -> tuple[float, str]:
    """(peak FLOP/s, where it came from), for training in ``dtype``: the config's ``train.peak_flops``, else the
    peak ``zaya tune gemm`` measured for ``dtype`` (the device's hardware profile), else a known GPU's datasheet
    (dense bf16), else a quick measurement."""
    if configured > 0:
        return configured, "train.peak_flops"
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    name = str(dtype).removeprefix("torch.")
    profile = load_profile(device)
    if profile.peak_flops.get(name, 0) > 0:
        return float(profile.peak_flops[name]), f"measured {name} peak, hardware profile {profile.path}"
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        for key, peak in DATASHEET_PEAK_FLOPS.items():
            if key in gpu:
                return peak, f"{gpu} datasheet (dense bf16)"
    short = {"bfloat16": "bf16", "float32": "fp32"}.get(name, name)
    return measure_matmul_peak(device, dtype), f"measured {short} matmul on {device.type}"


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


def _drop_torn_line(path: Path) -> None:
    """Cut a half-written last line (a crash mid-write) so the next record starts on a line of its own."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as fh:
        fh.seek(0, 2)
        size = fh.tell()
        fh.seek(max(0, size - 1))
        if fh.read(1) == b"\n":
            return
        data_end = size
        block = 1 << 16
        while data_end > 0:
            start = max(0, data_end - block)
            fh.seek(start)
            chunk = fh.read(data_end - start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                fh.truncate(start + cut + 1)
                return
            data_end = start
        fh.truncate(0)


class MetricsLog:
    """Appends records to ``metrics.jsonl`` (rank 0 only) and, optionally, TensorBoard scalars. A full disk is a
    DiskFullError (exit 5) naming the file: a run whose record cannot be kept stops instead of losing it."""

    def __init__(self, path: Path, enabled: bool, tensorboard_dir: Path | None = None):
        self.path = path
        self.enabled = enabled
        self._fh = None
        if enabled:
            with self._writing():
                _drop_torn_line(path)
                self._fh = open(path, "a", encoding="utf-8")
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
            self._fh.write(json.dumps(record, allow_nan=True) + "\n")
            self._fh.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "time"):
                    self._tb.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def close(self) -> None:
        if self._fh is not None:
            fh, self._fh = self._fh, None
            try:
                fh.close()
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

    def say(self, text: str) -> None:
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
