"""The Newton-Schulz Triton kernel under Triton's interpreter, in a process of its own: ``python
tests/triton_ns_helpers.py`` prints one JSON object of its differences from the torch paths, which
tests/test_triton_newton_schulz.py asserts on (why a process of its own, and the interpreter's fixes for bf16:
tests/triton_helpers.py). On CPU tensors the kernel's tiles are 16 x 16 with K steps of 32
(``newton_schulz_triton._config``), so the small matrices below span several tiles.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from triton_helpers import _norm_rel, _rel, dot_bf16_as_compiled, round_bf16_as_compiled

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPES = {"40x72": (40, 72), "64x130": (64, 130), "3x40x72": (3, 40, 72)}
"""40 rows: three tiles a side (three upper tiles mirrored), the last of 8 rows; 64 rows: four whole tiles; the K
steps over 40, 72 and 130 columns end ragged; a batch of 3."""
PRODUCTS = ("gram", "poly", "commuting")
"""The three kinds of symmetric product the iterations run: ``X X^T`` (``b`` the transposed view of ``a``, no
``c``), ``b A + c A A`` (``c = a = b``, the standard iteration's) and ``a Q + Q Z`` (two polynomials in one matrix,
alpha 1: the Gram iteration's)."""
ITERATIONS = {"standard-72x40": ("standard", (72, 40), False), "standard-3x40x72": ("standard", (3, 40, 72), True),
              "gram-40x72": ("gram", (40, 72), False)}
"""(method, shape, batched) of the whole iterations compared: a tall matrix (its transposed view: strided operands),
a batched stack, and the Gram iteration's products (the kernel's batching is the standard stack's)."""
STEPS, RESTARTS = 3, (2,)
"""Iterations of each NS, and the Gram iteration's restart at the third (default (3,): the same code, one iteration
later)."""
COEFFS = (3.4445, -4.7750, 2.0315)


def product_case(kernels, product: str, dtype: torch.dtype, shape: tuple[int, ...]) -> dict:
    """The kernel's ``product`` against torch's full product (``@``, ``addmm`` / ``baddbmm``) on the same operands:
    max |kernel - torch| / max |torch|, and whether every entry of ``out`` (filled with NaN first) was written."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype)
    x = x / x.double().norm(dim=(-2, -1), keepdim=True).to(dtype)
    a_mat = x @ x.mT  # symmetric, as every c and operand of the iterations
    addmm = torch.addmm if x.ndim == 2 else torch.baddbmm
    if product == "gram":
        args, want = (x, x.mT, None, 0.0, 1.0), x @ x.mT
    elif product == "poly":
        b, c = COEFFS[1], COEFFS[2]
        args, want = (a_mat, a_mat, a_mat, b, c), addmm(a_mat, a_mat, a_mat, beta=b, alpha=c)
    else:
        q = addmm(a_mat, a_mat, a_mat, beta=0.5, alpha=-0.25)
        q.diagonal(dim1=-2, dim2=-1).add_(1.5)
        args, want = (q, a_mat, q, COEFFS[0], 1.0), addmm(q, q, a_mat, beta=COEFFS[0])
    out = torch.full(want.shape, float("nan"), dtype=dtype)
    kernels.sym_matmul(out, *args)
    return {"err": _rel(out, want), "written": bool(torch.isfinite(out).all()), "dtype_ok": out.dtype == want.dtype}


def iteration_case(ns, kernels, dtype: torch.dtype, method: str, shape: tuple[int, ...], batched: bool) -> dict:
    """``orthogonalize`` with every symmetric product through the kernel (``triton_products`` made true: the
    interpreter runs CPU tensors) against the torch path, and both against the same polynomial in fp64."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) + shape[-1]))
    run = lambda dt=dtype: ns.orthogonalize(x, ns_steps=STEPS, dtype=dt, method=method,  # noqa: E731
                                            gram_restarts=RESTARTS, batched=batched)
    products = []
    saved = ns._sym
    ns._sym = lambda *a, **k: products.append(1) or saved(*a, **k)
    try:
        want = run()
    finally:
        ns._sym = saved
    ref = ns.zeropower_via_newtonschulz(x, COEFFS, STEPS, dtype=torch.float64)
    calls = []
    saved = ns._kernels, ns.triton_products
    ns._kernels = lambda: kernels
    ns.triton_products = lambda device, dt, m: calls.append(m) or True
    try:
        got = run()
    finally:
        ns._kernels, ns.triton_products = saved
    return {"products": len(products), "kernel_calls": len(calls), "err": _norm_rel(got, want),
            "kernel_vs_fp64": _norm_rel(got, ref), "torch_vs_fp64": _norm_rel(want, ref),
            "same": got.dtype == want.dtype and got.shape == want.shape}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
        raise SystemExit("run with TRITON_INTERPRET=1 in a fresh process")
    round_bf16_as_compiled()
    dot_bf16_as_compiled()
    from zaya.optim import newton_schulz as ns
    from zaya.optim import newton_schulz_triton as kernels

    out = {"products": {f"{p}-{d}-{s}": product_case(kernels, p, DTYPES[d], SHAPES[s])
                        for p in PRODUCTS for d in DTYPES for s in SHAPES},
           "iterations": {f"{name}-{d}": iteration_case(ns, kernels, DTYPES[d], *ITERATIONS[name])
                          for name in ITERATIONS for d in DTYPES}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
