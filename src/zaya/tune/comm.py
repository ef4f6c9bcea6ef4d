"""``zaya tune comm``: collective bandwidth by message size and by how many ranks take part, and the gradient bucket
size and collective grouping it recommends for ddp, zero1 and fsdp (written into the hardware profile).

What is measured. Five collectives: all-reduce (DDP / ZeRO-1 gradients), all-gather and reduce-scatter (FSDP2's
parameters and gradients), all-to-all (expert parallelism) and broadcast (ZeRO-1's parameter sync). Each at every
message size (4 KiB .. 64 MiB, doubling) over subgroups of 2, 4, ..., N ranks of one node (ZAYA1's MI300X nodes
reached their Infinity Fabric peak only when all 8 GPUs of a node took part) and, under a multi-node torchrun, over
the whole world (the inter-node figure). One timed sample is a barrier, then a batch of back-to-back calls (as many
as take ~20 ms, the same count on every rank), then a device synchronise; its time is the slowest rank's, and a
figure is the median over ``--repeats`` samples after a warm-up.

Sizes and bandwidths follow nccl-tests: the size is the whole buffer (all-reduce's tensor, all-gather's output,
reduce-scatter's input, all-to-all's per-rank input), algorithm bandwidth = size / time, and bus bandwidth =
algorithm bandwidth x 2(n-1)/n (all-reduce), x (n-1)/n (all-gather, reduce-scatter, all-to-all), x 1 (broadcast),
which makes the figures of different n comparable with the link's speed. A backend that lacks a tensor collective
(gloo before torch 2.x's tensor variants) is measured through its list variant, or reduce-scatter through an
all-reduce and a slice; the table flags such rows.

Recommendations (``recommend``, a pure function of the measured rows):

* ``ddp_bucket_mb`` (DDP and ZeRO-1 gradient buckets): the smallest message at which all-reduce over the most ranks
  measured reaches 90 % of its peak bus bandwidth, within [1, 256] MiB: a larger bucket gains no bandwidth and
  delays the first all-reduce of the backward (less overlap); a smaller one leaves bandwidth unused.
* ZeRO-1's parameter sync: zaya broadcasts each owner's parameters as one coalesced message (``Parallel.after_step``);
  the report compares that, at the model's size, with one all-gather of the same bytes.
* FSDP2 (with ``--config``): each block's parameters are one all-gather; the report says how large that is and what
  fraction of the peak all-gather bandwidth it reaches, and sets ``fsdp_reshard_after_forward = False`` (one
  all-gather per block fewer in the backward) when keeping the whole model gathered costs at most 10 % of a device's
  memory, True otherwise.
* Expert parallelism (with ``--config``): the all-to-all a training step of that config makes at each candidate
  degree (dividing ``model.num_experts`` and the ranks measured): ``expert_all_to_all``'s bytes per step and their
  time priced from the measured all-to-all curve at the message size one layer's exchange sends
  (``price_all_to_all``), beside the gradient all-reduce of the whole model over the same ranks. ``zaya plan``
  prices the same exchanges from the curve this command writes into the profile (``all_to_all_busbw_gbps``).

Run as a plain command it starts one process per rank itself (gloo on CPU, NCCL on GPUs); under torchrun it uses
the job's process group. The JSON (every row) and a PNG of bus bandwidth against size go to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from zaya.core.errors import ConfigError
from zaya.core.units import MiB, format_bytes, format_duration, parse_size
from zaya.tune import report as skeleton

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
DEFAULT_SIZES = {"cpu": "4K..64M", "cuda": "4K..1G"}
QUICK_SIZES = "4K,64K,1M"
SATURATION = 0.9
"""A message "reaches the asymptotic bandwidth" at this fraction of the peak bus bandwidth."""
BUCKET_BOUNDS_MB = (1.0, 256.0)
KEEP_GATHERED_FRACTION = 0.1
"""FSDP2: keep the gathered parameters after the forward when they take at most this fraction of device memory."""
_SAMPLE_S = {"cpu": 0.02, "cuda": 0.005}
_MAX_ITERS = 200
_DTYPES = {"float32": 4, "bfloat16": 2}


# --- options ---------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="ranks to start (default: every GPU; on CPU min(4, cores), at least 2); under torchrun the "
                        "job's ranks are used instead")
    p.add_argument("--device", default="auto", metavar="DEV", help="auto (default: GPUs when torch sees one), cpu or "
                                                                   "cuda")
    p.add_argument("--backend", default="auto", metavar="NAME",
                   help="auto (default: nccl on cuda, gloo on cpu), gloo or nccl")
    p.add_argument("--sizes", default=None, metavar="LIST",
                   help=f"message sizes: a comma list (4K,1M,64MiB) or a doubling range A..B (default "
                        f"{DEFAULT_SIZES['cpu']} on CPU, {DEFAULT_SIZES['cuda']} on GPUs)")
    p.add_argument("--ranks", default=None, metavar="LIST",
                   help="how many ranks of the node take part, e.g. 2,4,8 (default: 2, 4, 8, ... up to --nproc, and "
                        "--nproc itself)")
    p.add_argument("--repeats", type=int, default=None, metavar="K", help="timed samples per figure (default 5; "
                                                                          "--quick 3)")
    p.add_argument("--dtype", default="float32", metavar="DTYPE",
                   help="element type of the buffers: float32 (default: DDP's gradients) or bfloat16")
    p.add_argument("--config", default=None, metavar="PATH",
                   help="a model config: also report FSDP2's per-block all-gather, ZeRO-1's parameter sync and the "
                        "expert all-to-all of a training step at each expert-parallel degree at its sizes, and set "
                        "fsdp_reshard_after_forward for it")
    p.add_argument("--quick", action="store_true", help=f"a smoke test: sizes {QUICK_SIZES}, 3 repeats")
    skeleton.add_output_arguments(p, "comm-<device>.json and .png", "the PNG")


@dataclass
class Options:
    """A validated ``zaya tune comm`` command line."""

    nproc: int = 2
    device: str = "cpu"
    """"cpu" or "cuda" (each rank its local GPU)."""
    backend: str = "gloo"
    sizes: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    """Subgroup sizes inside one node (each <= the ranks per node)."""
    repeats: int = 5
    warmup: int = 2
    dtype: str = "float32"
    model: dict[str, Any] | None = None
    """``model_sizes()`` of ``--config``, if given."""
    quick: bool = False
    json: bool = False
    save: bool = True
    plot: bool = True
    out: str = skeleton.DEFAULT_OUT
    command: str = ""


def parse_sizes(text: str) -> list[int]:
    """"A..B" (A, 2A, 4A, ... up to B) or a comma list; sorted, without repeats."""
    if ".." in text:
        lo, _, hi = text.partition("..")
        a, b = parse_size(lo, "--sizes"), parse_size(hi, "--sizes")
        if a > b:
            raise ConfigError(f"--sizes {text}: the range must go from small to large")
        sizes = [a << i for i in range(64) if a << i <= b]
    else:
        sizes = [parse_size(t, "--sizes") for t in text.split(",") if t.strip()]
    if not sizes:
        raise ConfigError(f"--sizes {text!r}: no sizes")
    return sorted(set(sizes))


def default_ranks(per_node: int) -> list[int]:
    """2, 4, 8, ... below ``per_node``, and ``per_node`` itself."""
    out, n = [], 2
    while n < per_node:
        out.append(n)
        n *= 2
    return out + [per_node]


def parse_ranks(text: str | None, per_node: int) -> list[int]:
    if text is None:
        return default_ranks(per_node)
    try:
        ranks = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise ConfigError(f"--ranks {text!r}: a comma list of rank counts, e.g. 2,4,8") from None
    bad = [n for n in ranks if not 2 <= n <= per_node]
    if not ranks or bad:
        raise ConfigError(f"--ranks {text!r}: every count must be between 2 and the {per_node} rank(s) of a node")
    return ranks


def default_nproc(device: str) -> int:
    if device == "cuda":
        import torch

        return torch.cuda.device_count()
    return min(4, max(2, os.cpu_count() or 2))


def options_from_args(args: argparse.Namespace, world: int | None = None, per_node: int | None = None) -> Options:
    """Check the command line (every problem a ConfigError); ``world`` / ``per_node`` are torchrun's, if any."""
    spec = (args.device or "auto").strip().lower()
    if spec not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {args.device!r}: use auto, cpu or cuda (each rank takes its local GPU)")
    backend = (args.backend or "auto").strip().lower()
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"--backend {args.backend!r}: use gloo (CPU) or nccl (GPUs; RCCL on ROCm)")
    if spec == "auto":
        if backend == "gloo":
            spec = "cpu"
        else:
            import torch

            spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"--device cuda but this torch sees no GPU (torch {torch.__version__}); use --device "
                              "cpu --backend gloo")
    if backend == "auto":
        backend = "nccl" if spec == "cuda" else "gloo"
    if backend == "nccl" and spec != "cuda":
        raise ConfigError("--backend nccl needs CUDA tensors: use --device cuda on a GPU machine, or --backend gloo")
    if backend == "gloo" and spec == "cuda":
        raise ConfigError("--backend gloo with --device cuda: gloo lacks most GPU collectives; use --backend nccl")
    if args.dtype not in _DTYPES:
        raise ConfigError(f"--dtype {args.dtype!r}: use float32 or bfloat16")
    if world is None:
        nproc = args.nproc if args.nproc is not None else default_nproc(spec)
        if nproc < 2:
            raise ConfigError(f"--nproc {nproc}: a collective needs at least 2 ranks"
                              + (" (this machine has fewer than 2 GPUs)" if spec == "cuda" else ""))
        if spec == "cuda":
            import torch

            if nproc > torch.cuda.device_count():
                raise ConfigError(f"--nproc {nproc}: only {torch.cuda.device_count()} GPU(s) visible")
        per_node = nproc
    else:
        if world < 2:
            raise ConfigError("zaya tune comm under torchrun needs at least 2 ranks (--nproc-per-node)")
        nproc = world
        per_node = per_node or world
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: must be at least 1")
    sizes = parse_sizes(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES[spec]))
    if args.config is not None and not Path(args.config).is_file():
        raise ConfigError(f"--config {args.config}: no such file")
    model = model_sizes(args.config) if args.config else None
    return Options(nproc=nproc, device=spec, backend=backend, sizes=sizes, ranks=parse_ranks(args.ranks, per_node),
                   repeats=repeats, warmup=1 if args.quick else 2, dtype=args.dtype, model=model,
                   quick=args.quick, json=args.json, save=not args.no_save, plot=not args.no_plot, out=args.out,
                   command=skeleton.command_line("zaya tune comm"))


