"""The Triton kernels run under Triton's interpreter, in a process of their own: ``python tests/triton_helpers.py``
prints one JSON object of their differences from the torch paths, which tests/test_triton_kernels.py asserts on.

Triton decides whether to interpret when it decorates a kernel, its own library kernels (``tl.sum``...) included,
so ``TRITON_INTERPRET=1`` must be set before triton is first imported: a fresh process is the one place where that
holds whatever the test session imported before. Importing this module imports neither triton nor the kernels.
"""

from __future__ import annotations

import json
import os
import sys

import torch

DTYPES = {"fp32": (torch.float32, torch.float32, torch.float32),
          "autocast": (torch.bfloat16, torch.float32, torch.float32),
          "bf16_fp32_residual": (torch.bfloat16, torch.float32, torch.bfloat16),
          "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16)}
"""(branch, residual, parameter dtype) of the fused residual + norm: the fp32 model; bf16 autocast over fp32 weights
(the branch arrives in bf16); bf16 weights with the fp32 residual stream; everything bf16 (residual_fp32 = false)."""
SHAPES = {"odd_width": (3, 7, 37), "not_pow2": (42, 100), "rows_not_a_block_multiple": (2, 35, 64)}
"""Widths 37 and 100 pad to 64 and 128 columns; 70 rows of 64 are two tiles of 32 and one of 6, and the backward's two
programs each loop over more than one tile."""
NAMES = ("res", "h", "d_branch", "d_residual", "d_branch_bias", "d_branch_scale", "d_residual_bias",
         "d_residual_scale", "d_weight")
MODELS = {"fp32": (torch.float32, True), "bf16_fp32_residual": (torch.bfloat16, True), "bf16": (torch.bfloat16, False)}
"""(parameter dtype, residual_fp32) of the tiny models run end to end."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every gradient in one vector (by name): the model's gradient as the optimizer's clipping sees it."""
    return torch.cat([grads[n].double().flatten() for n in sorted(grads)])


def _modules(width: int, dtype: torch.dtype, seed: int):
    from model_helpers import perturb

    from zaya.model.layers import ResidualScale, RMSNorm

    torch.manual_seed(seed)
    scale, norm = ResidualScale(width), RMSNorm(width)
    perturb(scale, seed)
    perturb(norm, seed + 1)
    return scale.to(dtype), norm.to(dtype)


def _outputs_and_grads(fn, scale, norm, branch, residual, grads) -> list[torch.Tensor]:
    """Both outputs and all seven gradients (branch, residual, the four vectors, the norm's weight) of ``fn``."""
    params = [scale.branch_bias, scale.branch_scale, scale.residual_bias, scale.residual_scale, norm.weight]
    for p in params:
        p.grad = None
    a, x = branch.clone().requires_grad_(True), residual.clone().requires_grad_(True)
    res, h = fn(a, x)
    torch.autograd.backward((res, h), grads)
    return [res.detach(), h.detach(), a.grad, x.grad] + [p.grad for p in params]


def residual_norm_case(kernels, case: str, shape: tuple[int, ...]) -> dict[str, dict]:
    """Per output and gradient: the dtype of each path and max |fused - torch| / max |torch|."""
    from zaya.model import fused_norm

    branch_dtype, residual_dtype, param_dtype = DTYPES[case]
    scale, norm = _modules(shape[-1], param_dtype, seed=sum(shape))
    g = torch.Generator().manual_seed(len(case))
    branch = torch.randn(shape, generator=g).to(branch_dtype)
    residual = (torch.randn(shape, generator=g) * 3).to(residual_dtype)
    grads = (torch.randn(shape, generator=g).to(residual_dtype), torch.randn(shape, generator=g).to(param_dtype))

    def fused(a, x):
        return kernels.ResidualNormFunction.apply(a, x, scale.branch_bias, scale.branch_scale, scale.residual_bias,
                                                  scale.residual_scale, norm.weight, norm.eps, residual_dtype)

    def torch_path(a, x):
        return fused_norm.residual_norm(scale, a, x, norm, residual_dtype)

    got = _outputs_and_grads(fused, scale, norm, branch, residual, grads)
    want = _outputs_and_grads(torch_path, scale, norm, branch, residual, grads)
    return {n: {"dtype": str(a.dtype), "want_dtype": str(b.dtype), "shape_ok": a.shape == b.shape, "err": _rel(a, b)}
            for n, a, b in zip(NAMES, got, want)}


def model_case(kernels, name: str) -> dict:
    """A tiny model's loss and parameter gradients with every block's residual + norm through the kernels
    (``uses_triton`` made true: the interpreter runs CPU tensors) against the torch path; a bf16 model's also against
    the same model in fp32 (torch path), for both paths: the bf16 rounding noise the fused path must stay within."""
    from model_helpers import perturb, tiny_model

    from zaya.model import fused_norm

    dtype, residual_fp32 = MODELS[name]
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))

    def loss_and_grads(dtype=dtype):
        model = tiny_model(residual_fp32=residual_fp32)
        perturb(model)
        model.to(dtype)
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want = loss_and_grads()
    calls = []
    saved = fused_norm._kernels, fused_norm.uses_triton
    fused_norm._kernels = lambda: kernels
    fused_norm.uses_triton = lambda x: calls.append(tuple(x.shape)) or True
    try:
        got_loss, got = loss_and_grads()
    finally:
        fused_norm._kernels, fused_norm.uses_triton = saved
    out = {"calls": len(calls), "loss_err": _rel(got_loss, want_loss), "same_params": sorted(got) == sorted(want),
           "grad_err": max(_rel(got[n], want[n]) for n in want)}
    if dtype != torch.float32:
        ref_loss, ref = loss_and_grads(torch.float32)
        for path, loss, grads in (("fused", got_loss, got), ("torch", want_loss, want)):
            out[f"{path}_vs_fp32"] = {"loss": _rel(loss, ref_loss), "grad": _norm_rel(_flat(grads), _flat(ref))}
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
        raise SystemExit("run with TRITON_INTERPRET=1 in a fresh process")
    from zaya.model import fused_norm_triton as kernels

    out = {"autocast_off": bool(getattr(kernels.ResidualNormFunction.backward, "autocast_off", False)),
           "residual_norm": {f"{case}-{shape}": residual_norm_case(kernels, case, SHAPES[shape])
                             for case in DTYPES for shape in SHAPES},
           "model": {name: model_case(kernels, name) for name in MODELS}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
