"""Timing one GEMM as the model runs it: its forward (or one of its backward GEMMs), grouped the model's way.

One sample is a batch of back-to-back calls lasting at least ``Timing.min_sample_s`` (CUDA events on a GPU); a
figure is the median of ``Timing.repeats`` samples after a warm-up call, fewer (at least 3) where a point would take
over ``Timing.budget_s``. Achieved FLOP/s = 2 M N K / time.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from zaya.tune.gemm.shapes import Gemm


@dataclass
class Timing:
    repeats: int = 5
    min_sample_s: float = 0.02
    budget_s: float = 1.0


def _timer(device: Any) -> Callable[[Callable[[], Any], int], float]:
    import torch

    if device.type == "cuda":
        def run(fn: Callable[[], Any], calls: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / calls
        return run

    def run_host(fn: Callable[[], Any], calls: int) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls
    return run_host


def time_call(fn: Callable[[], Any], device: Any, timing: Timing) -> tuple[float, int, int, float | None]:
    """(median seconds per call, samples, calls per sample, spread = (slowest - fastest) / median, None for one
    sample) of ``fn`` after one warm-up call."""
    from zaya.core.device import synchronize

    run = _timer(device)
    fn()
    synchronize(device)
    first = run(fn, 1)
    calls = 1 if first >= timing.min_sample_s else min(10_000, math.ceil(timing.min_sample_s / max(first, 1e-9)))
    samples = [first] if calls == 1 else []
    want = max(min(3, timing.repeats), min(timing.repeats, int(timing.budget_s / max(first * calls, 1e-12))))
    while len(samples) < want:
        samples.append(run(fn, calls))
    median = statistics.median(samples)
    spread = (max(samples) - min(samples)) / median if len(samples) > 1 else None
    return median, len(samples), calls, spread


def _split(m: int, groups: int) -> list[int]:
    return [m // groups + (1 if i < m % groups else 0) for i in range(groups)]


def grouped_impl(g: Gemm, device: Any, dtype: Any, moe_impl: str = "auto") -> str:
    """How the model runs grouped GEMM ``g``: "grouped_mm" or "loop" (``zaya.model.moe.Experts``'s rule)."""
    from zaya.model.moe import grouped_mm_supported

    if moe_impl == "loop" or not grouped_mm_supported(device, dtype):
        return "loop"
    # The model asks hidden_size and expert_hidden_size to be 16-byte aligned rows: (k, n/2) for gate/up, (n, k) down.
    sizes = (g.k, g.n // 2) if g.kind == "experts_gate_up" else (g.n, g.k)
    return "grouped_mm" if all((s * dtype.itemsize) % 16 == 0 for s in sizes) else "loop"


def gemm_call(g: Gemm, pass_: str, dtype: Any, device: Any, impl: str = "mm") -> Callable[[], Any]:
    """A closure running ``g``'s ``pass_`` ("fwd", "dgrad" or "wgrad") as the model (or its backward) does: the
    input gradient dY W, the weight gradient dY^T X."""
    import torch
    import torch.nn.functional as F

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)

    x = rand(g.m, g.k) if pass_ != "dgrad" else None
    gy = rand(g.m, g.n) if pass_ != "fwd" else None  # (an LM head's [M, vocab] is large: only where it is read)
    if g.groups == 1:
        w = rand(g.n, g.k)
        return {"fwd": lambda: F.linear(x, w), "dgrad": lambda: torch.mm(gy, w),
                "wgrad": lambda: torch.mm(gy.t(), x)}[pass_]
    w = rand(g.groups, g.n, g.k)
    counts = _split(g.m, g.groups)
    if impl == "grouped_mm":
        offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        return {"fwd": lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=offs),
                "dgrad": lambda: F.grouped_mm(gy, w, offs=offs),
                "wgrad": lambda: F.grouped_mm(gy.t(), x, offs=offs)}[pass_]
    xs = x.split(counts) if x is not None else None
    gys = gy.split(counts) if gy is not None else None
    ws = w.unbind(0)
    live = [i for i, c in enumerate(counts) if c]
    return {"fwd": lambda: torch.cat([xs[i] @ ws[i].t() for i in live]),
            "dgrad": lambda: torch.cat([gys[i] @ ws[i] for i in live]),
            "wgrad": lambda: torch.stack([gys[i].t() @ xs[i] for i in live])}[pass_]


def measure_gemm(g: Gemm, pass_: str, dtype_name: str, device: Any, timing: Timing,
                 moe_impl: str = "auto") -> dict[str, Any]:
    """One measured point: the shape, the implementation, seconds per call and TFLOP/s (or the error it hit)."""
    import torch

    from zaya.core.device import to_dtype

    dtype = to_dtype(dtype_name)
    impl = "mm" if g.groups == 1 else grouped_impl(g, device, dtype, moe_impl)
    row: dict[str, Any] = {"dtype": dtype_name, "kind": g.kind, "pass": pass_, "m": g.m, "n": g.n, "k": g.k,
                           "groups": g.groups, "impl": impl, "flops": g.flops}
    try:
        seconds, samples, calls, spread = time_call(gemm_call(g, pass_, dtype, device, impl), device, timing)
    except torch.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row.update(seconds=None, tflops=None, error="out of memory")
        return row
    row.update(seconds=seconds, tflops=g.flops / seconds / 1e12, samples=samples, calls=calls, spread=spread)
    return row
