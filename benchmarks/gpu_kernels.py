"""GPU suite checks of single components: flash attention eligibility of the training attention, the grouped_mm
expert path against the per-expert loop, Muon's Newton-Schulz methods ("standard" against "gram"), and the Triton
kernels (the fused norms, Newton-Schulz's symmetric products) against their torch paths.

Run through ``benchmarks/gpu_checks.py CHECK`` (or the suite, ``benchmarks/gpu_suite.sh``); docs/gpu.md lists the
keys each check reports.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from contextlib import nullcontext
from typing import Any

from gpu_common import ROOT, Ctx, cpu_bf16_gflops, json_lines, median, rnd, run_command, say, tail, time_calls


def _rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _max_err(a, b) -> float:
    """max |a - b| over max |b|."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _base_model_config(ctx: Ctx):
    """configs/zaya1-base.toml's [model]."""
    from zaya.config import load_config

    return load_config(ROOT / "configs" / "zaya1-base.toml").model


# ------------------------------------------------------------------------------------------------ flash attention
def check_flash_attention(ctx: Ctx, r: dict[str, Any]) -> None:
    """zaya's Attention (CCA) at the ZAYA1-base shape, forward + backward under bf16 autocast inside
    sdpa_kernel([FLASH_ATTENTION]), with the arguments SDPA receives recorded."""
    torch = ctx.torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from zaya.model.attention import Attention
    from zaya.model.layers import RotaryEmbedding

    cfg = _base_model_config(ctx)
    if ctx.level == "smoke":
        cfg = dataclasses.replace(cfg, hidden_size=256, num_query_heads=4, num_kv_heads=2, head_dim=64)
    b, t = ctx.pick((2, 4096), (1, 2048), (1, 64))
    dev = ctx.device
    r.update(shape={"batch": b, "seq": t, "hidden": cfg.hidden_size, "query_heads": cfg.num_query_heads,
                    "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "attention": cfg.attention})
    torch.manual_seed(0)
    with torch.device(dev):
        attn = Attention(cfg)
        rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
    attn.reset_parameters(cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers))
    cos, sin = rope.cos_sin(torch.arange(t, device=dev)[None])

    calls: list[dict[str, Any]] = []
    original = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        mask = kwargs.get("attn_mask", args[0] if args else None)
        out = original(q, k, v, *args, **kwargs)
        calls.append({"q": _dt(q), "k": _dt(k), "v": _dt(v), "out": _dt(out),
                      "enable_gqa": bool(kwargs.get("enable_gqa", False)), "is_causal": kwargs.get("is_causal"),
                      "attn_mask": mask is not None, "q_shape": list(q.shape), "k_shape": list(k.shape)})
        return out

    def fwd_bwd(x, flash: bool):
        attn.zero_grad(set_to_none=True)
        x.grad = None
        with (sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if flash else nullcontext()), \
                torch.autocast(dev.type, dtype=torch.bfloat16):
            out = attn(x, cos, sin)
            out.float().square().mean().backward()
        return out

    variants = {}
    r["variants"] = variants
    F.scaled_dot_product_attention = spy
    try:
        # bf16_input: what the issue asks; fp32_input: what a Block passes (the fp32 residual stream's RMSNorm).
        for name, dtype in (("bf16_input", torch.bfloat16), ("fp32_input", torch.float32)):
            x = torch.randn(b, t, cfg.hidden_size, device=dev, dtype=dtype, requires_grad=True)
            calls.clear()
            v: dict[str, Any] = {}
            variants[name] = v
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    out = fwd_bwd(x, flash=True)
                    ctx.sync()
                    v["eligible"] = True
                    v["out_dtype"] = _dt(out)
                    v["grads_finite"] = bool(torch.isfinite(x.grad).all()) and all(
                        bool(torch.isfinite(p.grad).all()) for p in attn.parameters() if p.grad is not None)
                except RuntimeError as exc:
                    v["eligible"] = False
                    v["error"] = str(exc)[:600]
            v["sdpa_calls"] = calls[:2]
            reasons = [str(w.message)[:300] for w in caught]
            if reasons:
                v["warnings"] = list(dict.fromkeys(reasons))[:8]
        # Timings (the flash kernel, when eligible, against the default backend choice), bf16 input.
        x = torch.randn(b, t, cfg.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True)
        repeats = ctx.pick(5, 3, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r["default_fwd_bwd_ms"] = rnd(median(time_calls(lambda: fwd_bwd(x, False), ctx, repeats)))
            if variants["bf16_input"]["eligible"]:
                r["flash_fwd_bwd_ms"] = rnd(median(time_calls(lambda: fwd_bwd(x, True), ctx, repeats)))
    finally:
        F.scaled_dot_product_attention = original
    if not ctx.cuda:
        r["note"] = "CPU: torch's CPU flash kernel (zaya passes enable_gqa there), not a GPU's"
    first = variants["bf16_input"]
    r["eligible"] = first["eligible"]
    r["eligible_fp32_input"] = variants["fp32_input"]["eligible"]
    if first.get("sdpa_calls"):
        c = first["sdpa_calls"][0]
        r["sdpa_dtypes"] = {"q": c["q"], "k": c["k"], "v": c["v"], "out": c["out"]}
        r["enable_gqa"] = c["enable_gqa"]
        r["kv_heads_at_sdpa"] = c["k_shape"][1]
    r["ok"] = bool(first["eligible"] and variants["fp32_input"]["eligible"]
                   and first.get("grads_finite") and variants["fp32_input"].get("grads_finite"))
    if not r["ok"]:
        errs = [f"{n}: {v.get('error') or ('non-finite gradients' if v['eligible'] else 'not eligible')}"
                for n, v in variants.items() if not (v["eligible"] and v.get("grads_finite"))]
        r["error"] = "; ".join(errs)[:1200]


def _dt(t) -> str:
    return str(t.dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------------------ grouped_mm vs loop
def check_grouped_mm_vs_loop(ctx: Ctx, r: dict[str, Any]) -> None:
    """zaya.model.moe.Experts with moe_impl "grouped_mm" against "loop": outputs, every gradient, the empty
    expert's weight gradients, the skipped tokens' input gradients, and the forward + backward time of each."""
    torch = ctx.torch
    from zaya.config import ModelConfig
    from zaya.model.moe import Experts, grouped_mm_supported

    n, d, inner, e = ctx.pick((8192, 2048, 1024, 16), (4096, 2048, 1024, 16), (256, 64, 64, 4))
    dev = ctx.device
    empty = e - 1
    r.update(tokens=n, hidden=d, expert_hidden=inner, experts=e, top_k=1, empty_expert=empty)
    supported = grouped_mm_supported(dev, torch.bfloat16)
    r["grouped_mm_supported"] = supported

    g = torch.Generator().manual_seed(0)
    classes = torch.randint(0, e - 1, (n, 1), generator=g)  # never the last expert: it gets no tokens
    skip = torch.rand(n, generator=g) < 0.1
    classes[skip, 0] = e  # the skip class
    weights = (torch.rand(n, 1, generator=g) * 0.9 + 0.1).masked_fill(classes >= e, 0.0)
    x0 = torch.randn(n, d, generator=g)
    grad_out = torch.randn(n, d, generator=g)
    gate_up = torch.randn(e, 2 * inner, d, generator=g) * d ** -0.5
    down = torch.randn(e, d, inner, generator=g) * inner ** -0.5
    classes, skip, weights, x0, grad_out = (t.to(dev) for t in (classes, skip, weights, x0, grad_out))
    r["skipped_tokens"] = int(skip.sum())

    def build(impl: str, dtype):
        cfg = ModelConfig(vocab_size=256, hidden_size=d, num_layers=2, num_experts=e, top_k=1,
                          expert_hidden_size=inner, moe_impl=impl)
        m = Experts(cfg)
        with torch.no_grad():
            m.gate_up_proj.copy_(gate_up)
            m.down_proj.copy_(down)
        return m.to(device=dev, dtype=dtype)

    def run(module, dtype, autocast: bool):
        module.zero_grad(set_to_none=True)
        x = x0.to(dtype, copy=True).requires_grad_(True)
        w = weights.clone().requires_grad_(True)  # fp32, as the router's probabilities
        with torch.autocast(dev.type, dtype=torch.bfloat16) if autocast else nullcontext():
            out = module(x, classes, w)
        out.backward(grad_out.to(out.dtype))
        return out.detach(), {"x": x.grad, "weights": w.grad, "gate_up_proj": module.gate_up_proj.grad,
                              "down_proj": module.down_proj.grad}

    repeats = ctx.pick(10, 5, 2)
    variants: dict[str, Any] = {}
    r["variants"] = variants
    # bf16: bf16 weights and inputs (the case); autocast: fp32 weights under bf16 autocast (the trainer's).
    for name, dtype, autocast in (("bf16", torch.bfloat16, False), ("autocast", torch.float32, True)):
        v: dict[str, Any] = {}
        variants[name] = v
        loop = build("loop", dtype)
        out_l, grads_l = run(loop, dtype, autocast)
        v["loop_empty_expert_grad_zero"] = _rows_zero(grads_l, empty)
        v["loop_ms"] = rnd(median(time_calls(lambda: run(loop, dtype, autocast), ctx, repeats, warmup=1)))
        if not supported:
            continue
        gmm = build("grouped_mm", dtype)
        try:  # which path the module takes (a private helper: reported only when it is there)
            v["grouped_mm_path_taken"] = bool(gmm._use_grouped_mm(x0, torch.bfloat16))
        except Exception:  # noqa: BLE001
            pass
        out_g, grads_g = run(gmm, dtype, autocast)
        errs = {"out": _rel_err(out_g, out_l)}
        errs.update({k: _rel_err(grads_g[k], grads_l[k]) for k in grads_l})
        v["rel_err"] = {k: rnd(x, 3) for k, x in errs.items()}
        v["max_abs_err_over_max"] = {k: rnd(_max_err(a, b), 3) for k, a, b in
                                     [("out", out_g, out_l)] + [(k, grads_g[k], grads_l[k]) for k in grads_l]}
        v["max_rel_err"] = rnd(max(errs.values()), 3)
        v["empty_expert_grad_zero"] = _rows_zero(grads_g, empty)
        v["skipped_tokens_grad_zero"] = bool((grads_g["x"][skip] == 0).all()) if bool(skip.any()) else None
        v["outputs_finite"] = bool(torch.isfinite(out_g).all()) and all(bool(torch.isfinite(t).all())
                                                                        for t in grads_g.values())
        v["grouped_mm_ms"] = rnd(median(time_calls(lambda: run(gmm, dtype, autocast), ctx, repeats, warmup=1)))
        v["speedup"] = rnd(v["loop_ms"] / v["grouped_mm_ms"], 3) if v["grouped_mm_ms"] else None
        del gmm
        del loop
    main = variants["bf16"]
    if not supported:
        r["skipped"] = f"zaya.model.moe.grouped_mm_supported({dev}, bfloat16) is False: only the loop was timed"
        r.update(loop_ms=main["loop_ms"])
        return
    tol = 1e-2
    r.update(max_rel_err=main["max_rel_err"], max_rel_err_autocast=variants["autocast"]["max_rel_err"],
             empty_expert_grad_zero=main["empty_expert_grad_zero"] and variants["autocast"]["empty_expert_grad_zero"],
             grouped_mm_ms=main["grouped_mm_ms"], loop_ms=main["loop_ms"], speedup=main["speedup"], tolerance=tol)
    problems = []
    for name, v in variants.items():
        if not v["max_rel_err"] <= tol:
            problems.append(f"{name}: max relative error {v['max_rel_err']} > {tol} ({v['rel_err']})")
        if not (v["empty_expert_grad_zero"] and v["loop_empty_expert_grad_zero"]):
            problems.append(f"{name}: the empty expert's weight gradients are not exactly zero")
        if v["skipped_tokens_grad_zero"] is False:
            problems.append(f"{name}: skipped tokens got a non-zero input gradient")
        if not v["outputs_finite"]:
            problems.append(f"{name}: non-finite output or gradient")
    r["ok"] = not problems
    if problems:
        r["error"] = "; ".join(problems)[:1500]


def _rows_zero(grads: dict[str, Any], expert: int) -> bool:
    return all(bool((grads[k][expert] == 0).all()) for k in ("gate_up_proj", "down_proj"))


# ------------------------------------------------------------------------------------------------ Muon
_MUON_KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")


def _muon_shapes(ctx: Ctx) -> list[tuple[int, ...]]:
    """One ZAYA1-base layer's Muon matrices (zaya's split): experts gate_up [E, 4096, 2048] and down [E, 2048,
    2048], attention q 1024x2048, k 256x2048, v (two halves) 128x2048, o 2048x1024, router down 256x2048, fc1 and
    fc2 256x256, out 17x256. Smoke: every dimension / 16, 2 experts."""
    e, s = ctx.pick(16, 16, 2), ctx.pick(1, 1, 16)
    big = [(e, 4096, 2048), (e, 2048, 2048), (1024, 2048), (256, 2048), (128, 2048), (128, 2048), (2048, 1024),
           (256, 2048), (256, 256), (256, 256)]
    shapes = [tuple(x if (len(sh) == 3 and i == 0) else max(1, x // s) for i, x in enumerate(sh)) for sh in big]
    return shapes + [(17, max(1, 256 // s))]


def _muon_set(ctx: Ctx, shapes, seed: int = 0):
    torch = ctx.torch
    g = torch.Generator().manual_seed(seed)
    init = [(torch.randn(s, generator=g) * 0.02).to(ctx.device) for s in shapes]
    grads = [torch.randn(s, generator=g).to(ctx.device) for s in shapes]
    return init, grads


def _muon_run(ctx: Ctx, init, grads, method: str, repeats: int) -> tuple[list[float], list, Any]:
    """(step ms after warm-up, parameter change of the first step, optimizer) for ns_method=``method``."""
    torch = ctx.torch
    from zaya.optim import Muon

    params = [torch.nn.Parameter(t.clone()) for t in init]
    for p, gr in zip(params, grads):
        p.grad = gr.clone()
    opt = Muon(params, **_MUON_KW, ns_method=method)
    opt.step()
    ctx.sync()
    delta = [p.detach() - t for p, t in zip(params, init)]
    times = time_calls(opt.step, ctx, repeats, warmup=1)
    return times, delta, opt


def check_muon(ctx: Ctx, r: dict[str, Any]) -> None:
    """zaya.optim.Muon with ns_method "standard", "gram" and "auto" on one ZAYA1-base layer's matrices (and per
    shape), plus benchmarks/muon.py (zaya's Muon against torch.optim.Muon) on the device."""
    repeats = ctx.pick(5, 3, 2)
    shapes = _muon_shapes(ctx)
    r.update(shapes=[list(s) for s in shapes], repeats=repeats, ns_dtype="bfloat16")
    init, grads = _muon_set(ctx, shapes)
    deltas = {}
    fallbacks = {}
    for method in ("standard", "gram", "auto"):
        say(f"Muon ns_method={method}: one layer's matrices")
        times, delta, opt = _muon_run(ctx, init, grads, method, repeats)
        r[f"{method}_ms"] = rnd(median(times))
        deltas[method] = delta
        fallbacks[method] = getattr(opt, "gram_fallbacks", None)
        del opt
    r["gram_fallbacks"] = fallbacks["gram"]
    r["faster"] = "gram" if r["gram_ms"] < r["standard_ms"] else "standard"
    r["gram_speedup"] = rnd(r["standard_ms"] / r["gram_ms"], 3)
    diffs = []
    for a, b in zip(deltas["gram"], deltas["standard"]):
        pairs = zip(a.unbind(0), b.unbind(0)) if a.ndim == 3 else [(a, b)]
        diffs += [_rel_err(x, y) for x, y in pairs]
    r["update_rel_diff_gram_vs_standard"] = {"max": rnd(max(diffs), 3), "median": rnd(median(diffs), 3)}
    del deltas
    per_shape = {}
    r["per_shape"] = per_shape
    for shape in dict.fromkeys(shapes):
        key = "x".join(map(str, shape))
        one_init, one_grad = _muon_set(ctx, [shape], seed=1)
        row: dict[str, Any] = {}
        std, _, _ = _muon_run(ctx, one_init, one_grad, "standard", repeats)
        row["standard_ms"] = rnd(median(std))
        if shape[-1] == shape[-2]:
            row["gram_ms"] = None  # square: the Gram iteration does not apply (every method runs the standard one)
        else:
            gram, _, _ = _muon_run(ctx, one_init, one_grad, "gram", repeats)
            row["gram_ms"] = rnd(median(gram))
            row["faster"] = "gram" if row["gram_ms"] < row["standard_ms"] else "standard"
        per_shape[key] = row
    tol = 0.1
    own_ok = r["update_rel_diff_gram_vs_standard"]["max"] <= tol
    problems = [] if own_ok else [f"gram and standard updates differ by {r['update_rel_diff_gram_vs_standard']} "
                                  f"(relative, > {tol})"]

    # The script: zaya's Muon against torch.optim.Muon (its own ns_method flag, when it has one).
    script = ROOT / "benchmarks" / "muon.py"
    has_ns = '"--ns-method"' in script.read_text()
    args = ["--device", ctx.device_arg, "--no-world2"] + (["--quick"] if ctx.level != "full" else [])
    runs = [("default", [])] + ([("standard", ["--ns-method", "standard"]), ("gram", ["--ns-method", "gram"])]
                                if has_ns else [])
    r["script_has_ns_method"] = has_ns
    r["script"] = {}
    if not ctx.cuda and cpu_bf16_gflops(ctx) < 20:
        runs = []
        r["script"]["skipped"] = ("this CPU has no fast bf16 matmul: benchmarks/muon.py's bf16 Newton-Schulz on "
                                  "4096x2048 matrices would not finish in the smoke run")
    for name, extra in runs:
        budget = ctx.remaining() - 10
        if budget < 15:
            r["script"][name] = {"skipped": f"no time left ({ctx.remaining():.0f} s of the budget)"}
            continue
        res = run_command([sys.executable, str(script), *args, *extra], budget, prefix=f"[muon.py {name}] ")
        lines = json_lines(res["stdout"])
        entry: dict[str, Any] = {"rc": res["rc"]}
        if lines:
            entry.update({k: lines[-1].get(k) for k in ("ours_s", "torch_s", "speedup", "speedup_paired",
                                                        "max_rel_diff", "median_rel_diff", "gram_fallbacks")})
        else:
            entry["error"] = tail(res["stderr"] or res["stdout"], 600)
        if res["rc"] != 0 or not lines:
            problems.append(f"benchmarks/muon.py {' '.join(extra) or '(default)'} failed (rc {res['rc']})")
        r["script"][name] = entry
    r["ok"] = not problems
    if problems:
        r["error"] = "; ".join(problems)


# ------------------------------------------------------------------------------------------------ fused kernels
_FUSED_GRADS = ("d_branch", "d_residual", "d_branch_bias", "d_branch_scale", "d_residual_bias", "d_residual_scale",
                "d_weight")


def check_fused_norm(ctx: Ctx, r: dict[str, Any]) -> None:
    """zaya.model.fused_norm's three functions (``residual_norm``: a block's attention join + MoE norm;
    ``join_residual``: the MoE's join; ``rms_norm``: the attention and final norms) with the Triton kernels against
    their torch paths (``zaya.core.kernels.ENABLED`` off): outputs and every gradient, forward + backward and
    forward-only times, at ZAYA1-base's width, for the trainer's dtypes (bf16 autocast over fp32 weights: bf16
    branch, fp32 residual) and bf16 weights."""
    torch = ctx.torch
    from zaya.core import kernels
    from zaya.model import fused_norm
    from zaya.model.layers import ResidualScale, RMSNorm

    if not ctx.cuda:
        r["skipped"] = ("the kernels compile for GPUs only; on the CPU tests/test_triton_kernels.py checks them under "
                        "Triton's interpreter")
        return
    if fused_norm._kernels() is None:
        r["skipped"] = "triton does not import in this Python: zaya.model.fused_norm takes the torch path"
        return
    n, d = ctx.pick((16384, 2048), (8192, 2048), (256, 64))
    dev = ctx.device
    repeats = ctx.pick(20, 10, 2)
    r.update(tokens=n, hidden=d, repeats=repeats)
    variants: dict[str, Any] = {}
    r["variants"] = variants
    problems = []
    tol = 2.0 ** -6  # as tests/test_triton_kernels.py: bf16 values rounded once against after each operation
    for name, (b_dt, r_dt, p_dt) in {"autocast": (torch.bfloat16, torch.float32, torch.float32),
                                     "bf16_weights": (torch.bfloat16, torch.float32, torch.bfloat16)}.items():
        g = torch.Generator().manual_seed(0)
        scale, norm = ResidualScale(d), RMSNorm(d)
        with torch.no_grad():
            for p in list(scale.parameters()) + list(norm.parameters()):
                p.add_(torch.randn(d, generator=g) * 0.3)
        scale, norm = scale.to(dev, p_dt), norm.to(dev, p_dt)
        params = [scale.branch_bias, scale.branch_scale, scale.residual_bias, scale.residual_scale, norm.weight]
        branch = torch.randn(n, d, generator=g).to(dev, b_dt)
        residual = (torch.randn(n, d, generator=g) * 3).to(dev, r_dt)
        grad_res = torch.randn(n, d, generator=g).to(dev, r_dt)
        grad_h = torch.randn(n, d, generator=g).to(dev, p_dt)
        calls = {"residual_norm": (lambda a, x: fused_norm.residual_norm(scale, a, x, norm, r_dt), (grad_res, grad_h)),
                 "join_residual": (lambda a, x: (fused_norm.join_residual(scale, a, x, r_dt),), (grad_res,)),
                 "rms_norm": (lambda a, x: (fused_norm.rms_norm(norm, x.to(p_dt)),), (grad_h,))}

        def run(kind: str, fused: bool, backward: bool = True):
            fn, grads = calls[kind]
            kernels.ENABLED = fused
            for p in params:
                p.grad = None
            a, x = branch.detach().requires_grad_(backward), residual.detach().requires_grad_(backward)
            outs = fn(a, x)
            if not backward:
                return list(outs)
            torch.autograd.backward(outs, grads)
            return list(outs) + [a.grad, x.grad] + [p.grad for p in params]

        per_kind: dict[str, Any] = {}
        variants[name] = per_kind
        for kind in calls:
            v: dict[str, Any] = {}
            per_kind[kind] = v
            try:
                got, want = run(kind, True), run(kind, False)
                names = {"residual_norm": ["res", "h"], "join_residual": ["res"], "rms_norm": ["h"]}[kind]
                names += list(_FUSED_GRADS)
                v["max_err"] = {k: rnd(_max_err(a, b), 3) for k, a, b in zip(names, got, want) if b is not None}
                v["finite"] = all(bool(torch.isfinite(t).all()) for t in got if t is not None)
                del got, want
                v["fused_ms"] = rnd(median(time_calls(lambda: run(kind, True), ctx, repeats)))
                v["torch_ms"] = rnd(median(time_calls(lambda: run(kind, False), ctx, repeats)))
                v["speedup"] = rnd(v["torch_ms"] / v["fused_ms"], 3)
                v["fused_fwd_ms"] = rnd(median(time_calls(lambda: run(kind, True, False), ctx, repeats)))
                v["torch_fwd_ms"] = rnd(median(time_calls(lambda: run(kind, False, False), ctx, repeats)))
                v["speedup_fwd"] = rnd(v["torch_fwd_ms"] / v["fused_fwd_ms"], 3)
            finally:
                kernels.ENABLED = True
            worst = max(v["max_err"].values())
            if not (worst <= tol and v["finite"]):
                problems.append(f"{name} {kind}: largest max |fused - torch| / max |torch| {worst} > {tol} "
                                "or not finite")
    r["speedup"] = {kind: v["speedup"] for kind, v in variants["autocast"].items()}
    r["speedup_fwd"] = {kind: v["speedup_fwd"] for kind, v in variants["autocast"].items()}
    r["target_met"] = all(v["speedup"] >= 1 and v["speedup_fwd"] >= 1 for per_kind in variants.values()
                          for v in per_kind.values())
    r["tolerance"] = tol
    r["ok"] = not problems
    if problems:
        r["error"] = "; ".join(problems)


# ------------------------------------------------------------------------------------------------ Newton-Schulz kernel
def _ns_flop_share(ns, shapes, method: str) -> float:
    """FLOPs of 5-step NS over ``shapes`` with the kernel's tiles (``ns_flops`` with as many row blocks), over those
    with full GEMMs; square matrices run the standard iteration whatever the method."""
    kernel = full = 0.0
    for shape in shapes:
        m, n = sorted(shape[-2:])
        how, count = ("standard" if m == n else method), (shape[0] if len(shape) == 3 else 1)
        tiles = -(-m // ns._kernels().TILE)
        kernel += count * ns.ns_flops(m, n, 5, how, tiles)
        full += count * ns.ns_flops(m, n, 5, how, 1)
    return kernel / full


def check_ns_triton(ctx: Ctx, r: dict[str, Any]) -> None:
    """Muon's Newton-Schulz with the symmetric products in zaya.optim.newton_schulz_triton's kernel against torch's
    GEMMs (``zaya.core.kernels.ENABLED = False``): Muon's step over one ZAYA1-base layer's matrices per
    ``ns_method`` ("standard", "gram"), each NS result against an fp32 reference, and the two products alone
    (``X X^T`` and ``b A + c A A``) at the experts' stack."""
    torch = ctx.torch
    from zaya.core import kernels
    from zaya.optim import newton_schulz as ns

    if not ctx.cuda:
        r["skipped"] = ("the kernel compiles for GPUs only; on the CPU tests/test_triton_newton_schulz.py checks it "
                        "under Triton's interpreter")
        return
    if ns._kernels() is None:
        r["skipped"] = "triton does not import in this Python: Newton-Schulz takes torch's GEMMs"
        return
    if not ns.triton_products(ctx.device, torch.bfloat16, 2048):
        r["skipped"] = "the kernel takes no bf16 products on this GPU (NVIDIA before Ampere): torch's GEMMs run"
        return
    repeats = ctx.pick(5, 3, 2)
    shapes = _muon_shapes(ctx)
    r.update(shapes=[list(s) for s in shapes], repeats=repeats, ns_dtype="bfloat16", tile=ns._kernels().TILE)
    init, grads = _muon_set(ctx, shapes)

    def muon_ms(method: str, kernel: bool) -> float:
        kernels.ENABLED = kernel
        try:
            return rnd(median(_muon_run(ctx, init, grads, method, repeats)[0]))
        finally:
            kernels.ENABLED = True

    per_method: dict[str, Any] = {}
    r["methods"] = per_method
    for method in ("standard", "gram"):
        say(f"Newton-Schulz {method}: kernel, then torch's GEMMs")
        v = {"kernel_ms": muon_ms(method, True), "torch_ms": muon_ms(method, False)}
        v["speedup"] = rnd(v["torch_ms"] / v["kernel_ms"], 3)
        per_method[method] = v
    r["flop_share"] = {method: rnd(_ns_flop_share(ns, shapes, method), 3) for method in per_method}

    # Agreement: each shape's NS (Muon's batching) by both paths against torch's NS in fp32.
    worst: dict[str, Any] = {}
    r["agreement"] = worst
    problems = []
    for method in per_method:
        ratios, diffs = [], []
        for shape in dict.fromkeys(shapes):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(ctx.device)
            ref = ns.orthogonalize(x, dtype=torch.float32, method="reference")
            outs = {}
            for kernel in (True, False):
                kernels.ENABLED = kernel
                try:
                    outs[kernel] = ns.orthogonalize(x, method=method, batched=True)
                finally:
                    kernels.ENABLED = True
            errs = {k: _rel_err(o, ref) for k, o in outs.items()}
            ratios.append(errs[True] / max(errs[False], 1e-30))
            diffs.append(_rel_err(outs[True], outs[False]))
            if not bool(torch.isfinite(outs[True]).all()):
                problems.append(f"{method} {shape}: non-finite result")
        worst[method] = {"max_error_ratio": rnd(max(ratios), 3), "max_rel_diff": rnd(max(diffs), 3)}
    tol = 1.25
    for method, w in worst.items():
        if not w["max_error_ratio"] <= tol:
            problems.append(f"{method}: the kernel's error against fp32 is {w['max_error_ratio']}x torch's (> {tol})")

    # The products alone, at the experts' gate_up stack (16 x 2048 x 4096 after the transpose; --quick: the same).
    e, m, n = shapes[0][0], min(shapes[0][1:]), max(shapes[0][1:])
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(e, m, n, generator=g) / n ** 0.5).to(ctx.device, torch.bfloat16)
    a = x @ x.mT
    out = torch.empty_like(a)
    sym = ns._kernels().sym_matmul
    products = {"gram": (lambda: sym(out, x, x.mT), lambda: torch.bmm(x, x.mT, out=out)),
                "poly": (lambda: sym(out, a, a, a, -4.775, 2.0315),
                         lambda: torch.baddbmm(a, a, a, beta=-4.775, alpha=2.0315, out=out))}
    r["products"] = {}
    for name, (kernel_fn, torch_fn) in products.items():
        v = {"kernel_ms": rnd(median(time_calls(kernel_fn, ctx, 10 * repeats)), 4),
             "torch_ms": rnd(median(time_calls(torch_fn, ctx, 10 * repeats)), 4)}
        v["speedup"] = rnd(v["torch_ms"] / v["kernel_ms"], 3)
        kernel_out = kernel_fn().clone()
        v["max_err"] = rnd(_max_err(kernel_out, torch_fn()), 3)
        if not v["max_err"] <= 2.0 ** -7:  # bf16 results, each rounded once: one or two ulps apart
            problems.append(f"product {name}: max |kernel - torch| / max |torch| = {v['max_err']}")
        r["products"][name] = v
    r["product_shape"] = [e, m, n]
    r["speedup"] = {m: v["speedup"] for m, v in per_method.items()}
    r["target_met"] = all(v["speedup"] >= 1 for v in list(per_method.values()) + list(r["products"].values()))
    r["ok"] = not problems
    if problems:
        r["error"] = "; ".join(problems)

