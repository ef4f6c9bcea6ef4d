"""``zaya tune gemm``'s command line: the flags, their parsing, and the checked ``Options`` the sweep runs on.

Every bad value is a ConfigError naming the flag, the value and an example of a good one.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from zaya.core.errors import ConfigError
from zaya.core.units import parse_count
from zaya.tune.gemm.shapes import CPU_TOKENS, GPU_TOKENS, QUICK_TOKENS
from zaya.tune.report import DEFAULT_OUT, add_output_arguments

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}


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
    out: str = DEFAULT_OUT
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
    p.add_argument("--from", dest="from_json", default=None, metavar="JSON",
                   help="re-rank a saved sweep (its gemm-<device>.json) for another --budget / --tolerance, "
                        "without measuring")
    add_output_arguments(p, "gemm-<device>.json and gemm-<device>-<dtype>.png", "the heatmap PNG")


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