# --- bandwidth conventions and the recommendations (pure) -----------------------------------------------------
def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth / algorithm bandwidth for ``op`` over ``n`` ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def curve(rows: list[dict[str, Any]], op: str, ranks: int) -> list[tuple[int, float, float]]:
    """(bytes, bus GB/s, seconds) of ``op`` over ``ranks`` ranks, by size."""
    return sorted((r["bytes"], r["busbw_gbps"], r["time_s"]) for r in rows
                  if r["op"] == op and r["ranks"] == ranks and r.get("time_s"))


def saturation_size(points: list[tuple[int, float]], fraction: float = SATURATION) -> tuple[int, float, bool]:
    """(the smallest size whose bandwidth reaches ``fraction`` of the peak, the peak, whether the curve saturated
    within the sizes measured: False when only the largest size reaches it, i.e. bandwidth may still be rising)."""
    if not points:
        raise ValueError("no measurements")
    points = sorted(points)
    peak = max(bw for _, bw in points)
    first = next(i for i, (_, bw) in enumerate(points) if bw >= fraction * peak)
    return points[first][0], peak, first < len(points) - 1


def interpolate(points: list[tuple[int, float]], size: float) -> tuple[float, bool]:
    """``points`` (bytes, value) at ``size``, log-log between the measured sizes; (value, whether size was inside
    the measured range: outside it the nearest end is extrapolated as constant bandwidth)."""
    points = sorted(points)
    if size <= points[0][0] or len(points) == 1:
        return points[0][1], size >= points[0][0]
    if size >= points[-1][0]:
        return points[-1][1], size <= points[-1][0]
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if s0 <= size <= s1:
            t = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return math.exp(math.log(v0) + t * (math.log(v1) - math.log(v0))), True
    raise AssertionError("unreachable")


