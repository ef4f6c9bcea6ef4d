"""The GEMMs ``zaya tune gemm`` times: the model's weight GEMMs by kind, and the widths and token counts swept.

A candidate width scales the other sizes as the config does: query heads in whole GQA groups, the expert hidden size
in multiples of 64 (128 for a config at least 1,024 wide); the router latent and the vocabulary stay.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable

CPU_TOKENS = (256, 1024, 4096)
GPU_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_TOKENS = (64, 256)
WIDTH_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
QUICK_WIDTH_FACTORS = (0.5, 1.0)
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
