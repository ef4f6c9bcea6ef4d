"""GPU suite checks ``model_step`` and ``model_step_deep``: the full model's training step at the ZAYA1-base layer
shape, eager and with the blocks compiled, each beside the cost model's prediction.

A ``ZayaForCausalLM`` with configs/zaya1-base.toml's [model] (the full 262,272-entry vocabulary and tied head),
fp32 master weights, one step as the trainer does it: forward with labels under bf16 autocast, backward, clip the
gradient norm to 1, Muon + AdamW (``zaya.optim.build.split_parameters`` / ``build_optimizers`` with the default
``[optim]``), zero the gradients, the routers' bias-balancing update. ``model_step`` has 4 layers (the head is 85 %
of its FLOPs); ``model_step_deep`` the most layers up to 24 (where the head falls under half) whose step fits the
GPU by zaya's own memory plan (``zaya.tune.plan.memory_plan``, micro-batch 1), fewer on an out-of-memory error.

Routing on random tokens collapses within a few steps (benchmarks/train_step.py), so, as there, the weights, buffers
and optimizer state are snapshotted after the first step (in host memory, so that the snapshot takes no GPU memory)
and copied back in place before every later step, outside the timed region: every timed step is a "second step".
The routers' balancing state (biases and their moments) in the snapshot is the one from before the first step: at
init the router probabilities of a token differ by less than one balancing update, so after one update the biases
alone would route most tokens of a layer to one expert. The expert load of the first and of every timed step is
reported.

Timed: after the first step and one warm-up step, ``steps`` steps, each synchronised before and after; the phases
(forward + backward, clip, optimizers, balancing) from CUDA events. MFU = 3 x forward matmul FLOPs per token
(``zaya.model.info.forward_flops_per_token`` at context seq_len / 2, summed) x tokens/s / the device's dense bf16 peak
(``zaya.core.hardware.device_peak_flops``). ``model_step``'s micro-batch starts at 4 sequences of 4,096 tokens and
halves on an out-of-memory error.

Then the same model compiled as ``train.compile`` compiles it (``zaya.train.compile.CompiledBlocks``: each block
under ``torch.compile``, the eager fallback on a failed compile): its first step (compilation) is timed apart, and
the timed steps start from the same snapshot with the same batches, so each compiled loss is compared with the
eager loss of the same step. The smoke mode compiles with the "aot_eager" backend (dynamo and AOTAutograd trace the
same graphs; inductor's C++ code generation would take minutes on a few CPU cores).
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import math
import time
from typing import Any

from gpu_common import ROOT, Ctx, Marks, median, rnd, say
from gpu_predict import add_step_prediction, step_trace

TARGET_MFU = 0.35
DEEP_MAX_LAYERS = 24  # ZAYA1-base: 0.046 GFLOP of forward matmuls per token and layer, 1.07 in the head
LOSS_TOLERANCE = {"bfloat16": 1e-2, "float32": 1e-4}
"""Compiled against eager loss, relative: fusion reorders bf16 roundings (2^-8 relative each) inside every block,
and a loss averages many of them; fp32 (the smoke mode) differs only in summation order."""
SHAPE_KEYS = ("check", "device", "level", "config", "seq_len", "vocab_size", "target_mfu", "oom_at")


def _build_optimizers(split, ocfg):
    from zaya.optim.build import build_optimizers

    if "replica_group" in inspect.signature(build_optimizers).parameters:
        return build_optimizers(split, ocfg, replica_group=None)
    return build_optimizers(split, ocfg)


def base_config(ctx: Ctx):
    """configs/zaya1-base.toml's [model]; in the smoke mode shrunk to a CPU-sized width."""
    from zaya.config import load_config

    cfg = load_config(ROOT / "configs" / "zaya1-base.toml").model
    if ctx.level == "smoke":
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=128, num_query_heads=4, num_kv_heads=2,
                                  head_dim=32, num_experts=4, expert_hidden_size=128, router_hidden_size=32)
    return cfg


