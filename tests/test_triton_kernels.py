"""The Triton kernels against their torch paths, on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``).

The interpreter runs a kernel's source program by program with numpy: it checks the kernels' arithmetic, masks,
casts and loops, not a GPU compiler's code or its speed (benchmarks/gpu_kernels.py measures those on a GPU). The
kernels run in one subprocess (tests/triton_helpers.py: the variable must be set before triton is first imported;
there the interpreter's fp32-to-bf16 cast is made to round as a GPU's does), whose figures the tests below assert on.
Skipped only where triton does not import (the dev extra installs it).
"""

from __future__ import annotations

import pytest

from triton_helpers import CASES, DTYPES, MODELS, run_interpreted

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]' brings it)")

FP32_TOL = 1e-5
"""fp32 arithmetic (the fp32 cases; every fp32 tensor of the autocast cases), relative to the tensor's largest
magnitude: the same operations in another order (row sums over up to 100 columns, column sums over up to 70 rows,
about ten operations a chain), each within fp32's 6e-8. Measured: at most 2.2e-7."""
BF16_TOL = 2.0 ** -6
"""bf16 weights, and bf16 tensors: the kernels compute in fp32 and round once, where the torch path rounds after each
bf16 operation (four roundings of 2^-8 on the residual's chain ``(a + bb) * bs + (x + rb) * rs``), and an fp32
difference can move a value across a bf16 rounding boundary. Measured: at most 8.3e-3."""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_interpreted("triton_helpers.py")


@pytest.mark.parametrize("kind,case,shape", CASES)
def test_kernels_match_the_torch_path(interpreted, kind, case, shape):
    """Every output (the new residual stream, the normed activation) and every input gradient (branch, residual,
    the residual scaling's four vectors, the norm's weight) of each fused function against its torch path in
    ``zaya.model.fused_norm``: the same dtypes and shapes, values within the tolerance of the arithmetic."""
    bf16_params = DTYPES[case][2] != DTYPES["fp32"][2]
    results = interpreted["kernels"][f"{kind}-{case}-{shape}"]
    assert len(results) == {"residual_norm": 9, "residual": 7, "norm": 3}[kind], sorted(results)
    for name, r in results.items():
        assert r["dtype"] == r["want_dtype"] and r["shape_ok"], (name, r)
        tol = BF16_TOL if bf16_params or r["dtype"] == "torch.bfloat16" else FP32_TOL
        assert r["err"] <= tol, f"{name}: max |fused - torch| / max |torch| = {r['err']:.2e} > {tol:.1e}"


def test_backward_runs_without_autocast(interpreted):
    """The trainer's backward runs inside autocast: the custom backward must pick its own dtypes (as the model's)."""
    assert interpreted["autocast_off"]


@pytest.mark.parametrize("model", list(MODELS))
def test_model_through_the_kernels(interpreted, model):
    """A tiny model (3 blocks, one expert) with every residual join and norm through the kernels (per block the
    attention norm, the attention's join fused with the MoE norm, the MoE's join; then the final norm): fp32, loss and
    every gradient as the torch path's (fp32 rounding differences grown through three blocks' backward); bf16, as
    close to the same model in fp32 as the torch path is: the loss within one bf16 rounding (both paths measured at
    4e-5 to 2e-4), the whole gradient within 1.5x the torch path's error (measured 0.95x and 1.10x)."""
    r = interpreted["model"][model]
    assert r["calls"] == 3 * 3 + 1 and r["same_params"], r
    if model == "fp32":
        assert r["loss_err"] <= FP32_TOL and r["grad_err"] <= 1e-4, r
        return
    fused, torch_path = r["fused_vs_fp32"], r["torch_vs_fp32"]
    assert fused["loss"] <= 2.0 ** -8, r
    assert fused["grad"] <= 1.5 * torch_path["grad"], r