def time_at(c: list[tuple[int, float, float]], op: str, n: int, size: float) -> float:
    """Seconds of one ``op`` of ``size`` bytes over ``n`` ranks, from its bandwidth curve."""
    bw, _ = interpolate([(s, b) for s, b, _ in c], size)
    return size * bus_factor(op, n) / (bw * 1e9)


def expert_all_to_all(layers: int, top_k: int, hidden_size: int, micro_tokens: float, micro_batches: float,
                      elem_bytes: int, ep: int) -> dict[str, float]:
    """Expert parallelism's all-to-all in one training step of one rank at degree ``ep``. ``message_bytes``: one
    exchange's per-rank input (every routed row of a micro-batch, ``micro_tokens x top_k`` rows of ``hidden_size``:
    the size convention of this module's rows); ``exchanges``: four per MoE layer and micro-batch (the rows out and
    their results back, in the forward and, their gradients, in the backward; activation checkpointing's recomputed
    forward adds two, not counted); ``bytes``: what leaves the rank, the (ep - 1) / ep of each message whose
    experts live on the other ranks (none at ep = 1). An ep group inside one node sends it over the node's fabric."""
    message = micro_tokens * top_k * hidden_size * elem_bytes
    exchanges = 4 * layers * micro_batches
    return {"message_bytes": message, "exchanges": exchanges,
            "bytes": exchanges * message * (ep - 1) / ep if ep > 1 else 0.0}


def all_to_all_points(rows: list[dict[str, Any]]) -> dict[int, list[tuple[int, float]]]:
    """The measured all-to-all curves, (bytes, bus GB/s) by size, per rank count (what the profile keeps)."""
    ns = sorted({r["ranks"] for r in rows if r["op"] == "all_to_all" and r.get("time_s")})
    return {n: [(s, b) for s, b, _ in curve(rows, "all_to_all", n)] for n in ns}


def price_all_to_all(points: dict[int, list[tuple[int, float]]], ep: int, message: float) -> tuple[float, str]:
    """Seconds of one all-to-all of ``message`` bytes per rank over ``ep`` ranks, from the measured curves
    (bus bandwidth interpolated at the message size; the curve of ``ep`` ranks, else of the nearest rank count
    measured), and a note on what was read."""
    if ep <= 1:
        return 0.0, "no exchange at degree 1"
    n = min(points, key=lambda m: (abs(m - ep), -m))
    bw, inside = interpolate(points[n], message)
    note = f"{n}-rank curve at {format_bytes(message)} ({bw:.3g} GB/s)"
    if n != ep:
        note += f"; {ep} ranks not measured"
    if not inside:
        note += "; outside the sizes measured: extrapolated"
    return message * bus_factor("all_to_all", ep) / (bw * 1e9), note


