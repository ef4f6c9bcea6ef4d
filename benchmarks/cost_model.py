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
zero_grad) of configs/tiny.toml's model and a wider one in fp32, timed after two warm-up steps, against the
prediction on this CPU's profile measured by microbenchmarks (``zaya.tune.cost.measure_cpu``) just before, in
``--rounds`` alternating rounds (medians). Both on ``zaya.tune.cost.cpu_clock``: at one thread, this thread's CPU
time, so that what other jobs on a shared machine take is neither the step's nor the microbenchmarks'.

Operands in memory (``cold_gemms``): Muon's products in the tiny step timed alone, operands hot and cold, beside the
model's cold rate (the measured hot rate plus the bytes at the copy bandwidth: ``Device.gemm_loads_overlap``).

The MoE block's host time (``moe_block_host``): the same block's forward + backward on this CPU at ZAYA1-base's
structure (16 experts, top-1, skip class, EDA) but a width of 16, every grouped GEMM replaced by one kernel of its
result's shape (a CPU runs a grouped GEMM as a loop over experts, a GPU as one kernel), so that each iteration's time
is what issuing its ops costs the host (Python, autograd, dispatch), beside what the cost model charges for them.

What settles the MoE block's miss on a GPU (``moe_block_device``, ``--moe-device cuda``; it needs
benchmarks/moe_block.py and transformers, as the GPU suite's check does): the block as that check builds and runs
it, timed per iteration both to the host's last issue and to the closing synchronize, the device time of each kernel
of one iteration (``torch.profiler``), and the grouped GEMMs alone at the block's shapes, beside the cost
model's prediction.

Then ZAYA1-base's micro-batch (ZeRO-1, 4k context; micro-batch 1 as configs/zaya1-base.toml, and 5 on the
MI300X, the most ``zaya plan`` fits there without activation checkpointing; the loss in today's GPU chunks) on the
H200 and the MI300X: forward + backward, eager, compiled, and what-ifs (the loss fused too; attention kernels at the
GEMMs' efficiency), with MFU, and the top sinks of one full-depth trace.

Run: ``PYTHONPATH=src python benchmarks/cost_model.py [--smoke] [--rounds N] [--skip-cpu] [--moe-host]``; prints one
JSON object (``--moe-host``: only the MoE block's host time and the cold GEMMs).
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
from zaya.tune.cost import DEVICES, cpu_clock, measure_cpu, mfu, predict
from zaya.tune.kernel_trace import KernelRecorder, gpu_plans, planned_as, trace_step

ROOT = Path(__file__).resolve().parent.parent
RUN_CHUNK = 1 << 19  # the loss chunk of every device when the H200 run was made (before 8ce9c51)
MEASURED = {"h200_step_ms": 445.7, "h200_fwd_bwd_ms": 355.6, "h200_optimizer_ms": 84.8, "h200_clip_ms": 4.8,
            "h200_moe_block_ms": 5.9, "h200_ns_standard_ms": 23.2, "h200_ns_gram_ms": 20.9}
MUON_SHAPES = [(16, 4096, 2048), (16, 2048, 2048), (1024, 2048), (256, 2048), (128, 2048), (128, 2048),
               (2048, 1024), (256, 2048), (256, 256), (256, 256), (17, 256)]


def _row(name: str, measured: float, predicted: float) -> dict:
    return {"figure": name, "measured_ms": measured, "predicted_ms": round(predicted, 1),
            "error": round(predicted / measured - 1, 3)}


# --smoke: every part on a micro model, in seconds (tests/test_cost_model.py runs it)
SMOKE_MODEL = ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_query_heads=4, num_kv_heads=2,
                          head_dim=16, num_experts=4, expert_hidden_size=64, router_hidden_size=16)


def _base(layers: int | None = None, smoke: bool = False) -> ModelConfig:
    cfg = SMOKE_MODEL if smoke else load_config(ROOT / "configs" / "zaya1-base.toml").model
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


COLD_SHAPES = ((256, 256, 256), (256, 256, 1024), (256, 1024, 256))
"""(m, k, n) of Muon's Newton-Schulz products in the tiny step: B = bA + cA^2, X = aX + BX, A = X X^T."""


def cold_gemms(rounds: int, smoke: bool) -> list[dict]:
    """Each of ``COLD_SHAPES`` as ``torch.addmm(c, a, b, out=o)`` at one thread, on thread CPU time: with one operand
    set (hot: in cache) and rotated over 48 (cold: tens of MB, past the caches), each rate the median of ``rounds``
    interleaved windows of 0.15 s; beside the cost model's cold rate, the hot one with the call's bytes (c, a, b
    read, o written) at this CPU's copy bandwidth added."""
    torch.set_num_threads(1)
    shapes = ((16, 16, 16),) if smoke else COLD_SHAPES
    cases = {}
    for m, k, n in shapes:
        for sets in (1, 48):
            ops = [(torch.randn(m, n), torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)) for _ in range(sets)]
            cases[(m, k, n, sets)] = ops
    rates: dict[tuple, list[float]] = {key: [] for key in cases}
    for _ in range(rounds):
        for key, ops in cases.items():
            calls, t0 = 0, time.thread_time()
            while time.thread_time() - t0 < 0.15:
                c, a, b, o = ops[calls % len(ops)]
                torch.addmm(c, a, b, beta=0.5, alpha=2.0, out=o)
                calls += 1
            rates[key].append(2.0 * key[0] * key[1] * key[2] * calls / (time.thread_time() - t0))
    bandwidth = measure_cpu().bandwidth
    rows = []
    for m, k, n in shapes:
        flops, nbytes = 2.0 * m * k * n, 4 * (2 * m * n + m * k + k * n)
        hot, cold = (statistics.median(rates[(m, k, n, sets)]) for sets in (1, 48))
        rows.append({"m_k_n": [m, k, n], "hot_gflops": round(hot / 1e9, 1), "cold_gflops": round(cold / 1e9, 1),
                     "model_cold_gflops": round(flops / (flops / hot + nbytes / bandwidth) / 1e9, 1)})
    return rows


