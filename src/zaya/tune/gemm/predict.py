"""The cost model: a shape's forward + backward time predicted from the measured rates, and its parameter count.

Rates are interpolated bilinearly in log tokens and log sqrt(N K) per GEMM kind and pass, clamped at the sweep's
edges (the backward at the forward rate unless measured); the attention scores and CCA convolutions, which are no
weight GEMMs and are not swept, are charged at the same micro-batch's q/k/v GEMM rate.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Iterable

from zaya.core.errors import ConfigError
from zaya.tune.gemm.shapes import PASSES, model_gemms

UNTIMED = "attention_core"


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
