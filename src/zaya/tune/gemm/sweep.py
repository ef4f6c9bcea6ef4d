"""The sweep: every GEMM kind at every token count and width, each dtype, plus a square GEMM for the peak.

A point under ``DIP`` of a neighbour's rate (the same kind at the next width, or at the next smaller token count) is
measured again and the faster median kept: another process taking the cores for a second slows a few points of a
sweep, while a shape that is really slow stays slow. The peak is the best of the square GEMM and the sweep.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from zaya.tune.gemm.options import Options
from zaya.tune.gemm.shapes import (CPU_TOKENS, GPU_TOKENS, PASSES, QUICK_TOKENS, Gemm, default_widths, scaled,
                                   swept_gemms)
from zaya.tune.gemm.timing import Timing, measure_gemm
from zaya.tune.report import rate

DIP = 0.75


def _timing(device: Any, opts: Options) -> Timing:
    if opts.quick:
        return Timing(repeats=opts.repeats, min_sample_s=0.002, budget_s=0.1)
    return Timing(repeats=opts.repeats, min_sample_s=0.005 if device.type == "cuda" else 0.02, budget_s=1.0)


def _peak_size(device: Any, quick: bool) -> int:
    return 256 if quick else (8192 if device.type == "cuda" else 1024)


def sweep(cfg: Any, device: Any, opts: Options, log: Callable[[str], None]) -> dict[str, Any]:
    """Measure every swept GEMM (and a square peak GEMM) for each dtype; returns the result's measured part."""
    from zaya.core.device import short_name

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
            log(f"zaya tune gemm: {short_name(dtype)}: {len(unique)} shapes x {len(passes)} pass(es); square {size} "
                f"GEMM {rate(square['tflops'])}; this dtype takes at least ~{est:.0f} s")
        done: dict[Gemm, dict[str, dict[str, Any]]] = {}
        for i, g in enumerate(unique):
            done[g] = {p: measure_gemm(g, p, dtype, device, timing, cfg.moe_impl) for p in passes}
            fwd = done[g]["fwd"]
            log(f"  [{i + 1}/{len(unique)}] {short_name(dtype)} {g.kind:<16} M={g.m:<6} {g.n}x{g.k}"
                f"{f' /{g.groups}' if g.groups > 1 else ''}: "
                f"{rate(fwd['tflops']) if fwd['tflops'] else fwd.get('error')}")
        again = dips(points, done, widths)
        for i, g in enumerate(again):
            for p in passes:
                second = measure_gemm(g, p, dtype, device, timing, cfg.moe_impl)
                first = done[g][p]
                if second["tflops"] and (not first["tflops"] or second["tflops"] > first["tflops"]):
                    done[g][p] = second
                done[g][p]["remeasured"] = {"first_tflops": first["tflops"], "second_tflops": second["tflops"]}
            log(f"  again [{i + 1}/{len(again)}] {short_name(dtype)} {g.kind:<16} M={g.m:<6} {g.n}x{g.k}: "
                f"{rate(done[g]['fwd']['remeasured']['first_tflops'])} then "
                f"{rate(done[g]['fwd']['remeasured']['second_tflops'])}")
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
    than a smaller one is suspect), the deepest first, at most ``most`` of them."""
    at = {(g.kind, w, g.m): g for w, g in points}
    wi = {w: i for i, w in enumerate(widths)}
    ms = {kind: sorted({g.m for _, g in points if g.kind == kind}) for kind in {g.kind for _, g in points}}
    depth: dict[Gemm, float] = {}
    for (kind, w, m), g in at.items():
        speed = done[g]["fwd"]["tflops"]
        if not speed:
            continue
        j = ms[kind].index(m)
        near = [at.get((kind, widths[i], m)) for i in (wi[w] - 1, wi[w] + 1) if 0 <= i < len(widths)]
        if j > 0:
            near.append(at.get((kind, w, ms[kind][j - 1])))
        best = max((done[n]["fwd"]["tflops"] or 0 for n in near if n is not None and n != g), default=0)
        if speed < fraction * best:
            depth[g] = min(depth.get(g, 1.0), speed / best)
    return sorted(depth, key=depth.get)[:max(1, int(most * len(done)))]