def model_sizes(config_path: str) -> dict[str, Any]:
    """A config's model (built on the meta device): parameters per block (FSDP2's unit) and in all, and what its
    expert all-to-all depends on (MoE layers, experts, top_k, width, the first stage's tokens per micro-batch and
    ``train.global_batch_tokens``, 0 when unset)."""
    import torch

    from zaya.config import load_config
    from zaya.core.hardware import compute_dtype
    from zaya.model import ZayaForCausalLM
    from zaya.model.info import parameter_count
    from zaya.train.schedule import stages_of

    config = load_config(config_path)
    dtype = compute_dtype(config.train.dtype, "cuda")  # what the GPUs of a swept cluster send
    with torch.device("meta"):
        model = ZayaForCausalLM(config.model)
    blocks = [parameter_count(b) for b in model.blocks]
    total = parameter_count(model)
    mc, first = config.model, stages_of(config)[0]
    return {"config": str(config_path), "params": total, "block_params": max(blocks), "num_blocks": len(blocks),
            "param_dtype_bytes": 2 if dtype == "bfloat16" else 4, "dtype": dtype,
            "num_layers": mc.num_layers, "num_experts": mc.num_experts, "top_k": mc.top_k,
            "hidden_size": mc.hidden_size, "micro_tokens": first.micro_batch_size * first.seq_len,
            "global_batch_tokens": config.train.global_batch_tokens or 0}


def expert_parallel(rows: list[dict[str, Any]], model: dict[str, Any], world: int) -> dict[str, Any] | None:
    """The expert all-to-all of one training step of ``model`` (``model_sizes()``) at each degree dividing its
    experts and ``world`` (the ranks measured), priced from the measured all-to-all curves, beside the gradient
    all-reduce (fp32, the whole model, ep = 1) over ``world`` ranks; None without all-to-all rows. A step is
    ``train.global_batch_tokens / world`` tokens per rank (or one micro-batch when it is unset)."""
    points = all_to_all_points(rows)
    if not points:
        return None
    micro = model["micro_tokens"]
    micro_batches = max(1.0, (model["global_batch_tokens"] or micro * world) / world / micro)
    degrees = []
    for ep in range(2, world + 1):
        if model["num_experts"] % ep or world % ep:
            continue
        x = expert_all_to_all(model["num_layers"], model["top_k"], model["hidden_size"], micro, micro_batches,
                              model["param_dtype_bytes"], ep)
        per, note = price_all_to_all(points, ep, x["message_bytes"])
        degrees.append({"ep": ep, **x, "seconds": x["exchanges"] * per, "priced_from": note})
    out: dict[str, Any] = {"micro_tokens": micro, "micro_batches": micro_batches, "degrees": degrees}
    ar = curve(rows, "all_reduce", world)
    if ar:
        out["all_reduce_bytes"] = 4 * model["params"]
        out["all_reduce_s"] = time_at(ar, "all_reduce", world, out["all_reduce_bytes"])
    return out