def check_model_step(ctx: Ctx, r: dict[str, Any]) -> None:
    first = ctx.micro_batch or ctx.pick(4, 2, 2)
    layers = ctx.pick(4, 2, 2)
    batches = list(dict.fromkeys([b for b in (first, first // 2, first // 4, first // 8) if b >= 1] + [1]))
    _backoff(ctx, r, [(b, layers) for b in batches])


def check_model_step_deep(ctx: Ctx, r: dict[str, Any]) -> None:
    """The deepest model up to ``DEEP_MAX_LAYERS`` whose step fits by zaya's memory plan, at micro-batch 1."""
    from zaya.config import load_config
    from zaya.tune.plan import memory_plan

    seq = ctx.pick(4096, 4096, 64)
    if ctx.cuda:
        budget = 0.85 * ctx.torch.cuda.get_device_properties(ctx.device).total_memory
    else:
        budget = 4 * 2**30  # the smoke mode: a nominal 4 GiB
    config = load_config(ROOT / "configs" / "zaya1-base.toml")
    config = dataclasses.replace(config, model=base_config(ctx))
    fits = []
    for layers in ctx.pick((24, 20, 16, 12, 8), (12, 8), (4,)):
        plan = memory_plan(dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=layers)),
                           gpus=1, parallel="ddp", micro_batch=1, seq_len=seq)
        say(f"model_step_deep: {layers} layers: planned peak {plan['peak'] / 2**30:.1f} GiB "
            f"(budget {budget / 2**30:.1f} GiB)")
        if plan["peak"] <= budget or not fits and layers == ctx.pick(8, 8, 4):
            fits.append(layers)
            r.update(planned_peak_gib=rnd(plan["peak"] / 2**30), plan_budget_gib=rnd(budget / 2**30))
            break
    smaller = [n for n in (fits[0] * 3 // 4, fits[0] // 2) if n >= 2]
    _backoff(ctx, r, [(1, n) for n in fits + smaller], seq=seq)


def _backoff(ctx: Ctx, r: dict[str, Any], tries: list[tuple[int, int]], seq: int | None = None) -> None:
    """Run the step at each (micro-batch, layers) of ``tries`` until one fits in memory."""
    torch = ctx.torch
    seq = seq or ctx.pick(4096, 4096, 64)
    base = base_config(ctx)
    r.update(config="configs/zaya1-base.toml [model]", seq_len=seq, vocab_size=base.vocab_size,
             target_mfu=TARGET_MFU)
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    for batch, layers in tries:
        try:
            _run(ctx, dataclasses.replace(base, num_layers=layers), batch, seq, r)
            return
        except oom as exc:
            say(f"out of memory at micro-batch {batch}, {layers} layers: {str(exc)[:200]}")
        r.setdefault("oom_at", []).append({"micro_batch": batch, "layers": layers})
        for key in [k for k in r if k not in SHAPE_KEYS]:
            del r[key]
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()
    raise RuntimeError(f"out of memory at every (micro-batch, layers) tried ({tries})")


def _run(ctx: Ctx, cfg, batch: int, seq: int, r: dict[str, Any]) -> None:
    torch = ctx.torch
    from zaya.config import OptimConfig
    from zaya.core.device import autocast
    from zaya.core.hardware import device_peak_flops
    from zaya.model import ZayaForCausalLM, update_balancing_biases
    from zaya.model.info import forward_flops_per_token
    from zaya.optim.build import split_parameters
    from zaya.train.metrics import expert_load_stats

    dev = ctx.device
    steps = ctx.pick(10, 4, 2)
    r.update(layers=cfg.num_layers, micro_batch=batch, tokens_per_step=batch * seq, timed_steps=steps,
             dtype=ctx.train_dtype)
    say(f"model_step: {cfg.num_layers} layers, micro-batch {batch} x {seq}")
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(dev):
        model = ZayaForCausalLM(cfg)
    model.train()
    ocfg = OptimConfig() if ctx.level != "smoke" else OptimConfig(muon_ns_dtype="float32")
    split = split_parameters(model, ocfg.muon)
    optimizers = _build_optimizers(split, ocfg)
    params = [p for p in model.parameters() if p.requires_grad]
    r["params"] = sum(p.numel() for p in params)
    r["muon_params"] = sum(p.numel() for _, p in split.muon)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(3, cfg.vocab_size, (batch, seq), generator=g)
        labels = torch.cat((ids[:, 1:], torch.full((batch, 1), -100)), dim=1)
        batches.append((ids.to(dev), labels.to(dev)))
    ctx.sync()
    r["build_s"] = rnd(time.perf_counter() - t0)

    def step(i: int):
        ids, labels = batches[i % len(batches)]
        marks = Marks(ctx)
        marks.mark("start")
        with autocast(dev, ctx.train_dtype):
            out = model(ids, labels=labels)
        out.loss.backward()
        marks.mark("fwd_bwd")
        norm = torch.nn.utils.clip_grad_norm_(params, ocfg.grad_clip)
        marks.mark("clip")
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        marks.mark("optimizer")
        counts = out.tokens_per_expert.detach()
        update_balancing_biases(model, counts)
        marks.mark("balance")
        return marks, out.loss.detach(), norm.detach(), counts

    # The routers' balancing state before any step: at init the router probabilities differ by less than one
    # balancing update (lr 1e-3), so the biases after a step decide the routing and send most tokens of a layer to
    # one expert; every timed step starts from the initial balancing state instead.
    balancing = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items() if ".balanc" in k}
    t0 = time.perf_counter()
    _, loss0, _, counts0 = step(0)  # also creates the optimizers' state
    ctx.sync()
    r["first_step_s"] = rnd(time.perf_counter() - t0)

    def host_copy(t):
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=ctx.cuda)
        return out.copy_(t)

    with torch.no_grad():
        weights = {k: balancing[k] if k in balancing else host_copy(v) for k, v in model.state_dict().items()}
        states = [{p: {k: host_copy(v) for k, v in st.items() if torch.is_tensor(v)} for p, st in opt.state.items()}
                  for opt in optimizers]

    @torch.no_grad()
    def restore() -> None:
        for k, v in model.state_dict().items():
            v.copy_(weights[k], non_blocking=True)
        for opt, saved in zip(optimizers, states):
            for p, st in opt.state.items():
                for k, v in saved.get(p, {}).items():
                    st[k].copy_(v, non_blocking=True)
        ctx.sync()

    def timed(run_step) -> tuple[list[float], list[dict[str, float]], list, list, list]:
        walls, phases, losses, norms, counts = [], [], [], [], []
        for i in range(steps):
            restore()
            t0 = time.perf_counter()
            marks, loss, norm, c = run_step(2 + i)
            ctx.sync()
            walls.append(1000 * (time.perf_counter() - t0))
            phases.append(marks.intervals())
            losses.append(float(loss))
            norms.append(float(norm))
            counts.append(c)
        return walls, phases, losses, norms, counts

    restore()
    step(1)  # warm-up from the snapshot (allocator, kernels' first calls)
    walls, phases, losses_f, norms_f, counts = timed(step)
    step_ms = median(walls)
    r["step_ms"] = rnd(step_ms)
    r["step_ms_all"] = [rnd(w, 3) for w in walls]
    for name in ("fwd_bwd", "clip", "optimizer", "balance"):
        r[f"{name}_ms"] = rnd(median([p[name] for p in phases]))
    tokens = batch * seq
    tok_s = tokens / (step_ms / 1000)
    breakdown = forward_flops_per_token(cfg, seq // 2)
    flops = 3 * sum(breakdown.values())
    # The smoke mode (CPU, fp32) names a nominal peak: measuring the CPU's bf16 peak is slow and means nothing there.
    peak, source = device_peak_flops(dev) if ctx.level != "smoke" else (1e11, "nominal (smoke mode)")
    r.update(tokens_per_s=rnd(tok_s), train_flops_per_token=flops,
             forward_flops_breakdown={k: v for k, v in breakdown.items()},
             lm_head_flops_share=rnd(breakdown.get("lm_head", 0.0) / sum(breakdown.values()), 3),
             peak_tflops=rnd(peak / 1e12), peak_source=source, mfu=rnd(flops * tok_s / peak),
             mfu_fwd_bwd=rnd(flops * tokens / (r["fwd_bwd_ms"] / 1000) / peak) if r["fwd_bwd_ms"] else None)
    r["target_met"] = r["mfu"] is not None and r["mfu"] >= TARGET_MFU
    r["first_loss"] = rnd(float(loss0))
    r["losses"] = [rnd(x) for x in losses_f]
    r["grad_norms"] = [rnd(x) for x in norms_f]
    loads = [expert_load_stats(c.tolist(), cfg.num_experts) for c in counts]
    per_layer = [max(col) for col in zip(*[x["expert_load_max_over_mean"] for x in loads])]
    first_load = expert_load_stats(counts0.tolist(), cfg.num_experts)
    r["expert_load_max_over_mean"] = per_layer  # per layer, the worst over the timed steps
    r["max_expert_load"] = rnd(max(per_layer))
    r["mean_expert_load_max_over_mean"] = rnd(sum(per_layer) / len(per_layer))
    r["first_step_expert_load_max_over_mean"] = first_load["expert_load_max_over_mean"]
    r["skip_fraction"] = [rnd(max(col)) for col in zip(*[x["skip_fraction"] for x in loads])]
    if ctx.cuda:
        r["peak_memory_gib"] = rnd(torch.cuda.max_memory_allocated(dev) / 2**30)
    finite = all(math.isfinite(x) for x in losses_f + norms_f + [float(loss0)])
    r["ok"] = finite
    if not finite:
        r["error"] = f"non-finite loss or gradient norm: losses {losses_f}, norms {norms_f}"
        return
    kernels = step_trace(ctx, cfg, batch, seq)
    add_step_prediction(ctx, r, kernels, False, r)
    r["compiled"] = compiled = {}
    _compiled(ctx, model, step, restore, timed, losses_f, flops * tokens / peak, compiled)
    if "step_ms" in compiled:
        r["compiled_speedup"] = rnd(step_ms / compiled["step_ms"], 3)
        add_step_prediction(ctx, r, kernels, True, compiled)
    r["ok"] = compiled.get("losses_match", False)
    if not r["ok"]:
        r["error"] = compiled.get("error") or "the compiled step's losses differ from the eager step's"


def _compiled(ctx: Ctx, model, step, restore, timed, eager_losses: list[float], flop_seconds: float,
              out: dict[str, Any]) -> None:
    """The same steps with the blocks compiled (``CompiledBlocks``), into ``out``."""
    import zaya.train.compile as compile_module

    if ctx.level == "smoke":
        compile_module.BACKEND = "aot_eager"
    out["backend"] = compile_module.BACKEND
    blocks = compile_module.CompiledBlocks(model, say)
    restore()
    t0 = time.perf_counter()
    blocks.run(lambda: step(1))  # compiles every block kind, forward and backward
    ctx.sync()
    out["first_step_s"] = rnd(time.perf_counter() - t0)
    restore()
    blocks.run(lambda: step(1))  # a warm-up, as the eager one had
    walls, phases, losses, _, _ = timed(lambda i: blocks.run(lambda: step(i)))
    out["compiled_in_use"] = blocks.active
    out["step_ms"] = rnd(median(walls))
    out["step_ms_all"] = [rnd(w, 3) for w in walls]
    out["fwd_bwd_ms"] = rnd(median([p["fwd_bwd"] for p in phases]))
    out["compile_s"] = rnd(out["first_step_s"] - out["step_ms"] / 1000)
    out["mfu"] = rnd(flop_seconds / (out["step_ms"] / 1000))
    out["losses"] = [rnd(x) for x in losses]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, eager_losses))
    tolerance = LOSS_TOLERANCE[ctx.train_dtype]
    out.update(loss_max_rel_diff=rnd(rel, 3), loss_tolerance=tolerance, losses_match=rel <= tolerance)
    if not blocks.active:
        out["error"] = "compiling the blocks failed: the steps ran eagerly (see the check's log)"
        out["losses_match"] = False
