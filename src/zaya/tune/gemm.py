"""``zaya tune gemm``: the throughput of every GEMM the model runs, by token count and width, and the model shapes
and micro-batch it recommends near a parameter budget (written into the device's hardware profile).

What is measured. The weight GEMMs of one layer and the LM head, with the model's own calls and layouts
(``model_gemms``): the fused q/k/v projection (``F.linear`` of the concatenated weights: d -> (hq + 2 hk) hd), the
output projection (hq hd -> d), the ZAYA router's down-projection (d -> r) and MLP (r -> r), the expert gate/up and
down projections as the model runs them (one ``F.grouped_mm`` over E experts with the routed rows split evenly,
top_k x tokens rows in all, where the model would use it; else its per-expert loop of ``mm``), and the tied LM head
(d -> vocab). Not measured: the attention core (``scaled_dot_product_attention``) and the CCA convolutions, which are
no weight GEMMs (their share of the FLOPs is printed).

Each GEMM is timed at every ``--tokens`` count (M) and for every candidate hidden size in ``--widths``: at width d
the other sizes scale with it as they do in the config (query heads in whole GQA groups, the expert hidden size in
multiples of 64, or of 128 for a config at least 1,024 wide; the router latent and the vocabulary stay). One sample
is a batch of back-to-back calls lasting at least ~20 ms on a CPU or ~5 ms on a GPU (CUDA events); a figure is the
median of ``--repeats`` samples after a warm-up call, fewer (at least 3) where a point would take over a second.
Achieved FLOP/s = 2 M N K / time. A point under 75 % of a neighbour's rate (the same kind at the next width, or at
the next smaller token count) is measured again and the faster median kept: another process taking the cores for a
second slows a few points of a sweep, while a shape that is really slow stays slow. ``--backward`` (default on
GPUs) also times the two backward GEMMs of each shape (input gradient dY W, weight gradient dY^T X; grouped ones as
the model's backward calls them).

Recommendation (``recommend``, a pure function of the measurements). Candidate shapes: each swept hidden size, head
dims of 64 and 128 (and the config's) with the config's attention width ratio and GQA grouping, and the expert
hidden sizes (multiples of the alignment, within a factor 2 of the config's expert-to-hidden ratio) that put the
parameter count within ``--tolerance`` of ``--budget`` (active or total non-embedding parameters, as ZAYA1 quotes its
"760M / 8.3B"; layers, experts, top_k, router and vocabulary kept). Each candidate's forward + backward time for
one micro-batch is predicted: its weight GEMMs from the measured rates (interpolated bilinearly in log tokens and
log sqrt(N K) per GEMM kind, clamped at the sweep's edges; the backward at the forward rate unless measured), the
attention scores and convolutions at its q/k/v GEMM's rate. Candidates are ranked by that time per token at the
config's micro-batch (``train.micro_batch_size x train.seq_len``), scaled to the budget's parameter count (a shape
5 % over the budget is charged for being 5 % larger). Not by achieved FLOP/s: the tied LM head and the attention
core are outside the parameter budget, so a shape that moves work there would look efficient while training more
slowly. The micro-batch recommended for the best one is the smallest swept token count reaching 90 % of its best
predicted tokens/s.

Into the profile: ``peak_flops[dtype]`` (the best of a square GEMM and the sweep; not from ``--quick``), and a
``gemm`` summary. The CPU Newton-Schulz block sizes and the loss chunk are *not* measured by this command (their
defaults stay).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from zaya.core.errors import ConfigError

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
SHORT = {"bfloat16": "bf16", "float32": "fp32"}
CPU_TOKENS = (256, 1024, 4096)
GPU_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_TOKENS = (64, 256)
WIDTH_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
QUICK_WIDTH_FACTORS = (0.5, 1.0)
HEAD_DIMS = (64, 128)
SATURATION = 0.9
DIP = 0.75
RATIO_RANGE = 2.0
TOP = 5
PASSES = ("fwd", "dgrad", "wgrad")

# GEMM kinds in the order the model runs them, with the sizes each multiplies (in -> out).
KINDS = {"qkv": "d -> (hq+2hk)hd", "o": "hq hd -> d", "router_down": "d -> r", "router_mlp": "r -> r",
         "router_out": "r -> E+1", "router": "d -> E", "experts_gate_up": "d -> 2I (grouped)",
         "experts_down": "I -> d (grouped)", "lm_head": "d -> vocab"}


@dataclass(frozen=True)
class Gemm:
    """One weight GEMM: ``m`` rows of ``k`` inputs times a [n, k] weight (``groups`` experts splitting the rows
    evenly when > 1), run ``count`` times per forward of the model."""

    kind: str
    m: int
    n: int
    k: int
    groups: int = 1
    count: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def model_gemms(cfg: Any, tokens: int) -> list[Gemm]:
    """The forward weight GEMMs of the model ``cfg`` (a ModelConfig) for a micro-batch of ``tokens`` tokens.

    ``sum(g.count * g.flops) / tokens`` equals ``zaya.model.info.forward_flops_per_token`` without the attention
    scores and the CCA convolutions."""
    d, layers = cfg.hidden_size, cfg.num_layers
    q, kv = cfg.num_query_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = [Gemm("qkv", tokens, q + 2 * kv, d, count=layers), Gemm("o", tokens, d, q, count=layers)]
    if cfg.router == "zaya":
        r = cfg.router_hidden_size
        out += [Gemm("router_down", tokens, r, d, count=layers), Gemm("router_mlp", tokens, r, r, count=2 * layers),
                Gemm("router_out", tokens, cfg.num_router_classes, r, count=layers)]
    else:
        out.append(Gemm("router", tokens, cfg.num_experts, d, count=layers))
    rows, e, i = tokens * cfg.top_k, cfg.num_experts, cfg.expert_hidden_size
    out += [Gemm("experts_gate_up", rows, 2 * i, d, groups=e, count=layers),
            Gemm("experts_down", rows, d, i, groups=e, count=layers),
            Gemm("lm_head", tokens, cfg.vocab_size, d)]
    return out


def alignment(cfg: Any) -> int:
    """The multiple candidate widths and expert sizes are rounded to: 64, or 128 from a 1,024-wide config up."""
    return 128 if cfg.hidden_size >= 1024 else 64


def _round_to(x: float, step: int) -> int:
    return max(step, int(round(x / step)) * step)


def scaled(cfg: Any, width: int) -> Any:
    """``cfg`` at hidden size ``width``, the attention and expert widths scaled with it (see the module docstring)."""
    g = cfg.num_query_heads // cfg.num_kv_heads
    f = width / cfg.hidden_size
    hq = max(g, int(round(cfg.num_query_heads * f / g)) * g)
    return replace(cfg, hidden_size=width, num_query_heads=hq, num_kv_heads=hq // g,
                   expert_hidden_size=_round_to(cfg.expert_hidden_size * f, alignment(cfg)))


def default_widths(cfg: Any, quick: bool = False) -> list[int]:
    step = alignment(cfg)
    factors = QUICK_WIDTH_FACTORS if quick else WIDTH_FACTORS
    return sorted({_round_to(cfg.hidden_size * f, step) for f in factors})


def swept_gemms(cfg: Any, widths: Iterable[int], tokens: Iterable[int]) -> list[tuple[int, Gemm]]:
    """(width, GEMM) pairs of the sweep: one GEMM of each kind (the first the model runs) per width and token count."""
    out = []
    for w in widths:
        c = scaled(cfg, w)
        for t in tokens:
            seen = set()
            for g in model_gemms(c, t):
                if g.kind not in seen:
                    seen.add(g.kind)
                    out.append((w, replace(g, count=1)))
    return out


# ------------------------------------------------------------------------------------------------------------------
# Parsing options


def parse_count(text: str, what: str) -> int:
    """'760M', '8.3B', '2.5e6', '123456' -> an integer (k = 1e3, M = 1e6, B or G = 1e9, T = 1e12)."""
    s = str(text).strip().replace("_", "").replace(",", "")
    mult = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(s[-1:].lower(), 1.0) if s else 1.0
    body = s[:-1] if mult != 1.0 else s
    try:
        value = float(body) * mult
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what} = {text!r}: give a positive parameter count such as 760M, 8.3B or 123456")
    return int(round(value))


def parse_ints(text: str, what: str, example: str) -> list[int]:
    """'256,1024,4k' -> [256, 1024, 4096] (k = 1024 here: token counts and widths are powers of two)."""
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            value = int(part[:-1]) * 1024 if part.endswith("k") else int(part)
        except ValueError:
            raise ConfigError(f"{what} = {text!r}: {part!r} is not a whole number; give a comma list such as "
                              f"{example}") from None
        if value <= 0:
            raise ConfigError(f"{what} = {text!r}: {value} is not positive; give a comma list such as {example}")
        out.append(value)
    if not out:
        raise ConfigError(f"{what} = {text!r}: empty; give a comma list such as {example}")
    return sorted(set(out))


def parse_dtypes(text: str) -> list[str]:
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if part not in DTYPES:
            raise ConfigError(f"--dtype = {text!r}: {part!r} is not one of bf16, fp32 (or bfloat16, float32); "
                              "give one, or a comma list such as bf16,fp32")
        if DTYPES[part] not in out:
            out.append(DTYPES[part])
    return out


def parse_tolerance(text: str) -> float:
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1:
        raise ConfigError(f"--tolerance = {text!r}: give a fraction in (0, 1) or a percentage, e.g. 0.1 or 10%")
    return value


@dataclass
class Options:
    config: str | None = None
    device: str = "auto"
    dtypes: tuple[str, ...] = ("bfloat16",)
    tokens: tuple[int, ...] | None = None
    widths: tuple[int, ...] | None = None
    budget: int | None = None
    budget_of: str = "active"
    tolerance: float = 0.1
    backward: bool | None = None
    repeats: int = 5
    quick: bool = False
    out: str = "runs/tune"
    save: bool = True
    plot: bool = True
    json: bool = False
    from_json: str | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="PATH",
                   help="model config TOML whose GEMMs are swept (default: configs/tiny.toml on a CPU, "
                        "configs/zaya1-base.toml on a GPU, else the ZAYA1-base defaults)")
    p.add_argument("--device", default="auto", metavar="DEV", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="bf16", metavar="LIST",
                   help="bf16 (default), fp32, or both as bf16,fp32 (one table, heatmap and recommendation each)")
    p.add_argument("--tokens", default=None, metavar="LIST",
                   help=f"token counts per micro-batch (GEMM rows M), e.g. 256,1024,4k (default "
                        f"{','.join(map(str, CPU_TOKENS))} on a CPU, {','.join(map(str, GPU_TOKENS))} on a GPU)")
    p.add_argument("--widths", default=None, metavar="LIST",
                   help="candidate hidden sizes (default: the config's x 0.5, 0.75, 1, 1.25, 1.5, 2, rounded to "
                        "multiples of 64, or of 128 from 1,024 up)")
    p.add_argument("--budget", default=None, metavar="N",
                   help="parameter budget, non-embedding, e.g. 760M or 8.3B (default: the config's own count)")
    p.add_argument("--budget-of", default="active", choices=("active", "total"),
                   help="which count --budget is: active (per token, default) or total non-embedding parameters")
    p.add_argument("--tolerance", default="10%", metavar="FRAC",
                   help="how far from the budget a candidate may be: 0.1 or 10%% (default)")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the backward GEMMs (default: on for GPUs, off on a CPU)")
    p.add_argument("--repeats", type=int, default=None, metavar="K",
                   help="timed samples per figure (default 5, --quick 3)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke test: tokens {','.join(map(str, QUICK_TOKENS))}, two widths, 3 repeats (seconds)")
    p.add_argument("--out", default="runs/tune", metavar="DIR",
                   help="where gemm-<device>.json and gemm-<device>-<dtype>.png go (default runs/tune)")
    p.add_argument("--from", dest="from_json", default=None, metavar="JSON",
                   help="re-rank a saved sweep (its gemm-<device>.json) for another --budget / --tolerance, "
                        "without measuring")
    p.add_argument("--no-save", action="store_true", help="do not write the hardware profile")
    p.add_argument("--no-plot", action="store_true", help="do not write the heatmap PNG")
    p.add_argument("--json", action="store_true", help="print the whole result as one JSON line")


def options_from_args(args: argparse.Namespace) -> Options:
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    if repeats < 1:
        raise ConfigError(f"--repeats = {repeats}: must be at least 1")
    if args.from_json and args.config:
        raise ConfigError("--from and --config: a saved sweep already names its config; give one of them")
    return Options(
        config=args.config, device=args.device, dtypes=tuple(parse_dtypes(args.dtype)),
        tokens=tuple(parse_ints(args.tokens, "--tokens", "256,1024,4096")) if args.tokens is not None else None,
        widths=tuple(parse_ints(args.widths, "--widths", "1536,2048,2560")) if args.widths is not None else None,
        budget=parse_count(args.budget, "--budget") if args.budget is not None else None,
        budget_of=args.budget_of, tolerance=parse_tolerance(args.tolerance), backward=args.backward,
        repeats=repeats, quick=args.quick, out=args.out, save=not args.no_save, plot=not args.no_plot,
        json=args.json, from_json=args.from_json)


def _load_config(path: str | None, device_type: str) -> tuple[Any, str]:
    """(Config, where it came from): the named file, or the device's default preset, or the dataclass defaults."""
    from zaya.config import Config, load_config

    if path:
        return load_config(path), path
    preset = Path("configs/tiny.toml" if device_type == "cpu" else "configs/zaya1-base.toml")
    if preset.is_file():
        return load_config(preset), str(preset)
    return Config(), "ZAYA1-base defaults (zaya.config.ModelConfig)"


