"""The Triton kernels against their torch paths, on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``).

The interpreter runs a kernel's source program by program with numpy: it checks the kernels' arithmetic, masks,
casts and loops, not a GPU compiler's code or its speed (benchmarks/gpu_kernels.py measures those on a GPU). The
kernels run in one subprocess (tests/triton_helpers.py: the variable must be set before triton is first imported),
whose figures the tests below assert on. Skipped only where triton does not import (the dev extra installs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from triton_helpers import DTYPES, MODELS, NAMES, SHAPES

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]' brings it)")

FP32_TOL = 1e-5
"""fp32 arithmetic (the fp32 case; every fp32 tensor of the autocast case), relative to the tensor's largest
magnitude: the same operations in another order (row sums over up to 100 columns, column sums over up to 70 rows,
about ten operations a chain), each within fp32's 6e-8. Measured: at most 1.7e-7."""
BF16_TOL = 2.0 ** -5
"""bf16 tensors and bf16 parameters: the kernels compute in fp32 and round once, where the torch path rounds the bf16
branch sum and each bf16 product; the norm's output is a bf16 rounding of a bf16-rounded input times a bf16 weight,
so a stored value may differ by up to four ulps (2^-8 each) of the largest. Measured: at most 1.7e-2."""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    tests = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(tests / "triton_helpers.py")], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_residual_norm_matches_the_torch_path(interpreted, case, shape):
    """Both outputs (the new residual stream, the normed activation) and all seven gradients (branch, residual, the
    residual scaling's four vectors, the norm's weight) of the fused function against ``residual_norm``'s torch
    path: the same dtypes and shapes, values within the tolerance of the arithmetic."""
    bf16_params = DTYPES[case][2] != DTYPES["fp32"][2]
    for name in NAMES:
        r = interpreted["residual_norm"][f"{case}-{shape}"][name]
        assert r["dtype"] == r["want_dtype"] and r["shape_ok"], (name, r)
        tol = BF16_TOL if bf16_params or r["dtype"] == "torch.bfloat16" else FP32_TOL
        assert r["err"] <= tol, f"{name}: max |fused - torch| / max |torch| = {r['err']:.2e} > {tol:.1e}"


def test_backward_runs_without_autocast(interpreted):
    """The trainer's backward runs inside autocast: the custom backward must pick its own dtypes (as the model's)."""
    assert interpreted["autocast_off"]


@pytest.mark.parametrize("model", list(MODELS))
def test_model_through_the_kernels(interpreted, model):
    """A tiny model (3 blocks) with each block's residual + norm through the kernels: fp32, loss and every gradient as
    the torch path's (differences of fp32 rounding grown through three blocks' backward); bf16, loss and gradient as
    close to the fp32 model's as the torch path's are (the same bf16 rounding noise, in another pattern: measured
    1.06x and 1.27x the torch path's gradient error)."""
    r = interpreted["model"][model]
    assert r["calls"] == 3 and r["same_params"], r
    if model == "fp32":
        assert r["loss_err"] <= FP32_TOL and r["grad_err"] <= 1e-4, r
        return
    fused, torch_path = r["fused_vs_fp32"], r["torch_vs_fp32"]
    assert fused["loss"] <= 2 * torch_path["loss"] + 1e-4, r
    assert fused["grad"] <= 1.5 * torch_path["grad"], r