def recommend(rows: list[dict[str, Any]], model: dict[str, Any] | None = None,
              device_memory: float | None = None) -> dict[str, Any]:
    """The recommendations and their reasons from the measured ``rows`` (see the module docstring); ``model`` is
    ``model_sizes()``'s answer and ``device_memory`` one device's bytes, both optional."""
    ns = sorted({r["ranks"] for r in rows if r["op"] == "all_reduce" and r.get("time_s")})
    if not ns:
        raise ValueError("no all-reduce measurements to recommend from")
    out: dict[str, Any] = {"ranks": ns[-1], "reasons": {}, "notes": [], "bucket_mb_by_ranks": {}}
    for n in ns:
        size, _, _ = saturation_size([(s, b) for s, b, _ in curve(rows, "all_reduce", n)])
        out["bucket_mb_by_ranks"][str(n)] = _bucket_mb(size)
    n = ns[-1]
    ar = curve(rows, "all_reduce", n)
    size, peak, saturated = saturation_size([(s, b) for s, b, _ in ar])
    bucket = _bucket_mb(size)
    out["ddp_bucket_mb"] = bucket
    at = next(b for s, b, _ in ar if s == size)
    reason = (f"all-reduce over {n} ranks reaches {SATURATION:.0%} of its peak bus bandwidth ({peak:.3g} GB/s) at "
              f"{format_bytes(size)} ({at:.3g} GB/s)")
    if not saturated:
        reason += f"; bandwidth may still be rising at the largest size measured: rerun with --sizes up to " \
                  f"{format_bytes(4 * ar[-1][0])}"
    if bucket != size / MiB:
        reason += f"; kept within [{BUCKET_BOUNDS_MB[0]:g}, {BUCKET_BOUNDS_MB[1]:g}] MiB"
    out["reasons"]["ddp_bucket_mb"] = reason

    # ZeRO-1: gradients in the same buckets; parameters: one broadcast per owner (1/n of them each) vs one all-gather.
    bc, ag = curve(rows, "broadcast", n), curve(rows, "all_gather", n)
    total = model["params"] * 4 if model else ar[-1][0]
    zero1: dict[str, Any] = {"gradient_bucket_mb": bucket, "param_bytes": total}
    if bc and ag:
        t_bc = n * time_at(bc, "broadcast", n, total / n)
        t_ag = time_at(ag, "all_gather", n, total)
        zero1.update(broadcast_s=t_bc, all_gather_s=t_ag, param_sync="broadcast")
        what = f"{format_bytes(total)} of fp32 parameters" + (f" ({model['config']})" if model else "")
        text = (f"parameter sync of {what} over {n} ranks: {n} coalesced per-owner broadcasts (zaya's) "
                f"{t_bc * 1e3:.3g} ms, one all-gather {t_ag * 1e3:.3g} ms")
        if t_ag < 0.9 * t_bc:
            text += f": an all-gather would be {1 - t_ag / t_bc:.0%} faster (zaya does not implement it yet)"
            zero1["faster"] = "all_gather"
        else:
            text += ": keep the broadcasts"
        out["reasons"]["zero1"] = text
    out["zero1"] = zero1

    if model:
        block = model["block_params"] * model["param_dtype_bytes"]
        fsdp: dict[str, Any] = {"block_bytes": block, "config": model["config"]}
        if ag:
            bw, inside = interpolate([(s, b) for s, b, _ in ag], block)
            peak_ag = max(b for _, b, _ in ag)
            t_block = time_at(ag, "all_gather", n, block)
            fsdp.update(block_busbw_gbps=bw, fraction_of_peak=bw / peak_ag, block_all_gather_s=t_block)
            text = (f"a block of {model['config']} is {format_bytes(block)} of {model['dtype']} parameters, at which "
                    f"all-gather over {n} ranks reaches {bw / peak_ag:.0%} of its peak ({bw:.3g} of {peak_ag:.3g} "
                    f"GB/s; {t_block * 1e3:.3g} ms per block)")
            if not inside:
                text += " (outside the sizes measured: extrapolated)"
            if bw / peak_ag < 0.5:
                text += "; blocks this small leave the all-gathers latency-bound"
            gathered = model["params"] * model["param_dtype_bytes"] * (n - 1) / n
            if device_memory:
                keep = gathered <= KEEP_GATHERED_FRACTION * device_memory
                fsdp["reshard_after_forward"] = not keep
                text += (f"; keeping every block gathered after the forward costs {format_bytes(gathered)} per "
                         f"device ({gathered / device_memory:.1%} of {format_bytes(device_memory)}), so "
                         f"reshard_after_forward = {not keep}" + (f" (saves {model['num_blocks']} all-gathers, ~"
                                          f"{model['num_blocks'] * t_block * 1e3:.3g} ms, per micro-batch)"
                                          if keep else ""))
            out["reasons"]["fsdp"] = text
        out["fsdp"] = fsdp
        ep = expert_parallel(rows, model, n) if model.get("num_experts") else None
        if ep is not None:
            out["expert_parallel"] = ep
            step = (f"a step of {model['config']} ({ep['micro_batches']:g} micro-batch(es) of {ep['micro_tokens']:,} "
                    f"tokens per rank, {model['dtype']})")
            parts = [f"degree {d['ep']}: {d['exchanges']:g} all-to-alls of {format_bytes(d['message_bytes'])}, "
                     f"{format_bytes(d['bytes'])} sent, {d['seconds'] * 1e3:.3g} ms ({d['priced_from']})"
                     for d in ep["degrees"]]
            text = f"expert all-to-all of {step}: " + ("; ".join(parts) if parts else
                                                       f"no degree divides both {model['num_experts']} experts and "
                                                       f"{n} ranks")
            if "all_reduce_s" in ep:
                text += (f"; beside the gradient all-reduce of {format_bytes(ep['all_reduce_bytes'])} over {n} ranks, "
                         f"{ep['all_reduce_s'] * 1e3:.3g} ms")
            out["reasons"]["expert_parallel"] = text
    for r in rows:
        if r.get("impl_note") and r["impl_note"] not in out["notes"]:
            out["notes"].append(r["impl_note"])
    return out


def _bucket_mb(size: int) -> float:
    lo, hi = BUCKET_BOUNDS_MB
    return float(min(hi, max(lo, size / MiB)))


# --- measurement (in every rank) -------------------------------------------------------------------------------
def _barrier(group: Any, device: Any) -> None:
    import torch.distributed as dist

    dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)


def _implementations(op: str) -> list[tuple[str, str]]:
    """(implementation, note) in order of preference; the note flags a stand-in."""
    return {
        "all_reduce": [("all_reduce", "")],
        "all_gather": [("all_gather_single", ""),
                       ("all_gather (list)", "all_gather measured as all_gather into a list of tensors")],
        "reduce_scatter": [("reduce_scatter_single", ""),
                           ("reduce_scatter (list)", "reduce_scatter measured as reduce_scatter of a list"),
                           ("all_reduce + slice", "reduce_scatter measured as all_reduce + slice (2x the traffic: "
                                                  "a lower bound of its bandwidth)")],
        "all_to_all": [("all_to_all_single", ""),
                       ("all_to_all (list)", "all_to_all measured as all_to_all of lists")],
        "broadcast": [("broadcast", "")],
    }[op]


