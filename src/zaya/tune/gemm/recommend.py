"""The recommendation, a pure function of the measurements: the shape near a parameter budget that trains fastest.

Candidates: each swept hidden size, head dims of 64 and 128 (and the config's) with the config's attention width
ratio and GQA grouping, and the expert hidden sizes that put the parameter count (active or total non-embedding, as
ZAYA1 quotes "760M / 8.3B") within the tolerance of the budget. They are ranked by predicted time per token at the
config's micro-batch, scaled to the budget's parameter count: not by achieved FLOP/s, since the tied LM head and the
attention core are outside the budget, and a shape moving work there would look efficient while training slower.
The micro-batch is the smallest swept token count reaching ``SATURATION`` of the best shape's predicted tokens/s.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any, Iterable

from zaya.core.errors import ConfigError
from zaya.core.units import format_count, format_duration
from zaya.tune.gemm.predict import ParamCounter, RateModel, predict
from zaya.tune.gemm.shapes import alignment
from zaya.tune.report import rate

HEAD_DIMS = (64, 128)
SATURATION = 0.9
RATIO_RANGE = 2.0


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
        out["why"] = (f"no candidate shape is within {tolerance:.0%} of {format_count(budget)} {of} parameters over "
                      f"the swept widths {result['widths']}; widen --widths or --tolerance")
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
        seconds = v["seconds"] / r["_p"]["tokens"] * budget / r["_n"]
        return f"{format_duration(seconds)} ({rate(v['flops'] / v['seconds'] / 1e12)})"

    lines = [f"best of {n} shape(s) within {tol:.0%} of {format_count(budget)} {of} non-embedding parameters, "
             f"ranked by predicted fwd+bwd time per token at {p['tokens']:,} tokens per micro-batch, scaled to the "
             f"budget's parameter count: {format_duration(best['score'])} ({p['tokens_per_s']:,.0f} tokens/s at "
             f"{rate(best['tflops'])})."]
    heavy = sorted(q["by_kind"], key=lambda k: -q["by_kind"][k]["seconds"])[:4]
    if best["config"]:
        lines.append("The config's own shape is the fastest candidate (per token: "
                     + "; ".join(f"{k} {per_token(best, k)}" for k in heavy) + ").")
    else:
        cells = [f"{k} {per_token(mine, k)} -> {per_token(best, k)}" for k in heavy if k in p["by_kind"]]
        lines.append(f"The config's shape: {format_duration(mine['score'])}, {best['vs_config']:+.0%} for this one; "
                     f"per token, config -> this one: {'; '.join(cells)}.")
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
