"""GPU suite check ``model_step``: the full model's training step at the ZAYA1-base layer shape.

A ``ZayaForCausalLM`` with configs/zaya1-base.toml's [model] and a few layers (4; the full 262,272-entry
vocabulary and tied head), fp32 master weights, one step as the trainer does it: forward with labels under bf16
autocast, backward, clip the gradient norm to 1, Muon + AdamW (``zaya.optim.build.split_parameters`` /
``build_optimizers`` with the default ``[optim]``), zero the gradients, the routers' bias-balancing update.

Routing on random tokens collapses within a few steps (benchmarks/train_step.py), so, as there, the weights, buffers
and optimizer state are snapshotted after the first step and copied back in place before every later step, outside
the timed region: every timed step is a "second step". The routers' balancing state (biases and their moments) in
the snapshot is the one from before the first step: at init the router probabilities of a token differ by less
than one balancing update, so after one update the biases alone would route most tokens of a layer to one expert.
The expert load of the first and of every timed step is reported.

Timed: after the first step and one warm-up step, ``steps`` steps, each synchronised before and after; the phases
(forward + backward, clip, optimizers, balancing) from CUDA events. MFU = 3 x forward matmul FLOPs per token
(``zaya.model.info.forward_flops_per_token`` at context seq_len / 2, summed) x tokens/s / the device's dense bf16 peak
(``zaya.core.hardware.device_peak_flops``). The micro-batch starts at 4 sequences of 4,096 tokens and halves on an
out-of-memory error.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import math
import time
from typing import Any

from gpu_common import ROOT, Ctx, Marks, median, rnd, say

TARGET_MFU = 0.35


def _build_optimizers(split, ocfg):
    from zaya.optim.build import build_optimizers

    if "replica_group" in inspect.signature(build_optimizers).parameters:
        return build_optimizers(split, ocfg, replica_group=None)
    return build_optimizers(split, ocfg)


def check_model_step(ctx: Ctx, r: dict[str, Any]) -> None:
    torch = ctx.torch
    from zaya.config import load_config

    cfg = load_config(ROOT / "configs" / "zaya1-base.toml").model
    layers, seq = ctx.pick(4, 2, 2), ctx.pick(4096, 4096, 64)
    if ctx.level == "smoke":
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=128, num_query_heads=4, num_kv_heads=2,
                                  head_dim=32, num_experts=4, expert_hidden_size=128, router_hidden_size=32)
    cfg = dataclasses.replace(cfg, num_layers=layers)
    first = ctx.micro_batch or ctx.pick(4, 2, 2)
    candidates = [b for b in (first, first // 2, first // 4, first // 8) if b >= 1]
    candidates = list(dict.fromkeys(candidates + [1]))
    r.update(config="configs/zaya1-base.toml [model]", layers=layers, seq_len=seq, vocab_size=cfg.vocab_size,
             target_mfu=TARGET_MFU)
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    for batch in candidates:
        try:
            _run(ctx, cfg, batch, seq, r)
            break
        except oom as exc:
            say(f"out of memory at micro-batch {batch}: {str(exc)[:200]}")
        r.setdefault("oom_at_micro_batch", []).append(batch)
        for key in [k for k in r if k not in ("check", "device", "level", "config", "layers", "seq_len",
                                              "vocab_size", "target_mfu", "oom_at_micro_batch")]:
            del r[key]
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()
    else:
        raise RuntimeError(f"out of memory at every micro-batch tried ({candidates})")


def _run(ctx: Ctx, cfg, batch: int, seq: int, r: dict[str, Any]) -> None:
    torch = ctx.torch
    from zaya.config import OptimConfig
    from zaya.core.device import autocast
    from zaya.model import ZayaForCausalLM, update_balancing_biases
    from zaya.model.info import forward_flops_per_token
    from zaya.optim.build import split_parameters
    from zaya.core.hardware import device_peak_flops
    from zaya.train.metrics import expert_load_stats

    dev = ctx.device
    steps = ctx.pick(10, 4, 2)
    r.update(micro_batch=batch, tokens_per_step=batch * seq, timed_steps=steps, dtype=ctx.train_dtype)
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
    balancing = {k: v.detach().clone() for k, v in model.state_dict().items() if ".balanc" in k}
    t0 = time.perf_counter()
    _, loss0, _, counts0 = step(0)  # also creates the optimizers' state
    ctx.sync()
    r["first_step_s"] = rnd(time.perf_counter() - t0)
    with torch.no_grad():
        weights = {k: balancing.get(k, v).detach().clone() for k, v in model.state_dict().items()}
        states = [{p: {k: v.clone() for k, v in st.items() if torch.is_tensor(v)} for p, st in opt.state.items()}
                  for opt in optimizers]

    @torch.no_grad()
    def restore() -> None:
        for k, v in model.state_dict().items():
            v.copy_(weights[k])
        for opt, saved in zip(optimizers, states):
            for p, st in opt.state.items():
                for k, v in saved.get(p, {}).items():
                    st[k].copy_(v)

    restore()
    step(1)  # warm-up from the snapshot (allocator, kernels' first calls)
    walls, phases, losses, norms, counts = [], [], [], [], []
    for i in range(steps):
        restore()
        ctx.sync()
        t0 = time.perf_counter()
        marks, loss, norm, c = step(2 + i)
        ctx.sync()
        walls.append(1000 * (time.perf_counter() - t0))
        phases.append(marks.intervals())
        losses.append(loss)
        norms.append(norm)
        counts.append(c)
    losses_f = [float(x) for x in losses]
    norms_f = [float(x) for x in norms]
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
