"""The cost model (``zaya.tune.cost``) against every recorded step time: each figure beside its prediction.

GPU figures (benchmarks/results.md, "GPU suite on an H200", 2026-12-04), predicted on the H200 profile, eager, with
the plans that run had (the loss in 2^19-element chunks, the default then; Newton-Schulz stacked and unblocked):

- ``model_step``: configs/zaya1-base.toml's [model] at 4 layers, 4 x 4,096 tokens, bf16 autocast, Muon + AdamW:
  445.7 ms a step, forward + backward 355.6, optimizer 84.8, clip 4.8.
- ``moe_block``: one ZAYA1-base MoE block (layer 1, router included), bf16 weights and input, 4,096 tokens,
  forward + backward: 5.9 ms.
- ``muon``: Muon over one ZAYA1-base layer's matrices (benchmarks/gpu_kernels.py ``_muon_shapes``), bf16
  Newton-Schulz: standard 23.2 ms, Gram 20.9 ms.

CPU figures, measured here by this script: the trainer's step (forward with labels, backward, clip, Muon + AdamW,
zero_grad) of configs/tiny.toml's model and a wider one in fp32, timed after a warm-up (median of ``--steps``),
against the prediction on this CPU's profile, measured by microbenchmarks before (``zaya.tune.cost.measure_cpu``).

Then ZAYA1-base's step (ZeRO-1, 4k context, micro-batch 1 per GPU as configs/zaya1-base.toml and ``zaya plan``
say; the loss in today's GPU chunks) on the H200 and the MI300X, eager and compiled, with MFU and the top sinks.

Run: ``PYTHONPATH=src python benchmarks/cost_model.py [--smoke] [--steps N]``; prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zaya.config import ModelConfig, OptimConfig, load_config
from zaya.core.hardware import GPU_LOSS_CHUNK_ELEMENTS
from zaya.tune.cost import DEVICES, measure_cpu, mfu, predict
from zaya.tune.kernel_trace import KernelRecorder, _profile, gpu_plans, trace_step

ROOT = Path(__file__).resolve().parent.parent
RUN_CHUNK = 1 << 19  # the loss chunk of every device when the H200 run was made (before 8ce9c51)
MEASURED = {"h200_step_ms": 445.7, "h200_fwd_bwd_ms": 355.6, "h200_optimizer_ms": 84.8, "h200_clip_ms": 4.8,
            "h200_moe_block_ms": 5.9, "h200_ns_standard_ms": 23.2, "h200_ns_gram_ms": 20.9}
MUON_SHAPES = [(16, 4096, 2048), (16, 2048, 2048), (1024, 2048), (256, 2048), (128, 2048), (128, 2048),
               (2048, 1024), (256, 2048), (256, 256), (256, 256), (17, 256)]


def _row(name: str, measured: float, predicted: float) -> dict:
    return {"figure": name, "measured_ms": measured, "predicted_ms": round(predicted, 1),
            "error": round(predicted / measured - 1, 3)}


def _base(layers: int | None = None) -> ModelConfig:
    cfg = load_config(ROOT / "configs" / "zaya1-base.toml").model
    return dataclasses.replace(cfg, num_layers=layers) if layers else cfg


def _moe_block_kernels(cfg: ModelConfig, tokens: int):
    from zaya.model.moe import MoEBlock

    with FakeTensorMode():
        block = MoEBlock(cfg, 1)
        for p in block.parameters():
            p.data = p.data.to(torch.bfloat16)
        h = torch.empty(1, tokens, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        prev = torch.empty(1, tokens, cfg.router_hidden_size, dtype=torch.bfloat16)
        with KernelRecorder() as rec:
            out, latent, _, _ = block(h, prev, None)
            torch.autograd.backward([out, latent], [torch.empty_like(out), torch.empty_like(latent)])
    return rec.kernels


def _muon_kernels(method: str, shapes, device_plans):
    from zaya.optim import Muon

    with _profile(device_plans), FakeTensorMode():
        params = [torch.nn.Parameter(torch.empty(s)) for s in shapes]
        for p in params:
            p.grad = torch.empty(p.shape)
        opt = Muon(params, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                   adjust_lr_fn="match_rms_adamw", ns_method=method, ns_dtype="bfloat16")
        with KernelRecorder() as rec:
            rec.phase = "optimizer"
            opt.step()  # the first step makes the momentum buffers; the timed steps are later ones
            rec.kernels.clear()
            opt.step()
    return rec.kernels


def gpu_validation(smoke: bool) -> list[dict]:
    h200 = DEVICES["h200"]
    layers, batch, seq = (1, 1, 256) if smoke else (4, 4, 4096)
    kernels = trace_step(_base(layers), batch, seq, plans=gpu_plans(RUN_CHUNK))
    p = predict(kernels, h200)
    fwd_bwd = (p.by_phase["forward"] + p.by_phase["backward"]) * 1e3
    rows = [_row("H200 4-layer step", MEASURED["h200_step_ms"], p.seconds * 1e3),
            _row("H200 forward + backward", MEASURED["h200_fwd_bwd_ms"], fwd_bwd),
            _row("H200 optimizer (Muon + AdamW, zero_grad)", MEASURED["h200_optimizer_ms"],
                 p.by_phase["optimizer"] * 1e3),
            _row("H200 clip", MEASURED["h200_clip_ms"], p.by_phase["clip"] * 1e3)]
    rows[0]["top_parts"] = {k: round(v * 1e3, 1) for k, v in p.top("by_part")}
    rows[0]["top_kinds"] = {k: round(v * 1e3, 1) for k, v in p.top("by_kind")}
    rows[0]["bound_ms"] = {k: round(v * 1e3, 1) for k, v in p.bound.items()}
    moe = predict(_moe_block_kernels(_base(), 256 if smoke else 4096), h200)
    rows.append(_row("H200 MoE block fwd + bwd, 4,096 tokens", MEASURED["h200_moe_block_ms"], moe.seconds * 1e3))
    shapes = [tuple(max(1, x // 16) for x in s) for s in MUON_SHAPES] if smoke else MUON_SHAPES
    for method in ("standard", "gram"):
        muon = predict(_muon_kernels(method, shapes, gpu_plans(RUN_CHUNK)), h200)
        rows.append(_row(f"H200 Newton-Schulz {method}", MEASURED[f"h200_ns_{method}_ms"], muon.seconds * 1e3))
    return rows


def _cpu_step_ms(cfg: ModelConfig, batch: int, seq: int, steps: int) -> float:
    from zaya.model import ZayaForCausalLM
    from zaya.optim.build import build_optimizers, split_parameters

    torch.manual_seed(0)
    model = ZayaForCausalLM(cfg)
    ocfg = dataclasses.replace(OptimConfig(), muon_ns_dtype="float32")
    optimizers = build_optimizers(split_parameters(model, ocfg.muon), ocfg)
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(3, cfg.vocab_size, (batch, seq))
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, ocfg.grad_clip)
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cpu_validation(steps: int, smoke: bool) -> tuple[list[dict], dict]:
    cpu = measure_cpu()
    tiny = load_config(ROOT / "configs" / "tiny.toml").model
    wide = dataclasses.replace(tiny, hidden_size=512, expert_hidden_size=1024, num_query_heads=8, num_kv_heads=2)
    cases = [("tiny", tiny, 4, 128)] + ([] if smoke else [("wide", wide, 4, 256)])
    rows = []
    for name, cfg, batch, seq in cases:
        measured = _cpu_step_ms(cfg, batch, seq, steps)
        predicted = predict(trace_step(cfg, batch, seq, dtype="float32"), cpu).seconds * 1e3
        rows.append(_row(f"CPU {name} step fp32 ({batch} x {seq}, d {cfg.hidden_size})", round(measured, 1),
                         predicted))
    profile = {"gemm_fp32_gflops": round(cpu.peak_flops["float32"] / 1e9, 1),
               "bandwidth_gb_s": round(cpu.bandwidth / 1e9, 1), "launch_us": round(cpu.launch_s * 1e6, 2),
               "attention_efficiency": round(cpu.attention_efficiency, 3), "device": cpu.name}
    return rows, profile


def zaya1_base(smoke: bool) -> list[dict]:
    layers, seq = (1, 256) if smoke else (None, 4096)
    cfg = _base(layers)
    kernels = trace_step(cfg, 1, seq, plans=gpu_plans(GPU_LOSS_CHUNK_ELEMENTS))
    out = []
    for key in ("h200", "mi300x"):
        for compiled in (False, True):
            p = predict(kernels, DEVICES[key], compiled)
            out.append({"device": DEVICES[key].name, "compiled": compiled, "step_ms": round(p.seconds * 1e3, 1),
                        "mfu": round(mfu(cfg, seq, seq, p.seconds, DEVICES[key].peak_flops["bfloat16"]), 3),
                        "launches": p.launches,
                        "top_parts_ms": {k: round(v * 1e3, 1) for k, v in p.top("by_part")},
                        "top_kinds_ms": {k: round(v * 1e3, 1) for k, v in p.top("by_kind")},
                        "bound_ms": {k: round(v * 1e3, 1) for k, v in p.bound.items()}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="small shapes: checks that every part runs (seconds)")
    ap.add_argument("--steps", type=int, default=5, help="timed CPU steps per shape (median)")
    ap.add_argument("--skip-cpu", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = {"gpu_validation": gpu_validation(args.smoke)}
    if not args.skip_cpu:
        result["cpu_validation"], result["cpu_profile"] = cpu_validation(2 if args.smoke else args.steps, args.smoke)
    result["zaya1_base_4k_micro_batch_1"] = zaya1_base(args.smoke)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