# ------------------------------------------------------------------------------------------------------------------
# Measuring


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
    """A closure running ``g``'s ``pass_`` ("fwd", "dgrad" or "wgrad") as the model (or its backward) does."""
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

    dtype = getattr(torch, dtype_name)
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


def _timing(device: Any, opts: Options) -> Timing:
    if opts.quick:
        return Timing(repeats=opts.repeats, min_sample_s=0.002, budget_s=0.1)
    return Timing(repeats=opts.repeats, min_sample_s=0.005 if device.type == "cuda" else 0.02, budget_s=1.0)


def _peak_size(device: Any, quick: bool) -> int:
    return 256 if quick else (8192 if device.type == "cuda" else 1024)


def sweep(cfg: Any, device: Any, opts: Options, log: Callable[[str], None]) -> dict[str, Any]:
    """Measure every swept GEMM (and a square peak GEMM) for each dtype; returns the result's measured part."""
    tokens = list(opts.tokens or (QUICK_TOKENS if opts.quick else CPU_TOKENS if device.type == "cpu" else GPU_TOKENS))
    widths = list(opts.widths or default_widths(cfg, opts.quick))
    backward = opts.backward if opts.backward is not None else device.type == "cuda"
    passes = list(PASSES if backward else PASSES[:1])
    for w in widths:
        scaled(cfg, w)  # a width the config's rules refuse fails here, before any measuring
    timing = _timing(device, opts)
    points = swept_gemms(cfg, widths, tokens)
    unique = list(dict.fromkeys(g for _, g in points))
    rows: list[dict[str, Any]] = []
    peaks: dict[str, dict[str, Any]] = {}
    start = time.perf_counter()
    for dtype in opts.dtypes:
        size = _peak_size(device, opts.quick)
        square = measure_gemm(Gemm("square", size, size, size), "fwd", dtype, device, timing)
        if square["tflops"]:
            calls = 1 + timing.repeats
            est = sum(g.flops for g in unique) * len(passes) * calls / (square["tflops"] * 1e12)
            log(f"zaya tune gemm: {SHORT[dtype]}: {len(unique)} shapes x {len(passes)} pass(es); square {size} GEMM "
                f"{_rate(square['tflops'])}; this dtype takes at least ~{est:.0f} s")
        done: dict[Gemm, dict[str, dict[str, Any]]] = {}
        for i, g in enumerate(unique):
            done[g] = {p: measure_gemm(g, p, dtype, device, timing, cfg.moe_impl) for p in passes}
            fwd = done[g]["fwd"]
            log(f"  [{i + 1}/{len(unique)}] {SHORT[dtype]} {g.kind:<16} M={g.m:<6} {g.n}x{g.k}"
                f"{f' /{g.groups}' if g.groups > 1 else ''}: "
                f"{_rate(fwd['tflops']) if fwd['tflops'] else fwd.get('error')}")
        again = dips(points, done, widths)
        for i, g in enumerate(again):
            for p in passes:
                second = measure_gemm(g, p, dtype, device, timing, cfg.moe_impl)
                first = done[g][p]
                if second["tflops"] and (not first["tflops"] or second["tflops"] > first["tflops"]):
                    done[g][p] = second
                done[g][p]["remeasured"] = {"first_tflops": first["tflops"], "second_tflops": second["tflops"]}
            log(f"  again [{i + 1}/{len(again)}] {SHORT[dtype]} {g.kind:<16} M={g.m:<6} {g.n}x{g.k}: "
                f"{_rate(done[g]['fwd']['remeasured']['first_tflops'])} then "
                f"{_rate(done[g]['fwd']['remeasured']['second_tflops'])}")
        for w, g in points:
            for p in passes:
                rows.append({**done[g][p], "width": w, "tokens": g.m if g.groups == 1 else g.m // cfg.top_k})
        sweep_best = max((r for r in rows if r["dtype"] == dtype and r["pass"] == "fwd" and r["tflops"]),
                         key=lambda r: r["tflops"], default=None)
        best = square if (sweep_best is None or (square["tflops"] or 0) >= sweep_best["tflops"]) else sweep_best
        peaks[dtype] = {"flops": best["tflops"] * 1e12 if best["tflops"] else None,
                        "shape": f"{best['m']}x{best['n']}x{best['k']}", "kind": best["kind"],
                        "square": {"size": size, "tflops": square["tflops"]}}
    return {"tokens": tokens, "widths": widths, "passes": passes, "measurements": rows, "peak": peaks,
            "sweep_s": round(time.perf_counter() - start, 1),
            "timing": {"repeats": timing.repeats, "min_sample_s": timing.min_sample_s,
                       "point_budget_s": timing.budget_s}}


def dips(points: list[tuple[int, Gemm]], done: dict[Gemm, dict[str, dict[str, Any]]], widths: list[int],
         fraction: float = DIP, most: float = 0.25) -> list[Gemm]:
    """The GEMMs to measure again: a forward rate under ``fraction`` of a neighbour's (the same kind at the next
    smaller or larger width, or at the next smaller token count: rates rise with the token count, so a point slower
    than a smaller one is suspect), the deepest first, at most ``most`` of them. Another process taking the cores for
    a second slows a few points of a sweep; a slow shape stays slow when measured again."""
    at = {(g.kind, w, g.m): g for w, g in points}
    wi = {w: i for i, w in enumerate(widths)}
    ms = {kind: sorted({g.m for _, g in points if g.kind == kind}) for kind in {g.kind for _, g in points}}
    depth: dict[Gemm, float] = {}
    for (kind, w, m), g in at.items():
        rate = done[g]["fwd"]["tflops"]
        if not rate:
            continue
        j = ms[kind].index(m)
        near = [at.get((kind, widths[i], m)) for i in (wi[w] - 1, wi[w] + 1) if 0 <= i < len(widths)]
        if j > 0:
            near.append(at.get((kind, w, ms[kind][j - 1])))
        best = max((done[n]["fwd"]["tflops"] or 0 for n in near if n is not None and n != g), default=0)
        if rate < fraction * best:
            depth[g] = min(depth.get(g, 1.0), rate / best)
    return sorted(depth, key=depth.get)[:max(1, int(most * len(done)))]


# ------------------------------------------------------------------------------------------------------------------
# Predicting and recommending


class RateModel:
    """Measured FLOP/s of one dtype by (kind, pass), interpolated in (log M, log sqrt(N K)), clamped at the edges."""

    def __init__(self, rows: Iterable[dict[str, Any]]):
        self.grid: dict[tuple[str, str], dict[tuple[int, float], float]] = {}
        for r in rows:
            if r.get("tflops"):
                key = (r["kind"], r["pass"])
                self.grid.setdefault(key, {})[(r["m"], math.sqrt(r["n"] * r["k"]))] = r["tflops"] * 1e12

    def passes(self) -> set[str]:
        return {p for _, p in self.grid}

    def rate(self, kind: str, pass_: str, m: int, n: int, k: int) -> tuple[float, bool]:
        """(FLOP/s, extrapolated: the shape lies outside the measured range)."""
        pts = self.grid.get((kind, pass_)) or self.grid.get((kind, "fwd"))
        if not pts:
            raise ConfigError(f"zaya tune gemm: no measurement of {kind!r} GEMMs to predict from; rerun the sweep "
                              f"with this config")
        s = math.sqrt(n * k)
        ms, ss = sorted({p[0] for p in pts}), sorted({p[1] for p in pts})
        out = not (ms[0] <= m <= ms[-1] and ss[0] * 0.999 <= s <= ss[-1] * 1.001)

        def bracket(xs: list[float], x: float) -> tuple[float, float, float]:
            if x <= xs[0] or len(xs) == 1:
                return xs[0], xs[0], 0.0
            if x >= xs[-1]:
                return xs[-1], xs[-1], 0.0
            hi = next(i for i, v in enumerate(xs) if v >= x)
            lo = xs[hi - 1]
            return lo, xs[hi], (math.log(x) - math.log(lo)) / (math.log(xs[hi]) - math.log(lo))

        m0, m1, fm = bracket(ms, m)
        s0, s1, fs = bracket(ss, s)
        corners = [(m0, s0), (m1, s0), (m0, s1), (m1, s1)]
        if all(c in pts for c in corners):
            lo = pts[(m0, s0)] * (1 - fm) + pts[(m1, s0)] * fm
            hi = pts[(m0, s1)] * (1 - fm) + pts[(m1, s1)] * fm
            return lo * (1 - fs) + hi * fs, out
        near = min(pts, key=lambda p: (math.log(p[0] / m)) ** 2 + (math.log(p[1] / s)) ** 2)  # a gap (out of memory)
        return pts[near], True


UNTIMED = "attention_core"


def predict(cfg: Any, tokens: int, model: RateModel, seq_len: int) -> dict[str, Any]:
    """Predicted forward + backward time of one ``tokens``-token micro-batch of ``cfg`` (sequences of ``seq_len``):
    the weight GEMMs from the measured rates, and the attention scores and CCA convolutions (``UNTIMED``, not
    swept) at the rate of the same micro-batch's q/k/v GEMM, so that wider attention is not free."""
    from zaya.model.info import forward_flops_per_token

    measured = model.passes()
    by_kind: dict[str, dict[str, float]] = {}
    extrapolated = False

    def add(kind: str, flops: float, seconds: float) -> None:
        cell = by_kind.setdefault(kind, {"flops": 0.0, "seconds": 0.0})
        cell["flops"] += flops
        cell["seconds"] += seconds

    gemms = model_gemms(cfg, tokens)
    for g in gemms:
        t = 0.0
        for p in PASSES:
            rate, out = model.rate(g.kind, p if p in measured else "fwd", g.m, g.n, g.k)
            extrapolated |= out
            t += g.count * g.flops / rate
        add(g.kind, 3 * g.count * g.flops, t)
    info = forward_flops_per_token(cfg, context=max(1, min(seq_len, tokens) // 2))
    untimed = 3 * tokens * (info["attention_scores"] + info["cca_convolutions"])
    qkv = gemms[0]
    add(UNTIMED, untimed, untimed / model.rate("qkv", "fwd", qkv.m, qkv.n, qkv.k)[0])
    seconds = sum(v["seconds"] for v in by_kind.values())
    flops = sum(v["flops"] for v in by_kind.values())
    return {"tokens": tokens, "flops": flops, "seconds": seconds, "tflops": flops / seconds / 1e12,
            "tokens_per_s": tokens / seconds, "by_kind": by_kind, "extrapolated": extrapolated}


class ParamCounter:
    """Non-embedding parameter counts of shapes around one config, from ``zaya.model.info.model_info`` at 1 and 2
    layers (a model's count is affine in its depth) plus the experts in closed form; cached by attention shape."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self._fixed: dict[tuple[int, int, int, int], int] = {}

    def fixed(self, c: Any) -> int:
        """Non-embedding parameters of ``c`` outside the experts."""
        key = (c.hidden_size, c.num_query_heads, c.num_kv_heads, c.head_dim)
        if key not in self._fixed:
            from zaya.model.info import model_info

            one, two = (model_info(replace(c, num_layers=n))["params_non_embedding"]
                        - n * c.num_experts * 3 * c.hidden_size * c.expert_hidden_size for n in (1, 2))
            self._fixed[key] = one + (c.num_layers - 1) * (two - one)
        return self._fixed[key]

    def counts(self, c: Any) -> dict[str, int]:
        per_expert = c.num_layers * 3 * c.hidden_size * c.expert_hidden_size
        fixed = self.fixed(c)
        return {"active": fixed + c.top_k * per_expert, "total": fixed + c.num_experts * per_expert}


def _shape(c: Any) -> dict[str, int]:
    return {"hidden_size": c.hidden_size, "expert_hidden_size": c.expert_hidden_size,
            "num_query_heads": c.num_query_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}


def candidates(cfg: Any, widths: Iterable[int], budget: int, of: str, tolerance: float,
               counter: ParamCounter) -> list[Any]:
    """Model configs near ``budget`` (``of``: "active" or "total" non-embedding parameters), the config first; the
    expert-to-hidden width ratio stays within a factor ``RATIO_RANGE`` of the config's (no 64-wide experts)."""
    step = alignment(cfg)
    g = cfg.num_query_heads // cfg.num_kv_heads
    ratio = cfg.num_query_heads * cfg.head_dim / cfg.hidden_size
    mult = cfg.top_k if of == "active" else cfg.num_experts
    expert_ratio = cfg.expert_hidden_size / cfg.hidden_size
    ratio_lo, ratio_hi = expert_ratio / RATIO_RANGE, expert_ratio * RATIO_RANGE
    out, seen = [cfg], {tuple(_shape(cfg).values())}
    for d in widths:
        for hd in sorted({cfg.head_dim, *HEAD_DIMS}):
            hq = max(g, int(round(ratio * d / hd / g)) * g)
            try:
                base = replace(cfg, hidden_size=d, head_dim=hd, num_query_heads=hq, num_kv_heads=hq // g)
            except ConfigError:
                continue  # e.g. a head_dim whose rotary part is not a whole even number
            per_unit = cfg.num_layers * mult * 3 * d
            ideal = (budget - counter.fixed(base)) / per_unit
            for i in {math.floor(ideal / step) * step, math.ceil(ideal / step) * step}:
                if i < step or not ratio_lo <= i / d <= ratio_hi:
                    continue
                c = replace(base, expert_hidden_size=i)
                key = tuple(_shape(c).values())
                if key not in seen and abs(counter.counts(c)[of] / budget - 1) <= tolerance:
                    seen.add(key)
                    out.append(c)
    return out


def saturation(curve: list[tuple[int, float]], fraction: float = SATURATION) -> tuple[int, float]:
    """(smallest token count whose throughput reaches ``fraction`` of the best, the best throughput)."""
    best = max(t for _, t in curve)
    return next(m for m, t in curve if t >= fraction * best), best


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def recommend(result: dict[str, Any], cfg: Any, budget: int | None, of: str, tolerance: float,
              micro_tokens: int, seq_len: int, dtype: str) -> dict[str, Any]:
    """Rank the candidate shapes for ``dtype``'s measurements; pick the micro-batch of the best one."""
    rows = [r for r in result["measurements"] if r["dtype"] == dtype]
    model = RateModel(rows)
    spreads = [r["spread"] for r in rows if r.get("spread") is not None]
    noise = statistics.median(spreads) if spreads else 0.0
    counter = ParamCounter(cfg)
    own = counter.counts(cfg)
    budget = budget or own[of]
    tokens = result["tokens"]
    ref = _clamp(micro_tokens, min(tokens), max(tokens))
    ranked = []
    for i, c in enumerate(candidates(cfg, result["widths"], budget, of, tolerance, counter)):
        p = predict(c, ref, model, seq_len)
        n = counter.counts(c)
        ranked.append({**_shape(c), "config": i == 0, "params_active": n["active"], "params_total": n["total"],
                       "budget_deviation": n[of] / budget - 1, "within_budget": abs(n[of] / budget - 1) <= tolerance,
                       "tflops": p["tflops"], "seconds": p["seconds"], "tokens_per_s": p["tokens_per_s"],
                       # seconds per token, scaled to exactly the budget's parameters: what the ranking compares
                       "score": p["seconds"] / ref * budget / n[of],
                       "extrapolated": p["extrapolated"], "_cfg": c, "_p": p, "_n": n[of]})
    mine = ranked[0]
    fits = sorted((r for r in ranked if r["within_budget"]), key=lambda r: r["score"])
    for r in ranked:
        r["vs_config"] = mine["score"] / r["score"] - 1
    best = fits[0] if fits else None
    out: dict[str, Any] = {"dtype": dtype, "budget": budget, "budget_of": of, "tolerance": tolerance,
                           "reference_tokens": ref, "seq_len": seq_len, "candidates_considered": len(ranked),
                           "noise": noise, "ranked": [_public(r) for r in fits], "config": _public(mine),
                           "best": None}
    if best is None:
        out["why"] = (f"no candidate shape is within {tolerance:.0%} of {_count(budget)} {of} parameters over the "
                      f"swept widths {result['widths']}; widen --widths or --tolerance")
        return out
    curve = [(m, predict(best["_cfg"], m, model, seq_len)["tokens_per_s"]) for m in tokens]
    micro, top = saturation(curve)
    out["best"] = {**_public(best), "micro_batch_tokens": micro,
                   "micro_batch_sequences": micro / seq_len if seq_len else None, "best_tokens_per_s": top,
                   "curve": [{"tokens": m, "tokens_per_s": t} for m, t in curve]}
    out["why"] = _why(best, mine, len(fits), tolerance, budget, of, micro, top, curve, seq_len, noise)
    return out


def _public(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if not k.startswith("_")}


def _why(best: dict[str, Any], mine: dict[str, Any], n: int, tol: float, budget: int, of: str, micro: int,
         top: float, curve: list[tuple[int, float]], seq_len: int, noise: float) -> str:
    p, q = best["_p"], mine["_p"]

    def per_token(r: dict[str, Any], kind: str) -> str:
        """Microseconds per token, scaled to the budget, and the rate, of one kind of ``r``'s work."""
        v = r["_p"]["by_kind"][kind]
        rate = _rate(v["flops"] / v["seconds"] / 1e12)
        return f"{_dur(v['seconds'] / r['_p']['tokens'] * budget / r['_n'])} ({rate})"

    lines = [f"best of {n} shape(s) within {tol:.0%} of {_count(budget)} {of} non-embedding parameters, ranked by "
             f"predicted fwd+bwd time per token at {p['tokens']:,} tokens per micro-batch, scaled to the budget's "
             f"parameter count: {_dur(best['score'])} ({p['tokens_per_s']:,.0f} tokens/s at "
             f"{_rate(best['tflops'])})."]
    heavy = sorted(q["by_kind"], key=lambda k: -q["by_kind"][k]["seconds"])[:4]
    if best["config"]:
        lines.append("The config's own shape is the fastest candidate (per token: "
                     + "; ".join(f"{k} {per_token(best, k)}" for k in heavy) + ").")
    else:
        cells = [f"{k} {per_token(mine, k)} -> {per_token(best, k)}" for k in heavy if k in p["by_kind"]]
        lines.append(f"The config's shape: {_dur(mine['score'])}, {best['vs_config']:+.0%} for this one; per "
                     f"token, config -> this one: {'; '.join(cells)}.")
        if best["vs_config"] < noise:
            lines.append(f"That gain is within this sweep's noise (median spread of a point's samples: {noise:.0%}): "
                         "keeping the config's shape costs nothing measurable.")
    if seq_len and micro >= seq_len:
        seqs = f" = {micro / seq_len:g} sequence(s) of {seq_len}"
    else:
        seqs = f" (under one {seq_len}-token sequence: one sequence per micro-batch is enough)"
    smallest = f"; {curve[0][0]:,} tokens: {curve[0][1]:,.0f}" if micro != curve[0][0] else ""
    lines.append(f"Micro-batch: {micro:,} tokens{seqs} reaches {SATURATION:.0%} of the best predicted throughput "
                 f"({top:,.0f} tokens/s{smallest}); larger micro-batches gain less than {1 - SATURATION:.0%} and cost "
                 "activation memory (`zaya plan` says what fits).")
    if best["extrapolated"]:
        lines.append("Some of its GEMM shapes lie outside the swept range (clamped): sweep wider --widths/--tokens.")
    return " ".join(lines)


# ------------------------------------------------------------------------------------------------------------------
# Output


def _count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def _rate(tflops: float | None) -> str:
    if not tflops:
        return "-"
    return f"{tflops:.3g} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.3g} GFLOP/s"


def _dur(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e3), ("us", 1e6)):
        if seconds * scale >= 1:
            return f"{seconds * scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def _unit(values: Iterable[float]) -> tuple[str, float]:
    return ("TFLOP/s", 1.0) if max(values, default=0) >= 1 else ("GFLOP/s", 1e3)


def _grid(result: dict[str, Any], dtype: str) -> dict[str, dict[int, dict[int, dict[str, Any]]]]:
    """kind -> width -> tokens -> {"tflops": fwd or fwd+bwd throughput, "n", "k", "groups", "impl"}."""
    cells: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    for r in result["measurements"]:
        if r["dtype"] != dtype:
            continue
        cell = cells.setdefault(r["kind"], {}).setdefault(r["width"], {}).setdefault(
            r["tokens"], {"n": r["n"], "k": r["k"], "groups": r["groups"], "impl": r["impl"], "flops": 0.0,
                          "seconds": 0.0, "ok": True})
        if r["seconds"]:
            cell["flops"] += r["flops"]
            cell["seconds"] += r["seconds"]
        else:
            cell["ok"] = False
    for kind in cells.values():
        for row in kind.values():
            for cell in row.values():
                cell["tflops"] = cell["flops"] / cell["seconds"] / 1e12 if cell["ok"] and cell["seconds"] else None
    return {k: cells[k] for k in KINDS if k in cells}


def _what(result: dict[str, Any]) -> str:
    return "forward + backward" if len(result["passes"]) > 1 else "forward"


def table(result: dict[str, Any], dtype: str) -> str:
    grid = _grid(result, dtype)
    unit, scale = _unit(c["tflops"] or 0 for k in grid.values() for row in k.values() for c in row.values())
    tokens = result["tokens"]
    lines = [f"{SHORT[dtype]} GEMM throughput ({_what(result)}), {unit}, by tokens per micro-batch:",
             f"  {'kind':<16} {'width':>6} {'N x K':>13} {'impl':>10}" + "".join(f" {t:>9,}" for t in tokens)]
    for kind, rows in grid.items():
        for w, row in sorted(rows.items()):
            any_cell = next(iter(row.values()))
            shape = f"{any_cell['n']}x{any_cell['k']}"
            impl = any_cell["impl"] if any_cell["groups"] > 1 else ""
            vals = "".join(f" {row[t]['tflops'] * scale:>9.3g}" if row.get(t, {}).get("tflops") else f" {'-':>9}"
                           for t in tokens)
            lines.append(f"  {kind:<16} {w:>6} {shape:>13} {impl:>10}{vals}")
    return "\n".join(lines)


def plot(result: dict[str, Any], dtype: str, path: Path, title: str) -> None:
    """Heatmap of achieved throughput: one panel per GEMM kind, width x tokens, one colour scale (Agg, no pyplot)."""
    import io

    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from zaya.core.fsutil import atomic_write_bytes

    grid = _grid(result, dtype)
    unit, scale = _unit(c["tflops"] or 0 for k in grid.values() for row in k.values() for c in row.values())
    tokens = result["tokens"]
    vmax = max((c["tflops"] or 0) * scale for k in grid.values() for row in k.values() for c in row.values()) or 1
    cols = min(4, len(grid))
    nrows = math.ceil(len(grid) / cols)
    fig = Figure(figsize=(3.1 * cols + 0.8, 0.42 * len(result["widths"]) * nrows + 1.2 * nrows + 0.6),
                 layout="constrained")
    FigureCanvasAgg(fig)
    image = None
    for i, (kind, rows) in enumerate(grid.items()):
        ax = fig.add_subplot(nrows, cols, i + 1)
        widths = sorted(rows)
        data = np.array([[(rows[w].get(t, {}).get("tflops") or np.nan) * scale for t in tokens] for w in widths])
        image = ax.imshow(data, cmap="viridis", vmin=0, vmax=vmax, aspect="auto")
        for (y, x), v in np.ndenumerate(data):
            if np.isfinite(v):
                ax.text(x, y, f"{v:.3g}", ha="center", va="center", fontsize=6,
                        color="white" if v < 0.6 * vmax else "black")
        ax.set_xticks(range(len(tokens)), [f"{t:,}" for t in tokens], fontsize=6)
        labels = []
        for w in widths:
            c = next(iter(rows[w].values()))
            labels.append(f"{w}: {c['n']}x{c['k']}" + (f"/{c['groups']}" if c["groups"] > 1 else ""))
        ax.set_yticks(range(len(widths)), labels, fontsize=6)
        ax.set_title(f"{kind} ({KINDS[kind]})", fontsize=7)
        ax.set_xlabel("tokens per micro-batch", fontsize=6)
        if i % cols == 0:
            ax.set_ylabel("hidden size: N x K", fontsize=6)
    if image is not None:
        bar = fig.colorbar(image, ax=fig.axes, shrink=0.8)
        bar.set_label(f"achieved {unit}", fontsize=7)
        bar.ax.tick_params(labelsize=6)
    fig.suptitle(title, fontsize=8)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, facecolor="white")
    atomic_write_bytes(path, buffer.getvalue())


def report(result: dict[str, Any]) -> str:
    lines = [f"zaya tune gemm: {result['device_name']} ({result['device_key']}), torch {result['torch']}; "
             f"{result['config']}; sweep {result.get('sweep_s', 0):.0f} s"]
    busy = [x for x in (result.get("load_before"), result.get("load_after")) if x is not None]
    if result["device"] == "cpu" and busy and max(busy) > 0.5 * result["threads"]:
        lines.append(f"  note: the load average was {busy[0]:g} before and {busy[-1]:g} after the sweep on "
                     f"{result['threads']} threads: other processes took CPU time, so some figures are low; rerun "
                     "on an idle machine for the record")
    for dtype in result["dtypes"]:
        lines += ["", table(result, dtype)]
        peak = result["peak"].get(dtype, {})
        if peak.get("flops"):
            lines.append(f"  peak: {_rate(peak['flops'] / 1e12)} ({peak['kind']}, M x N x K = {peak['shape']}; square "
                         f"{peak['square']['size']} GEMM: {_rate(peak['square']['tflops'])})")
        noise = result["recommendation"][dtype]["noise"]
        lines.append(f"  noise: a point's samples spread by {noise:.1%} (median over the points)")
        again = {(r["kind"], r["m"], r["n"], r["k"]) for r in result["measurements"]
                 if r["dtype"] == dtype and r.get("remeasured")}
        if again:
            lines.append(f"  measured again (under {DIP:.0%} of a neighbour's rate; the faster median kept): "
                         f"{len(again)} shape(s)")
    lines.append(f"  (the weight GEMMs; not timed: attention scores and CCA convolutions, "
                 f"{result['untimed_share']:.0%} of the config's forward FLOPs at its seq_len; predictions count "
                 "them at the q/k/v GEMM's rate)")
    if len(result["dtypes"]) > 1:
        a, b = result["dtypes"][:2]
        ra, rb = (result["recommendation"][d]["config"]["tokens_per_s"] for d in (a, b))
        faster, ratio = (a, ra / rb) if ra >= rb else (b, rb / ra)
        lines += ["", f"At the config's shape {SHORT[faster]} runs {ratio:.2f}x faster than the other here "
                      f"({SHORT[a]} {ra:,.0f}, {SHORT[b]} {rb:,.0f} predicted tokens/s of weight GEMMs and attention): "
                      f"train.dtype = \"{faster}\" would train faster on this device."]
    for dtype in result["dtypes"]:
        rec = result["recommendation"][dtype]
        lines += ["", f"Recommended shapes ({SHORT[dtype]}; {_count(rec['budget'])} {rec['budget_of']} "
                      f"non-embedding parameters +-{rec['tolerance']:.0%}; predicted fwd+bwd at "
                      f"{rec['reference_tokens']:,} tokens per micro-batch; vs config: time per token scaled to the "
                      "budget):",
                  f"  {'':>6} {'hidden':>6} {'expert':>6} {'heads q/kv x dim':>16} {'active':>8} {'total':>8} "
                  f"{'budget':>7} {'achieved':>15} {'tokens/s':>10} {'vs config':>9}"]
        shown = rec["ranked"][:TOP]
        rows = [(str(i + 1), r) for i, r in enumerate(shown)]
        if not any(r["config"] for r in shown):
            rows.append(("config", rec["config"]))
        for label, r in rows:
            heads = f"{r['num_query_heads']}/{r['num_kv_heads']} x {r['head_dim']}"
            tag = label + ("*" if r["config"] and label != "config" else "")
            lines.append(f"  {tag:>6} {r['hidden_size']:>6} {r['expert_hidden_size']:>6} {heads:>16} "
                         f"{_count(r['params_active']):>8} {_count(r['params_total']):>8} "
                         f"{r['budget_deviation']:>+7.1%} {_rate(r['tflops']):>15} {r['tokens_per_s']:>10,.0f} "
                         f"{r['vs_config']:>+9.0%}")
        if rec["best"]:
            b = rec["best"]
            lines.append(f"  -> hidden_size = {b['hidden_size']}, expert_hidden_size = {b['expert_hidden_size']}, "
                         f"num_query_heads = {b['num_query_heads']}, num_kv_heads = {b['num_kv_heads']}, head_dim = "
                         f"{b['head_dim']}; micro-batch {b['micro_batch_tokens']:,} tokens")
        lines.append("  why: " + rec["why"])
        lines.append("  (* = the config's own shape)")
    lines.append("")
    for path in result.get("files", []):
        lines.append(f"wrote {path}")
    if result.get("profile"):
        dtypes = [f"peak_flops[{d}]" for d in result["dtypes"] if result["peak"].get(d, {}).get("flops")]
        what = "gemm summary; --quick leaves peak_flops as it was" if result["quick"] else ", ".join(
            [*dtypes, "gemm summary"])
        lines.append(f"hardware profile: {result['profile']} ({what}); muon_block_rows, muon_max_blocks, "
                     "muon_cpu_small and loss_chunk_elements are not measured by this command")
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The profile's ``gemm`` field: the setup, peaks and each dtype's recommendation (not every measurement)."""
    recs = {}
    for dtype, rec in result["recommendation"].items():
        b = rec["best"]
        recs[dtype] = None if b is None else {
            **{k: b[k] for k in ("hidden_size", "expert_hidden_size", "num_query_heads", "num_kv_heads", "head_dim",
                                 "micro_batch_tokens", "tflops", "tokens_per_s", "vs_config")},
            "budget": rec["budget"], "budget_of": rec["budget_of"],
            "config_tokens_per_s": rec["config"]["tokens_per_s"]}
    return {"config": result["config"], "dtypes": result["dtypes"], "tokens": result["tokens"],
            "widths": result["widths"], "passes": result["passes"], "quick": result["quick"],
            "peak": {d: {"flops": p["flops"], "shape": p["shape"], "kind": p["kind"]}
                     for d, p in result["peak"].items()},
            "recommendation": recs, "results": result.get("json"), "measured_at": result["measured_at"],
            "torch": result["torch"], "command": result["command"]}


def _analyse(result: dict[str, Any], cfg: Any, train: Any, opts: Options) -> None:
    from zaya.model.info import forward_flops_per_token

    flops = forward_flops_per_token(cfg, context=max(1, train.seq_len // 2))
    result["untimed_share"] = (flops["attention_scores"] + flops["cca_convolutions"]) / sum(flops.values())
    micro = train.micro_batch_size * train.seq_len
    result["recommendation"] = {d: recommend(result, cfg, opts.budget, opts.budget_of, opts.tolerance, micro,
                                             train.seq_len, d) for d in result["dtypes"]}


def _load() -> float | None:
    """The 1-minute load average (None where the OS has none): other work on the cores slows a CPU sweep."""
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _command() -> str:
    argv = sys.argv[1:]
    return "zaya " + " ".join(argv) if argv[:2] == ["tune", "gemm"] else "zaya tune gemm"


def _from_saved(path: str) -> tuple[dict[str, Any], Any, Any]:
    from zaya.config import TrainConfig, model_config_from_dict
    from zaya.core.fsutil import read_json

    p = Path(path)
    try:
        result = read_json(p)
        cfg = model_config_from_dict(result["model"], str(p))
        train = replace(TrainConfig(), micro_batch_size=result["micro_batch_size"], seq_len=result["seq_len"])
        missing = [k for k in ("measurements", "tokens", "widths", "passes", "dtypes", "peak") if k not in result]
        if missing:
            raise KeyError(", ".join(missing))
    except FileNotFoundError:
        raise ConfigError(f"--from {p}: no such file (a sweep's gemm-<device>.json, written to --out)") from None
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError) as err:  # not JSON (nested past the parser's depth too), or not a result
        raise ConfigError(f"--from {p}: not a `zaya tune gemm` result ({err.__class__.__name__}: {err})") from None
    return result, cfg, train


def run(args: argparse.Namespace) -> int:
    """``zaya tune gemm``: measure (or reload), recommend, write the JSON, heatmaps and profile, print the report."""
    opts = options_from_args(args)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if opts.from_json:
        result, cfg, train = _from_saved(opts.from_json)
        device = None
        result["files"] = []  # this run writes nothing
        result.pop("profile", None)
    else:
        import torch

        from zaya.config import to_dict
        from zaya.core.device import resolve_device
        from zaya.core.hardware import device_key, device_name

        device = resolve_device(opts.device)
        config, source = _load_config(opts.config, device.type)
        cfg, train = config.model, config.train
        result = {"command": _command(), "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"), "torch": torch.__version__, "device": str(device),
                  "device_key": device_key(device), "device_name": device_name(device),
                  "threads": torch.get_num_threads(), "float32_matmul_precision": torch.get_float32_matmul_precision(),
                  "config": source, "model": to_dict(cfg), "micro_batch_size": train.micro_batch_size,
                  "seq_len": train.seq_len, "dtypes": list(opts.dtypes), "quick": opts.quick}
        result["load_before"] = _load()
        result.update(sweep(cfg, device, opts, log))
        result["load_after"] = _load()
    _analyse(result, cfg, train, opts)
    files = []
    if not opts.from_json:
        out = Path(opts.out)
        stem = f"gemm-{result['device_key']}"
        result["json"] = str(out / f"{stem}.json")
        if opts.plot:
            for dtype in result["dtypes"]:
                path = out / f"{stem}-{SHORT[dtype]}.png"
                plot(result, dtype, path, f"zaya tune gemm: {result['device_name']}, {dtype}, {result['config']}: "
                                          f"achieved throughput ({_what(result)})")
                files.append(str(path))
        if opts.save:
            from zaya.core.hardware import load_profile, update_profile

            peaks = dict(load_profile(device, refresh=True).peak_flops)
            if not opts.quick:  # a smoke test's small square GEMM is no peak to measure MFU against
                peaks.update({d: p["flops"] for d, p in result["peak"].items() if p.get("flops")})
            result["profile"] = str(update_profile(device, peak_flops=peaks, gemm=summary(result)))
        from zaya.core.fsutil import atomic_write_text

        result["files"] = [result["json"], *files]
        atomic_write_text(result["json"], json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if opts.json else report(result))
    return 0
