"""``zaya tune cost``: a config's training step predicted on devices by the cost model (``zaya.tune.cost``)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from zaya.config import load_config
from zaya.core.errors import ConfigError
from zaya.core.hardware import GPU_LOSS_CHUNK_ELEMENTS
from zaya.tune import report as skeleton
from zaya.tune.cost import DEVICES, measure_cpu, mfu, predict
from zaya.tune.kernel_trace import gpu_plans, trace_step


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FILE", help="TOML config, e.g. configs/zaya1-base.toml")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--device", default="h100,h200,mi300x", metavar="NAME[,NAME...]",
                   help=f"devices to predict on: {', '.join(DEVICES)}, cpu (this CPU, measured; fp32) "
                        "(default h100,h200,mi300x)")
    p.add_argument("--micro-batch", type=int, metavar="N", help="sequences per micro-batch (default the config's)")
    p.add_argument("--seq-len", type=int, metavar="N", help="tokens per sequence (default the config's)")
    p.add_argument("--layers", type=int, metavar="N", help="trace this many layers instead of the config's")
    p.add_argument("--loss-chunk", type=int, default=GPU_LOSS_CHUNK_ELEMENTS, metavar="ELEMENTS",
                   help=f"the loss's fp32 elements per row chunk on a GPU (default {GPU_LOSS_CHUNK_ELEMENTS})")
    p.add_argument("--top", type=int, default=5, metavar="N", help="time sinks listed per table (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.set or [])
    names = [n.strip().lower() for n in args.device.split(",") if n.strip()]
    unknown = [n for n in names if n not in DEVICES and n != "cpu"]
    if unknown or not names:
        raise ConfigError(f"--device {args.device}: unknown device(s) {', '.join(unknown) or '(none)'}; choose from "
                          f"{', '.join(DEVICES)}, cpu")
    cfg = config.model if args.layers is None else dataclasses.replace(config.model, num_layers=args.layers)
    batch = args.micro_batch or config.train.micro_batch_size
    seq = args.seq_len or config.train.seq_len
    for name, value in (("--micro-batch", batch), ("--seq-len", seq), ("--layers", cfg.num_layers),
                        ("--loss-chunk", args.loss_chunk)):
        if value < 1:
            raise ConfigError(f"{name} {value}: must be at least 1")
    traces: dict[str, Any] = {}
    result: dict[str, Any] = {"config": args.config, "layers": cfg.num_layers, "micro_batch": batch, "seq_len": seq,
                              "predictions": []}
    for name in names:
        gpu = name != "cpu"
        dtype = "bfloat16" if gpu else "float32"
        if dtype not in traces:
            traces[dtype] = trace_step(cfg, batch, seq, dtype=dtype, plans=gpu_plans(args.loss_chunk) if gpu else None)
        device = DEVICES[name] if gpu else measure_cpu()
        for compiled in (False, True):
            p = predict(traces[dtype], device, compiled)
            micro = p.seconds - p.by_phase.get("optimizer", 0.0)
            result["predictions"].append({
                "device": device.name, "compiled": compiled, "step_ms": round(p.seconds * 1e3, 2),
                "phases_ms": {k: round(v * 1e3, 2) for k, v in p.by_phase.items()}, "launches": p.launches,
                "host_ms": round(p.host_seconds * 1e3, 2),
                "mfu": round(mfu(cfg, batch * seq, seq, p.seconds, device.peak_flops["bfloat16" if gpu else
                                                                                       "float32"]), 4),
                "mfu_without_optimizer": round(mfu(cfg, batch * seq, seq, micro, device.peak_flops[
                    "bfloat16" if gpu else "float32"]), 4),
                "top_parts_ms": {k: round(v * 1e3, 2) for k, v in p.top("by_part", args.top)},
                "top_kinds_ms": {k: round(v * 1e3, 2) for k, v in p.top("by_kind", args.top)},
                "bound_ms": {k: round(v * 1e3, 2) for k, v in p.bound.items()}})
    return skeleton.emit(result, args.json, _text)


def _text(r: dict[str, Any]) -> str:
    lines = [f"zaya tune cost: {r['config']}, {r['layers']} layers, micro-batch {r['micro_batch']} x {r['seq_len']} "
             "tokens (forward, backward, clip, Muon + AdamW replicated)"]
    for p in r["predictions"]:
        mode = "compiled" if p["compiled"] else "eager"
        phases = ", ".join(f"{k} {v:.1f}" for k, v in p["phases_ms"].items())
        lines.append(f"\n{p['device']}, {mode}: {p['step_ms']:.1f} ms ({phases}), {p['launches']:,} kernels "
                     f"(the host issues them in {p['host_ms']:.1f} ms), "
                     f"MFU {100 * p['mfu']:.1f} % ({100 * p['mfu_without_optimizer']:.1f} % without the optimizer)")
        for key in ("top_parts_ms", "top_kinds_ms", "bound_ms"):
            label = {"top_parts_ms": "by part", "top_kinds_ms": "by kind", "bound_ms": "bound"}[key]
            lines.append(f"  {label:8s} " + ", ".join(f"{k} {v:.1f} ms" for k, v in p[key].items()))
    return "\n".join(lines)
