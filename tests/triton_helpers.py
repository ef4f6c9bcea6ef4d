"""The Triton kernels run under Triton's interpreter, in a process of their own: ``python tests/triton_helpers.py``
prints one JSON object of the fused norm kernels' differences from their torch paths, which
tests/test_triton_kernels.py asserts on (tests/triton_ns_helpers.py does the same for Newton-Schulz's kernel, with
``run_interpreted`` and the interpreter's fixes for bf16 below).

Triton decides whether to interpret when it decorates a kernel, its own library kernels (``tl.sum``...) included,
so ``TRITON_INTERPRET=1`` must be set before triton is first imported: a fresh process is the one place where that
holds whatever the test session imported before. Importing this module imports neither triton nor the kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
_VECTORS = ("d_branch_bias", "d_branch_scale", "d_residual_bias", "d_residual_scale")
KINDS = {"residual_norm": ("res", "h", "d_branch", "d_residual", *_VECTORS, "d_weight"),
         "residual": ("res", "d_branch", "d_residual", *_VECTORS),
         "norm": ("h", "d_branch", "d_x", *_VECTORS, "d_weight")}
"""The fused functions (the residual join with the norm after it, each alone) and what each is compared on: its
outputs and the gradients of its inputs (the norm alone has no branch: its entries are left out)."""
CASES = [(kind, case, shape) for kind in KINDS for case in DTYPES for shape in SHAPES
         if kind != "norm" or case in ("fp32", "bf16")]
"""(kind, dtypes, shape) of every comparison; the norm alone sees only its weights' dtype (fp32 or bf16)."""
ONE_EXPERT = dict(num_experts=1, top_k=1, router_skip_expert=False)
"""The end-to-end models' MoE: one expert, so that no routing decision can flip between the paths (a bf16 rounding
that sends one token to another expert changes the loss by more than any rounding)."""
MODELS = {"fp32": (torch.float32, True), "bf16_fp32_residual": (torch.bfloat16, True), "bf16": (torch.bfloat16, False)}
"""(parameter dtype, residual_fp32) of the tiny models run end to end."""


def run_interpreted(script: str) -> dict:
    """Run ``tests/<script>`` with ``TRITON_INTERPRET=1`` in a fresh process (the tests folder on its path) and return
    the JSON object its last line prints."""
    tests = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(tests / script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    """The outputs and the gradients of branch, residual, the four vectors and the norm's weight (None where ``fn``
    does not use it) of ``fn``."""
    params = [scale.branch_bias, scale.branch_scale, scale.residual_bias, scale.residual_scale, norm.weight]
    for p in params:
        p.grad = None
    a, x = branch.clone().requires_grad_(True), residual.clone().requires_grad_(True)
    outs = fn(a, x)
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [a.grad, x.grad] + [p.grad for p in params]


def kernel_case(kernels, kind: str, case: str, shape: tuple[int, ...]) -> dict[str, dict]:
    """Per output and gradient of the ``kind`` function (``KINDS``): the dtype of each path and
    max |fused - torch| / max |torch|."""
    from zaya.model import fused_norm

    branch_dtype, residual_dtype, param_dtype = DTYPES[case]
    scale, norm = _modules(shape[-1], param_dtype, seed=sum(shape))
    g = torch.Generator().manual_seed(len(case))
    branch = torch.randn(shape, generator=g).to(branch_dtype)
    residual = (torch.randn(shape, generator=g) * 3).to(residual_dtype)
    grads = (torch.randn(shape, generator=g).to(residual_dtype), torch.randn(shape, generator=g).to(param_dtype))
    vectors = (scale.branch_bias, scale.branch_scale, scale.residual_bias, scale.residual_scale)
    if kind == "norm":  # the norm's input in its dtype (as the model passes it); one output
        residual, grads = residual.to(param_dtype), grads[1:]
        fused = (lambda a, x: (kernels.NormFunction.apply(x, norm.weight, norm.eps),))
        torch_path = (lambda a, x: (norm(x),))
    elif kind == "residual":
        grads = grads[:1]
        fused = (lambda a, x: (kernels.ResidualFunction.apply(a, x, *vectors, residual_dtype),))
        torch_path = (lambda a, x: (fused_norm.join_residual(scale, a, x, residual_dtype),))
    else:
        fused = (lambda a, x: kernels.ResidualNormFunction.apply(a, x, *vectors, norm.weight, norm.eps,
                                                                 residual_dtype))
        torch_path = (lambda a, x: fused_norm.residual_norm(scale, a, x, norm, residual_dtype))
    got = _outputs_and_grads(fused, scale, norm, branch, residual, grads)
    want = _outputs_and_grads(torch_path, scale, norm, branch, residual, grads)
    return {n: {"dtype": str(a.dtype), "want_dtype": str(b.dtype), "shape_ok": a.shape == b.shape, "err": _rel(a, b)}
            for n, a, b in zip(KINDS[kind], got, want) if b is not None}


def model_case(kernels, name: str) -> dict:
    """A tiny model's loss and parameter gradients with every block's residual + norm through the kernels
    (``uses_triton`` made true: the interpreter runs CPU tensors) against the torch path; a bf16 model's also against
    the same model in fp32 (torch path), for both paths: the bf16 rounding noise the fused path must stay within."""
    from model_helpers import perturb, tiny_model

    from zaya.model import fused_norm

    dtype, residual_fp32 = MODELS[name]
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))

    def loss_and_grads(dtype=dtype):
        model = tiny_model(residual_fp32=residual_fp32, **ONE_EXPERT)
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


def round_bf16_as_compiled() -> None:
    """Make the interpreter cast fp32 to bf16 as compiled kernels do: to nearest, ties to even (the ``fptrunc`` a GPU
    runs; torch rounds the same way). Triton 3.9's interpreter truncates that cast instead (its ``cast_impl`` converts
    without a rounding mode), which leaves about half of all bf16 values one ulp low, toward zero: a bias no GPU
    shows, and larger than the differences under test."""
    import numpy as np
    from triton import language as tl
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.uint16).numpy(), dst_type.scalar)
        return cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


def dot_bf16_as_compiled() -> None:
    """Make the interpreter's ``tl.dot`` of bf16 operands multiply their values, as a GPU's tensor cores do (exact
    products, summed in fp32): Triton 3.9's interpreter hands the bf16 operands' raw 16-bit patterns to numpy's
    matmul, which multiplies them as integers. The operands are widened to fp32 (exact) first."""
    import numpy as np
    from triton import language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def widened(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
        raise SystemExit("run with TRITON_INTERPRET=1 in a fresh process")
    round_bf16_as_compiled()
    from zaya.model import fused_norm_triton as kernels

    out = {"autocast_off": bool(getattr(kernels.ResidualNormFunction.backward, "autocast_off", False)),
           "kernels": {f"{kind}-{case}-{shape}": kernel_case(kernels, kind, case, SHAPES[shape])
                       for kind, case, shape in CASES},
           "model": {name: model_case(kernels, name) for name in MODELS}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
