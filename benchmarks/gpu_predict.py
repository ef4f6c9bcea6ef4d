"""The cost model's prediction (``zaya.tune.cost``) beside a GPU suite figure: the same shape, priced on the profile
of the device the suite runs on.

A GPU whose name holds H100, H200 or MI300X gets that profile (``zaya.tune.cost.DEVICES``); any other GPU gets no
prediction, and the line says so. The CPU smoke mode prices on this CPU's measured profile
(``zaya.tune.cost.measure_cpu``), in fp32 as the smoke mode trains, so the code path runs without a GPU. The
MoE-block and Newton-Schulz kernels are traced as ``benchmarks/cost_model.py`` traces them for its validation.
"""

from __future__ import annotations

from typing import Any

from gpu_common import ROOT, Ctx, rnd, say

PROFILES = (("MI300X", "mi300x"), ("H200", "h200"), ("H100", "h100"))


def device_profile(ctx: Ctx):
    """(the cost model's Device or None, what was chosen or why none): memoised on the context."""
    if not hasattr(ctx, "_cost_profile"):
        from zaya.tune.cost import DEVICES, measure_cpu

        if not ctx.cuda:
            ctx._cost_profile = (measure_cpu(), "this CPU, measured (smoke mode)")
        else:
            name = ctx.torch.cuda.get_device_name(ctx.device)
            key = next((k for label, k in PROFILES if label in name.upper().replace(" ", "")), None)
            ctx._cost_profile = ((DEVICES[key], key) if key else
                                 (None, f"no cost-model profile for {name} (profiles: H100, H200, MI300X)"))
    return ctx._cost_profile


def beside(measured_ms: float | None, predicted_s: float) -> dict[str, Any]:
    """``predicted_ms`` and ``prediction_error`` (predicted / measured - 1)."""
    out = {"predicted_ms": rnd(predicted_s * 1e3)}
    if measured_ms:
        out["prediction_error"] = rnd(predicted_s * 1e3 / measured_ms - 1, 3)
    return out


def _guarded(r: dict[str, Any], key: str, work) -> None:
    """Run ``work()`` (which fills ``r``); a failing prediction is reported under ``key``, never fails the check."""
    try:
        work()
    except Exception as exc:  # noqa: BLE001 - the measurement stands without its prediction
        r[key] = f"the prediction failed: {type(exc).__name__}: {exc}"[:600]
        say(r[key])


def step_trace(ctx: Ctx, cfg, batch: int, seq: int):
    """The kernels of one training step of ``cfg`` as the suite's ``model_step`` runs it, with the device's plans
    (the loss chunk of its profile); None when the device has no cost-model profile."""
    from zaya.core.hardware import load_profile
    from zaya.tune.kernel_trace import gpu_plans, trace_step

    device, _ = device_profile(ctx)
    if device is None:
        return None
    plans = gpu_plans(load_profile(ctx.device).loss_chunk_elements) if ctx.cuda else None
    return trace_step(cfg, batch, seq, dtype=ctx.train_dtype, plans=plans)


def add_step_prediction(ctx: Ctx, r: dict[str, Any], kernels, compiled: bool, out: dict[str, Any]) -> None:
    """Into ``out`` (``r`` or its ``compiled`` part): the predicted step and phases beside the measured ones."""
    device, why = device_profile(ctx)
    r["prediction_profile"] = why
    if device is None or kernels is None:
        return

    def work() -> None:
        from zaya.tune.cost import predict

        p = predict(kernels, device, compiled)
        out.update(beside(out.get("step_ms"), p.seconds))
        fwd_bwd = p.by_phase.get("forward", 0.0) + p.by_phase.get("backward", 0.0)
        out["predicted_fwd_bwd_ms"] = rnd(fwd_bwd * 1e3)
        out["predicted_optimizer_ms"] = rnd(p.by_phase.get("optimizer", 0.0) * 1e3)
        out["predicted_top_parts_ms"] = {k: rnd(v * 1e3) for k, v in p.top("by_part", 5)}

    _guarded(out, "prediction", work)


def add_moe_block_prediction(ctx: Ctx, r: dict[str, Any], shape: str, tokens: int, measured_ms: float | None) -> None:
    """The MoE block's forward + backward (``benchmarks/moe_block.py``'s ``ours_ms``) beside its prediction."""
    device, why = device_profile(ctx)
    r["prediction_profile"] = why
    if device is None:
        return

    def work() -> None:
        from cost_model import _moe_block_kernels

        from zaya.config import load_config
        from zaya.tune.cost import predict

        cfg = load_config(ROOT / "configs" / ("zaya1-base.toml" if shape == "base" else "tiny.toml")).model
        r.update(beside(measured_ms, predict(_moe_block_kernels(cfg, tokens), device).seconds))

    _guarded(r, "prediction", work)


def add_muon_prediction(ctx: Ctx, r: dict[str, Any]) -> None:
    """Each Newton-Schulz method's Muon step (``standard_ms``, ``gram_ms``) beside its prediction."""
    device, why = device_profile(ctx)
    r["prediction_profile"] = why
    if device is None or not r.get("shapes"):
        return

    def work() -> None:
        from cost_model import _muon_kernels

        from zaya.core.hardware import load_profile
        from zaya.tune.cost import predict
        from zaya.tune.kernel_trace import gpu_plans

        plans = gpu_plans(load_profile(ctx.device).loss_chunk_elements) if ctx.cuda else load_profile("cpu")
        shapes = [tuple(s) for s in r["shapes"]]
        for method in ("standard", "gram"):
            p = predict(_muon_kernels(method, shapes, plans), device)
            r[f"{method}_prediction"] = beside(r.get(f"{method}_ms"), p.seconds)

    _guarded(r, "prediction", work)