def _make_call(impl: str, count: int, n: int, me: int, group: Any, src: int, device: Any,
               dtype: Any, fill: bool = False) -> tuple[Callable[[], None], Callable[[], bool]]:
    """(one call of ``impl`` on buffers of ``count`` elements, a check of its result after one call with ``fill``)."""
    import torch
    import torch.distributed as dist

    part = count // n

    def buf(numel: int, value: float | None = None, chunks: bool = False) -> torch.Tensor:
        if not fill or value is None:
            return torch.zeros(numel, dtype=dtype, device=device)
        if chunks:  # chunk j holds value + j
            return (value + torch.arange(n, dtype=dtype, device=device)).repeat_interleave(numel // n)
        return torch.full((numel,), value, dtype=dtype, device=device)

    total = n * (n + 1) / 2
    if impl == "all_reduce":
        x = buf(count, me + 1)
        return lambda: dist.all_reduce(x, group=group), lambda: bool((x == total).all())
    if impl == "broadcast":
        x = buf(count, 7 if me == 0 else 0)
        return lambda: dist.broadcast(x, src=src, group=group), lambda: bool((x == 7).all())
    if impl.startswith("all_gather"):
        inp, out = buf(part, me), buf(count)
        expect = torch.arange(n, dtype=dtype, device=device).repeat_interleave(part)
        if impl == "all_gather_single":
            fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
            call = lambda: fn(out, inp, group=group)  # noqa: E731
        else:
            outs = list(out.chunk(n))
            call = lambda: dist.all_gather(outs, inp, group=group)  # noqa: E731
        return call, lambda: bool((out == expect).all())
    if impl.startswith("reduce_scatter") or impl == "all_reduce + slice":
        inp, out = buf(part * n, me + 1), buf(part)
        if impl == "reduce_scatter_single":
            fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            call = lambda: fn(out, inp, group=group)  # noqa: E731
        elif impl == "reduce_scatter (list)":
            ins = list(inp.chunk(n))
            call = lambda: dist.reduce_scatter(out, ins, group=group)  # noqa: E731
        else:
            def call() -> None:
                dist.all_reduce(inp, group=group)
                out.copy_(inp[me * part:(me + 1) * part])
        return call, lambda: bool((out == total).all())
    if impl.startswith("all_to_all"):
        inp, out = buf(part * n, me * n, chunks=True), buf(part * n)
        # rank r's chunk j is r*n + j and goes to rank j, so rank me receives j*n + me from rank j
        expect = (torch.arange(n, dtype=dtype, device=device) * n + me).repeat_interleave(part)
        if impl == "all_to_all_single":
            call = lambda: dist.all_to_all_single(out, inp, group=group)  # noqa: E731
        else:
            outs, ins = list(out.chunk(n)), list(inp.chunk(n))
            call = lambda: dist.all_to_all(outs, ins, group=group)  # noqa: E731
        return call, lambda: bool((out == expect).all())
    raise ValueError(f"unknown implementation {impl!r}")


def _agree(ok: bool, group: Any, device: Any) -> bool:
    """True on every rank of ``group`` when ``ok`` is true on all of them."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item() == 1.0)


def _pick(op: str, n: int, me: int, group: Any, src: int, device: Any, dtype: Any) -> tuple[str, str] | None:
    """The first implementation of ``op`` that runs and gives the right answer on every rank of ``group``."""
    import warnings

    for impl, note in _implementations(op):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch 2.13's renames
                call, check = _make_call(impl, 4 * n, n, me, group, src, device, dtype, fill=True)
                call()
                ok = check()
        except (RuntimeError, NotImplementedError, ValueError, AttributeError, TypeError):
            ok = False
        if _agree(ok, group, device):
            return impl, note
    return None


def _time(call: Callable[[], None], group: Any, device: Any, repeats: int, warmup: int) -> tuple[float, float, int]:
    """(median, min) seconds per call over ``repeats`` samples (each the slowest rank's), and calls per sample."""
    import torch
    import torch.distributed as dist

    from zaya.core.device import synchronize

    for _ in range(warmup):
        call()
    synchronize(device)
    _barrier(group, device)
    t0 = time.perf_counter()
    call()
    synchronize(device)
    estimate = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX, group=group)  # every rank must run the same count
    target = _SAMPLE_S.get(device.type, 0.01)
    iters = int(max(1, min(_MAX_ITERS, target // max(estimate.item(), 1e-7))))
    samples = []
    for _ in range(repeats):
        _barrier(group, device)
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        synchronize(device)
        samples.append((time.perf_counter() - t0) / iters)
    slowest = torch.tensor(samples, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    values = slowest.tolist()
    return statistics.median(values), min(values), iters


def measure(opts: Options, rank: int, world: int, per_node: int, device: Any,
            log: Callable[[str], None] = lambda m: None) -> list[dict[str, Any]]:
    """Every rank: sweep ``OPS x opts.sizes x opts.ranks`` (subgroups of the first n ranks, then the world when it
    spans nodes); rank 0, a member of every group, returns every row (the others their own)."""
    import warnings

    import torch.distributed as dist

    from zaya.core.device import to_dtype

    dtype = to_dtype(opts.dtype)
    elem = _DTYPES[opts.dtype]
    plan = []
    for n in opts.ranks:  # every rank creates every group, in the same order
        members = list(range(n))
        plan.append((n, None if n == world else dist.new_group(members), "intra-node"))
    if world > per_node and world not in opts.ranks:
        plan.append((world, None, f"inter-node ({world // per_node} nodes)"))
    rows: list[dict[str, Any]] = []
    for n, group, scope in plan:
        if rank < n:
            me = dist.get_rank(group) if group is not None else rank
            for op in OPS:
                chosen = _pick(op, n, me, group, 0, device, dtype)
                if chosen is None:
                    rows.append({"op": op, "ranks": n, "scope": scope, "impl": None, "bytes": None,
                                 "impl_note": f"{op}: not supported by {opts.backend}; skipped"})
                    continue
                impl, note = chosen
                for size in opts.sizes:
                    count = max(n, size // elem // n * n)  # a multiple of n elements
                    nbytes = count * elem
                    call, _ = _make_call(impl, count, n, me, group, 0, device, dtype)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", FutureWarning)
                        median, best, iters = _time(call, group, device, opts.repeats, opts.warmup)
                    del call
                    algbw = nbytes / median / 1e9
                    rows.append({"op": op, "ranks": n, "scope": scope, "impl": impl, "impl_note": note,
                                 "bytes": nbytes, "time_s": median, "min_time_s": best, "iters": iters,
                                 "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(op, n)})
                    if rank == 0:
                        log(f"  {op:<14} {n:>3} ranks {format_bytes(nbytes):>9}  {median * 1e6:10.1f} us  "
                            f"{rows[-1]['busbw_gbps']:8.3f} GB/s")
        _barrier(None, device)
    return rows


# --- the report ------------------------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]]) -> str:
    """One block per collective: a row per size, bus bandwidth (GB/s) and time per rank count."""
    lines = []
    ns = sorted({r["ranks"] for r in rows})
    for op in OPS:
        mine = [r for r in rows if r["op"] == op and r.get("time_s")]
        if not mine:
            continue
        impl = sorted({r["impl"] for r in mine})
        flag = "" if impl == [_implementations(op)[0][0]] else f"  [measured as {', '.join(impl)}]"
        lines.append(f"{op} (bus GB/s, time per call){flag}")
        header = f"  {'size':>9}" + "".join(f"  {f'{n} ranks':>20}" for n in ns)
        lines.append(header)
        for size in sorted({r["bytes"] for r in mine}):
            cells = []
            for n in ns:
                r = next((r for r in mine if r["ranks"] == n and r["bytes"] == size), None)
                cells.append(f"  {'-':>20}" if r is None else
                             f"  {r['busbw_gbps']:8.3f} {format_duration(r['time_s']):>11}")
            lines.append(f"  {format_bytes(size):>9}" + "".join(cells))
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bus bandwidth against message size, one panel per collective, a line per rank count."""
    ops = [op for op in OPS if any(r["op"] == op and r.get("time_s") for r in rows)]
    fig = skeleton.figure(3.2 * len(ops), 3.2)
    for i, op in enumerate(ops):
        ax = fig.add_subplot(1, len(ops), i + 1)
        for n in sorted({r["ranks"] for r in rows if r["op"] == op and r.get("time_s")}):
            c = curve(rows, op, n)
            ax.plot([s for s, _, _ in c], [b for _, b, _ in c], marker="o", markersize=3, label=f"{n} ranks")
        ax.set_xscale("log", base=2)
        sizes = sorted({r["bytes"] for r in rows if r["op"] == op and r.get("time_s")})
        ticks = sizes[::max(1, len(sizes) // 5)]
        ax.set_xticks(ticks, [format_bytes(t) for t in ticks])
        ax.minorticks_off()
        ax.set_title(op, fontsize=9)
        ax.set_xlabel("message bytes", fontsize=8)
        if i == 0:
            ax.set_ylabel("bus bandwidth GB/s", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    skeleton.write_png(fig, path, dpi=110)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """What goes into the profile's ``comm`` field: the setup, peak bus bandwidths and the reasons (not every row)."""
    rows = result["rows"]
    peaks: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("time_s"):
            cell = peaks.setdefault(r["op"], {})
            cell[str(r["ranks"])] = round(max(cell.get(str(r["ranks"]), 0.0), r["busbw_gbps"]), 4)
    rec = result["recommendation"]
    return {"backend": result["backend"], "device": result["device"], "dtype": result["dtype"],
            "world": result["world"], "ranks_per_node": result["ranks_per_node"], "ranks": result["ranks"],
            "sizes": [min(result["sizes"]), max(result["sizes"])], "repeats": result["repeats"],
            "peak_busbw_gbps": peaks,
            "all_to_all_busbw_gbps": {str(n): [[s, round(b, 4)] for s, b in pts]
                                      for n, pts in all_to_all_points(rows).items()},
            "bucket_mb_by_ranks": rec["bucket_mb_by_ranks"], "reasons": rec["reasons"],
            "notes": rec["notes"], "quick": result["quick"], "measured_at": result["measured_at"],
            "torch": result["torch"], "command": result["command"]}


def finish(opts: Options, rows: list[dict[str, Any]], world: int, per_node: int, device: Any) -> dict[str, Any]:
    """Rank 0: the recommendation and the result dict; the JSON and PNG written to ``opts.out``."""
    import torch

    from zaya.core.hardware import device_key

    model = opts.model
    memory = None
    if model:
        if device.type == "cuda":
            memory = torch.cuda.get_device_properties(device).total_memory
        else:
            import psutil

            memory = psutil.virtual_memory().total / per_node
    result = {"backend": opts.backend, "device": str(device.type), "device_key": device_key(device),
              "dtype": opts.dtype, "world": world, "ranks_per_node": per_node, "ranks": opts.ranks,
              "sizes": opts.sizes, "repeats": opts.repeats, "quick": opts.quick, "torch": torch.__version__,
              "measured_at": skeleton.now(),
              "command": opts.command, "rows": rows, "model": model,
              "recommendation": recommend(rows, model, memory), "files": [], "profile": None}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"comm-{result['device_key']}"
    if opts.plot:
        try:
            plot(rows, out / f"{stem}.png", f"zaya tune comm: {opts.backend}, {opts.dtype}, {result['device_key']}")
            result["files"].append(str(out / f"{stem}.png"))
        except ImportError:  # pragma: no cover - matplotlib is a dependency
            pass
    result["files"].insert(0, str(out / f"{stem}.json"))
    return result


def save(opts: Options, result: dict[str, Any], device: Any) -> str | None:
    """Local rank 0 of every node: write the recommendation into this device's hardware profile."""
    if not opts.save:
        return None
    rec = result["recommendation"]
    values: dict[str, Any] = {"ddp_bucket_mb": rec["ddp_bucket_mb"], "comm": summary(result)}
    if "reshard_after_forward" in rec.get("fsdp", {}):
        values["fsdp_reshard_after_forward"] = rec["fsdp"]["reshard_after_forward"]
    return skeleton.save_to_profile(device, **values)


def report(result: dict[str, Any]) -> str:
    """The human-readable report: setup, the tables, the recommendations and their reasons, the files."""
    rec = result["recommendation"]
    lines = [f"zaya tune comm: {result['backend']} on {result['device_key']}, {result['world']} rank(s) "
             f"({result['ranks_per_node']} per node), {result['dtype']}, median of {result['repeats']}"
             + (" (quick)" if result["quick"] else ""), "", table(result["rows"]), "", "recommendations:"]
    lines.append(f"  ddp / zero1 bucket_cap_mb = {rec['ddp_bucket_mb']:g}: {rec['reasons']['ddp_bucket_mb']}")
    if len(rec["bucket_mb_by_ranks"]) > 1:
        lines.append("    by ranks taking part: " + ", ".join(f"{n}: {mb:g} MiB"
                                                            for n, mb in rec["bucket_mb_by_ranks"].items()))
    if "zero1" in rec["reasons"]:
        lines.append(f"  zero1: {rec['reasons']['zero1']}")
    if "fsdp" in rec["reasons"]:
        lines.append(f"  fsdp: {rec['reasons']['fsdp']}")
    else:
        lines.append("  fsdp: pass --config to size the per-block all-gathers and choose reshard_after_forward")
    if "expert_parallel" in rec["reasons"]:
        lines.append(f"  expert parallel: {rec['reasons']['expert_parallel']}")
    for note in rec["notes"]:
        lines.append(f"  note: {note}")
    if result["quick"]:
        lines.append("  note: --quick measures small messages only; the bucket size is a lower bound")
    lines.append("")
    lines.append(f"profile: {result['profile']}" if result["profile"] else "profile: not written (--no-save)")
    lines.append("wrote " + ", ".join(result["files"]))
    return "\n".join(lines)


# --- processes -------------------------------------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, opts: Options, result_path: str) -> None:
    """One spawned rank: join the group on 127.0.0.1, sweep, and (rank 0) save and hand the result back."""
    threads = os.environ.get("OMP_NUM_THREADS", "1")  # what torchrun gives each rank
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": threads})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(threads))
    device = torch.device("cuda", rank) if opts.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(opts.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600),
                            device_id=device if device.type == "cuda" else None)
    try:
        rows = measure(opts, rank, world, world, device, skeleton.progress(quiet=opts.json))
        if rank == 0:
            result = finish(opts, rows, world, world, device)
            result["profile"] = save(opts, result, device)
            skeleton.write_json(result["files"][0], result)
            Path(result_path).write_text(json.dumps(result), encoding="utf-8")
        _barrier(None, device)
    finally:
        dist.destroy_process_group()


def spawn(opts: Options) -> dict[str, Any]:
    """Start ``opts.nproc`` ranks on this machine, sweep, and return rank 0's result."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="zaya-tune-comm-") as tmp:
        path = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(opts.nproc, port, opts, path), nprocs=opts.nproc, join=True,
                           start_method="spawn")
        return json.loads(Path(path).read_text(encoding="utf-8"))


def under_torchrun(args: argparse.Namespace) -> tuple[dict[str, Any] | None, Options]:
    """Every rank of a torchrun job: sweep on the job's group; rank 0 gets the result, local rank 0 saves."""
    import torch
    import torch.distributed as dist

    from zaya.distributed.runtime import start

    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    opts = options_from_args(args, world=world, per_node=per_node)
    if dist.is_initialized():
        rank = dist.get_rank()
        device = torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda" else torch.device("cpu")
    else:
        rt = start(device=opts.device)
        rank, device = rt.rank, rt.device
    rows = measure(opts, rank, world, per_node, device, skeleton.progress(quiet=opts.json))
    result = finish(opts, rows, world, per_node, device) if rank == 0 else None
    box = [result]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    result = box[0]
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        path = save(opts, result, device)
        if rank == 0:
            result["profile"] = path
            skeleton.write_json(result["files"][0], result)
    _barrier(None, device)
    return (result if rank == 0 else None), opts


def run(args: argparse.Namespace) -> int:
    """``zaya tune comm``: measure, print the table and the recommendations, save them; 0 when done."""
    from zaya.distributed.runtime import launched_by_torchrun

    if launched_by_torchrun():
        result, opts = under_torchrun(args)
        if result is None:
            return 0
    else:
        opts = options_from_args(args)
        skeleton.progress(quiet=opts.json)(
            f"zaya tune comm: starting {opts.nproc} {opts.backend} ranks on {opts.device}; ranks "
            f"{','.join(map(str, opts.ranks))}, {len(opts.sizes)} sizes {format_bytes(opts.sizes[0])}.."
            f"{format_bytes(opts.sizes[-1])}")
        result = spawn(opts)
    return skeleton.emit(result, opts.json, report)