def moe_block_host(rounds: int, smoke: bool) -> dict:
    """The MoE block's forward + backward as the H200 check ran it (bf16 weights and input, 2 x 2,048 tokens scaled
    down to 2 x 32), at width 16 on this CPU at one thread: thread CPU time per iteration (median of ``rounds``
    rounds of 20), its kernels and ops without one, and the host time the cost model charges for them here (this
    CPU's measured small op and view) and on the H200 (5 / 1 us)."""
    from zaya.model.moe import MoEBlock

    torch.set_num_threads(1)
    cfg = dataclasses.replace(_base(smoke=smoke), hidden_size=16, expert_hidden_size=16, router_hidden_size=16)
    torch.manual_seed(0)
    block = MoEBlock(cfg, 1)
    block.reset_parameters(cfg.init_std, cfg.num_layers)
    for p in block.parameters():
        p.data = p.data.to(torch.bfloat16)
    h = torch.randn(2, 32, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    prev = torch.randn(2, 32, cfg.router_hidden_size, dtype=torch.bfloat16)
    grads = torch.randn(2, 32, cfg.hidden_size), torch.randn(2, 32, cfg.router_hidden_size)
    grouped_mm = torch.nn.functional.grouped_mm

    def one_kernel(a, b, offs=None):
        return a.new_zeros((a.shape[0], b.shape[-1]) if b.dim() == 3 else (offs.shape[0], a.shape[0], b.shape[-1]))

    def iteration() -> None:
        for p in block.parameters():
            p.grad = None
        h.grad = None
        out, latent, _, _ = block(h, prev, None)
        torch.autograd.backward([out, latent], [grads[0].to(out.dtype), grads[1].to(latent.dtype)])

    torch.nn.functional.grouped_mm = one_kernel
    try:
        iteration()
        with KernelRecorder() as rec:
            iteration()
        times = []
        for _ in range(rounds):
            t0 = time.thread_time()
            for _ in range(20):
                iteration()
            times.append((time.thread_time() - t0) / 20)
    finally:
        torch.nn.functional.grouped_mm = grouped_mm
    kernels, others = len(rec.kernels), sum(k.host_ops for k in rec.kernels)
    cpu, h200 = measure_cpu(), DEVICES["h200"]
    return {"host_ms": round(statistics.median(times) * 1e3, 2), "kernels": kernels, "ops_without_kernel": others,
            "model_host_ms_this_cpu": round((kernels * cpu.launch_s + others * cpu.host_op_s) * 1e3, 2),
            "model_host_ms_h200": round((kernels * h200.launch_s + others * h200.host_op_s) * 1e3, 2)}


def moe_block_device(device_name: str, repeats: int, smoke: bool) -> dict:
    """The MoE block of benchmarks/moe_block.py's ``ours`` mode (bf16 weights and input, balanced routing, zero
    grads + forward + backward) on ``device_name``: per iteration the host's issue time (to its last op) and the
    whole time (to the closing synchronize), medians of ``repeats``; one iteration's kernels by device time (the
    profiler's CUDA activity; self CPU time on the CPU); the grouped GEMMs alone at the block's shapes (balanced
    offsets; TFLOP/s); and the cost model's prediction on the H200 profile."""
    import moe_block as mb
    from torch.profiler import ProfilerActivity, profile

    from zaya.core.device import resolve_device, synchronize

    device = resolve_device(device_name)
    shape, tokens = ("tiny", 64) if smoke else ("base", 4096)
    inputs = mb.make_inputs(shape, tokens, seed=1, device=device)
    ours = mb.bf16_copy(mb.build(shape, 0, inputs, device)[0])

    def iteration() -> None:
        mb.run_once("ours", ours, inputs, torch.bfloat16, False)

    def clocked(fn) -> tuple[float, float]:
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        issued = time.perf_counter()
        synchronize(device)
        return issued - t0, time.perf_counter() - t0

    for _ in range(2):
        iteration()
    runs = [clocked(iteration) for _ in range(repeats)]
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        iteration()
        synchronize(device)
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    kernels = sorted(((getattr(e, attr), e.count, e.key) for e in prof.key_averages() if getattr(e, attr) > 0
                      and (cuda or e.key.startswith("aten::"))), reverse=True)
    cfg = ours.experts
    d, i, e = cfg.hidden_size, cfg.expert_hidden_size, cfg.num_experts
    offs = torch.arange(1, e + 1, device=device, dtype=torch.int32) * (tokens // e)
    x, g_up, act, w_up, w_down = (torch.randn(*s, device=device, dtype=torch.bfloat16) for s in
                                  ((tokens, d), (tokens, 2 * i), (tokens, i), (e, 2 * i, d), (e, d, i)))
    gmm = torch.nn.functional.grouped_mm
    up_flops, down_flops = 2.0 * tokens * d * 2 * i, 2.0 * tokens * i * d
    gemms = {"gate_up forward": (lambda: gmm(x, w_up.transpose(-2, -1), offs=offs), up_flops),
             "gate_up input gradient": (lambda: gmm(g_up, w_up, offs=offs), up_flops),
             "gate_up weight gradient": (lambda: gmm(g_up.t(), x, offs=offs), up_flops),
             "down forward": (lambda: gmm(act, w_down.transpose(-2, -1), offs=offs), down_flops)}
    rates = {}
    for name, (fn, flops) in gemms.items():
        fn()
        rates[name] = round(flops / statistics.median(clocked(fn)[1] for _ in range(repeats)) / 1e12, 4)
    predicted = predict(_moe_block_kernels(_base(smoke=smoke), tokens), DEVICES["h200"])
    return {"device": str(device), "tokens": tokens,
            "iteration_ms": round(statistics.median(r[1] for r in runs) * 1e3, 3),
            "host_issue_ms": round(statistics.median(r[0] for r in runs) * 1e3, 3),
            "kernel_time_ms": round(sum(k[0] for k in kernels) / 1e3, 3), "kernels": sum(k[1] for k in kernels),
            "top_kernels_us": [[round(t, 1), n, name[:120]] for t, n, name in kernels[:12]],
            "grouped_mm_tflops_alone": rates, "predicted_h200_ms": round(predicted.seconds * 1e3, 3),
            "predicted_h200_host_ms": round(predicted.host_seconds * 1e3, 3)}


def _muon_kernels(method: str, shapes, device_plans):
    from zaya.optim import Muon

    with planned_as(device_plans), FakeTensorMode():
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
    layers, batch, seq = (1, 1, 32) if smoke else (4, 4, 4096)
    kernels = trace_step(_base(layers, smoke), batch, seq, plans=gpu_plans(RUN_CHUNK))
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
    rows[0]["host_ms"] = round(p.host_seconds * 1e3, 1)
    rows[0]["host_ops"] = {"kernels": len(kernels), "without_kernel": sum(k.host_ops for k in kernels)}
    moe = predict(_moe_block_kernels(_base(smoke=smoke), 32 if smoke else 4096), h200)
    rows.append(_row("H200 MoE block fwd + bwd, 4,096 tokens", MEASURED["h200_moe_block_ms"], moe.seconds * 1e3))
    rows[-1].update(host_ms=round(moe.host_seconds * 1e3, 2), bound_ms={k: round(v * 1e3, 2) for k, v in
                                                                       moe.bound.items()})
    shapes = [tuple(max(1, x // 16) for x in s) for s in MUON_SHAPES] if smoke else MUON_SHAPES
    for method in ("standard", "gram"):
        muon = predict(_muon_kernels(method, shapes, gpu_plans(RUN_CHUNK)), h200)
        rows.append(_row(f"H200 Newton-Schulz {method}", MEASURED[f"h200_ns_{method}_ms"], muon.seconds * 1e3))
    return rows


def _cpu_stepper(cfg: ModelConfig, batch: int, seq: int):
    """One fp32 training step of ``cfg`` on this CPU as the trainer runs it, as a callable returning its ms on
    ``zaya.tune.cost.cpu_clock`` (this thread's CPU time at one thread: what the profile's microbenchmarks use)."""
    from zaya.model import ZayaForCausalLM
    from zaya.optim.build import build_optimizers, split_parameters

    torch.manual_seed(0)
    model = ZayaForCausalLM(cfg)
    ocfg = dataclasses.replace(OptimConfig(), muon_ns_dtype="float32")
    optimizers = build_optimizers(split_parameters(model, ocfg.muon), ocfg)
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(3, cfg.vocab_size, (batch, seq))
    clock = cpu_clock()

    def step() -> float:
        t0 = clock()
        model(ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, ocfg.grad_clip)
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        return (clock() - t0) * 1e3

    step()
    step()  # warm-up: optimizer state, allocator
    return step


def cpu_validation(rounds: int, smoke: bool, threads: int) -> tuple[list[dict], dict]:
    """Alternating rounds, each after waiting for a quiet machine: this CPU's profile measured by microbenchmarks,
    then one step of each shape; the medians of both. The machine is shared: what slows a round's step slows its
    microbenchmarks too, so each prediction uses the profile of its own round. ``threads``: intra-op threads of
    both (1 by default: with other jobs on the cores, two threads' OpenMP barriers stalled a tiny GEMM to 70 ms)."""
    from quiet import wait_quiet

    torch.set_num_threads(threads)

    tiny = load_config(ROOT / "configs" / "tiny.toml").model
    wide = dataclasses.replace(tiny, hidden_size=512, expert_hidden_size=1024, num_query_heads=8, num_kv_heads=2)
    cases = [("smoke", SMOKE_MODEL, 1, 32)] if smoke else [("tiny", tiny, 4, 128), ("wide", wide, 4, 256)]
    traces = {name: trace_step(cfg, b, t, dtype="float32") for name, cfg, b, t in cases}
    steppers = {name: _cpu_stepper(cfg, b, t) for name, cfg, b, t in cases}
    measured: dict[str, list[float]] = {name: [] for name, *_ in cases}
    predicted: dict[str, list[float]] = {name: [] for name, *_ in cases}
    profiles = []
    for _ in range(rounds):
        wait_quiet(0.25, 0 if smoke else 30)
        cpu = measure_cpu()
        profiles.append(cpu)
        for name, *_ in cases:
            measured[name].append(steppers[name]())
            predicted[name].append(predict(traces[name], cpu).seconds * 1e3)
    rows = [_row(f"CPU {name} step fp32 ({b} x {t}, d {cfg.hidden_size}, Muon + AdamW)",
                 round(statistics.median(measured[name]), 1), statistics.median(predicted[name]))
            for name, cfg, b, t in cases]
    med = lambda f: statistics.median(f(c) for c in profiles)  # noqa: E731
    profile = {"gemm_fp32_gflops": round(med(lambda c: c.peak_flops["float32"]) / 1e9, 1),
               "bandwidth_gb_s": round(med(lambda c: c.bandwidth) / 1e9, 1),
               "launch_us": round(med(lambda c: c.launch_s) * 1e6, 2),
               "host_op_us": round(med(lambda c: c.host_op_s) * 1e6, 2),
               "gemm_rate_by_side_gflops": {round((f / 2) ** (1 / 3)): round(
                   statistics.median(c.gemm_curve[i][1] * c.peak_flops["float32"] for c in profiles) / 1e9, 1)
                   for i, (f, _) in enumerate(profiles[0].gemm_curve)},
               "attention_efficiency": round(med(lambda c: c.attention_efficiency), 3),
               "device": profiles[0].name, "rounds": rounds}
    return rows, profile


def _per_layer(kernels_1, kernels_2, layers: int, device, **kw) -> dict[str, float]:
    """Seconds of the forward + backward at ``layers`` layers, by phase: the traces of 1 and 2 layers extrapolated
    linearly (every layer is the same work; ``full_trace_check`` compares one full-depth trace)."""
    a, b = predict(kernels_1, device, **kw), predict(kernels_2, device, **kw)
    return {ph: a.by_phase[ph] + (layers - 1) * (b.by_phase[ph] - a.by_phase[ph]) for ph in ("forward", "backward")}


def zaya1_base(smoke: bool) -> dict:
    """ZAYA1-base, 4k context, forward + backward of one micro-batch per GPU (the per-micro-batch work; clip and the
    optimizer come once per optimizer step, and ZeRO-1 shards the optimizer over the ranks), eager and compiled,
    with what-ifs for the list that reaches 35 %."""
    cfg = _base(smoke=smoke)
    seq = 32 if smoke else 4096
    layers = cfg.num_layers
    plans = gpu_plans(GPU_LOSS_CHUNK_ELEMENTS)
    batches = {"h200": [1], "mi300x": [1] if smoke else [1, 5]}  # zaya plan: zero1, no AC: H200 1, MI300X 5
    traces = {}
    for b in sorted({b for bs in batches.values() for b in bs}):
        traces[b] = [trace_step(_base(n, smoke), b, seq, plans=plans, optimizer=False) for n in (1, 2)]
    rows = []
    for key, bs in batches.items():
        dev = DEVICES[key]
        fa3 = dataclasses.replace(dev, attention_efficiency=dev.gemm_efficiency)
        for b in bs:
            k1, k2 = traces[b]
            cases = [("eager", dev, {}), ("compiled (blocks)", dev, {"compiled": True}),
                     ("compiled, loss and embedding fused too", dev, {"compiled": True, "eager_parts": ()}),
                     ("... and attention at the GEMM efficiency", fa3, {"compiled": True, "eager_parts": ()})]
            for name, d, kw in cases:
                phases = _per_layer(k1, k2, layers, d, **kw)
                t = sum(phases.values())
                rows.append({"device": dev.name, "micro_batch": b, "variant": name,
                             "fwd_bwd_ms": round(t * 1e3, 1),
                             "mfu": round(mfu(cfg, b * seq, seq, t, dev.peak_flops["bfloat16"]), 3)})
    full = {}
    if not smoke:  # the extrapolation against one full-depth trace (H200, micro-batch 1, eager)
        p = predict(trace_step(cfg, 1, seq, plans=plans, optimizer=False), DEVICES["h200"])
        full = {"full_trace_ms": round(p.seconds * 1e3, 1),
                "extrapolated_ms": round(sum(_per_layer(*traces[1], layers, DEVICES["h200"]).values()) * 1e3, 1),
                "top_parts_ms": {k: round(v * 1e3, 1) for k, v in p.top("by_part", 6)},
                "top_kinds_ms": {k: round(v * 1e3, 1) for k, v in p.top("by_kind", 6)},
                "bound_ms": {k: round(v * 1e3, 1) for k, v in p.bound.items()}}
    return {"seq_len": seq, "layers": layers, "rows": rows, "full_trace_check": full}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a micro model: checks that every part runs (seconds)")
    ap.add_argument("--rounds", type=int, default=5, help="CPU rounds (a profile and a step of each shape)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of the CPU rounds (default 1)")
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--moe-device", metavar="DEVICE",
                    help="only the MoE block's per-kernel profile and host issue time on DEVICE (cuda on a GPU)")
    ap.add_argument("--moe-host", action="store_true",
                    help="only the MoE block's host time and the cold GEMMs on this CPU")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.moe_device:
        print(json.dumps({"moe_block_device": moe_block_device(args.moe_device, args.rounds, args.smoke)}))
        return
    if args.moe_host:
        print(json.dumps({"cold_gemms": cold_gemms(args.rounds, args.smoke),
                          "moe_block_host": moe_block_host(args.rounds, args.smoke)}))
        return
    result = {"gpu_validation": gpu_validation(args.smoke)}
    if not args.skip_cpu:
        result["cpu_validation"], result["cpu_profile"] = cpu_validation(1 if args.smoke else args.rounds, args.smoke,
                                                                       args.threads)
        result["cold_gemms"] = cold_gemms(1 if args.smoke else args.rounds, args.smoke)
        result["moe_block_host"] = moe_block_host(1 if args.smoke else args.rounds, args.smoke)
    if args.smoke:  # the GPU measurement's code path, on this CPU
        result["moe_block_device"] = moe_block_device("cpu", 1, smoke=True)
    result["zaya1_base_4k"] = zaya1_base(args.smoke)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
