"""Shared helpers of the GPU suite (``benchmarks/gpu_suite.sh``, ``benchmarks/gpu_checks.py``): the check context
(device, size level, deadline, scratch directory), timing, subprocesses with their own timeouts, JSON output.

Every check writes its figures into a ``result`` dict as it goes, so that a check that fails half-way still
reports what it measured before the failure.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
LEVELS = ("full", "quick", "smoke")


def say(*parts: Any) -> None:
    """Progress for humans: stderr, flushed (stdout carries only the JSON lines)."""
    print(*parts, file=sys.stderr, flush=True)


class CheckTimeout(Exception):
    """Raised in the check's process when the suite's timeout sends SIGTERM (the partial result is still printed)."""


_CHILDREN: set[int] = set()  # process-group ids of the subprocesses running now


def _kill_children(sig: int = signal.SIGKILL) -> None:
    for pgid in list(_CHILDREN):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def install_sigterm() -> None:
    """SIGTERM (the suite's per-check timeout): kill our subprocesses, then raise CheckTimeout in the check."""

    def handler(signum, frame):
        _kill_children()
        raise CheckTimeout(f"stopped by signal {signal.Signals(signum).name} (the suite's timeout for this check)")

    signal.signal(signal.SIGTERM, handler)


class Ctx:
    """What a check needs to know: the device, how big to make things, when to stop, where to write."""

    def __init__(self, device: str, level: str, budget_s: float, tmp: Path, micro_batch: int = 0):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.explicit_index = self.device.index is not None
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)
        self.level = level
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.tmp = tmp
        self.micro_batch = micro_batch

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def train_dtype(self) -> str:
        """bfloat16 autocast (the recipe) on a GPU; float32 in the CPU smoke mode, whose CPU may lack fast bf16
        matmuls (the code path is the same but for the autocast context)."""
        return "float32" if self.level == "smoke" else "bfloat16"

    @property
    def device_arg(self) -> str:
        """What to pass as ``--device`` to a single-process zaya run: the GPU named (``cuda:N``), else "cuda"."""
        return str(self.device) if self.explicit_index else self.device.type

    @property
    def ranks_device_arg(self) -> str:
        """``--device`` for torchrun's ranks: "cuda" (each rank takes its LOCAL_RANK's GPU) or "cpu"."""
        return self.device.type

    def pick(self, full: Any, quick: Any, smoke: Any) -> Any:
        return {"full": full, "quick": quick, "smoke": smoke}[self.level]

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def describe_device(self) -> str:
        if self.cuda:
            return f"{self.device} ({self.torch.cuda.get_device_name(self.device)})"
        return str(self.device)


class Marks:
    """Named points in a step: CUDA events on a GPU (no host wait), wall-clock otherwise. ``intervals()`` (after a
    synchronize) gives the milliseconds between consecutive marks."""

    def __init__(self, ctx: Ctx):
        self.ctx = ctx
        self.points: list[tuple[str, Any]] = []

    def mark(self, name: str) -> None:
        if self.ctx.cuda:
            ev = self.ctx.torch.cuda.Event(enable_timing=True)
            ev.record()
            self.points.append((name, ev))
        else:
            self.points.append((name, time.perf_counter()))

    def intervals(self) -> dict[str, float]:
        out = {}
        for (_, a), (name, b) in zip(self.points, self.points[1:]):
            out[name] = a.elapsed_time(b) if self.ctx.cuda else 1000 * (b - a)
        return out


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def rnd(x: Any, digits: int = 4) -> Any:
    """Round floats to ``digits`` significant digits (None and non-floats pass)."""
    if isinstance(x, float) and math.isfinite(x) and x != 0:
        return round(x, max(0, digits - 1 - int(math.floor(math.log10(abs(x))))))
    return x


def clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become None, tuples lists, unknown objects strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def run_command(cmd: list[str], timeout: float, *, env: dict[str, str] | None = None, cwd: Path = ROOT,
                prefix: str = "") -> dict[str, Any]:
    """Run ``cmd`` in its own session, echo its output to stderr (prefixed) as it comes, and stop it (the whole
    process group: torchrun's workers too) after ``timeout`` s. Returns rc (124 on timeout, as coreutils'
    timeout), seconds, stdout, stderr, timed_out."""
    full_env = dict(os.environ)
    full_env["PYTHONUNBUFFERED"] = "1"
    src = str(ROOT / "src")
    full_env["PYTHONPATH"] = src + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
    full_env.update(env or {})
    say(f"{prefix}$ {' '.join(cmd)}")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True)
    _CHILDREN.add(proc.pid)
    chunks: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def pump(stream, key: str) -> None:
        for line in stream:
            chunks[key].append(line)
            sys.stderr.write(f"{prefix}{line}")
            sys.stderr.flush()

    threads = [threading.Thread(target=pump, args=(proc.stdout, "stdout"), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, "stderr"), daemon=True)]
    for t in threads:
        t.start()
    timed_out = False
    try:
        proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        say(f"{prefix}timed out after {timeout:.0f} s: stopping it")
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    finally:
        _CHILDREN.discard(proc.pid)
        if proc.poll() is None:  # an exception (our own SIGTERM) while waiting
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for t in threads:
        t.join(timeout=5)
    return {"rc": 124 if timed_out else proc.returncode, "seconds": time.perf_counter() - t0,
            "stdout": "".join(chunks["stdout"]), "stderr": "".join(chunks["stderr"]), "timed_out": timed_out}


def tail(text: str, chars: int = 1500) -> str:
    text = text.strip()
    return text if len(text) <= chars else "..." + text[-chars:]


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()[:2000]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (a torn or non-JSON line is skipped)."""
    return json_lines(path.read_text(errors="replace")) if path.is_file() else []


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects among the lines of ``text`` (other lines skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def time_calls(fn: Callable[[], Any], ctx: Ctx, repeats: int, warmup: int = 1) -> list[float]:
    """Milliseconds of ``repeats`` calls of ``fn`` (synchronised before and after each), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    ctx.sync()
    times = []
    for _ in range(repeats):
        ctx.sync()
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        times.append(1000 * (time.perf_counter() - t0))
    return times


def cpu_bf16_gflops(ctx: Ctx) -> float:
    """This CPU's bf16 matmul rate (a 256^3 product; CPUs without native bf16 run it ~100x slower than fp32)."""
    torch = ctx.torch
    a = torch.randn(256, 256).bfloat16()
    torch.mm(a, a)
    t0 = time.perf_counter()
    for _ in range(4):
        torch.mm(a, a)
    return 4 * 2 * 256**3 / (time.perf_counter() - t0) / 1e9
