"""The dtype and layout of every GEMM of a bf16-autocast training step on the CPU (``benchmarks/gemm_dtypes.py``'s
``GemmLog``, a dispatch mode below autocast): bf16 for every dense product, forward and backward, the hand-written
backwards included; fp32 for the experts' grouped GEMMs alone (on a CPU a grouped GEMM is one matmul per expert with
row counts that change every step, slow in bf16 where each new shape is a new oneDNN kernel; ``Experts._gemm_dtype``);
no operand that BLAS would have to copy. And the gradients stay within bf16 rounding of fp32's."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from model_helpers import perturb, tiny_model

GEMMS = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks/gemm_dtypes.py"))


@pytest.fixture(scope="module")
def model():
    m = tiny_model(0)
    perturb(m, 0)
    ids = torch.randint(0, m.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    return m, ids


def _grads(m, ids, bf16: bool) -> torch.Tensor:
    m.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        loss = m(ids, labels=ids).loss
    loss.backward()
    return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])


def test_bf16_autocast_gemms_are_bf16_but_the_cpu_experts(model):
    m, ids = model
    calls = GEMMS["record_step"](lambda: m(ids, labels=ids).loss)
    assert {c.phase for c in calls} == {"forward", "backward"}
    experts = [c for c in calls if c.op == "_grouped_mm"]
    # Per layer: the two projections forward, and the input and weight gradients of both backward.
    assert len(experts) == 6 * m.config.num_layers
    assert all(c.dtypes == ("float32", "float32") for c in experts)
    others = [c for c in calls if c.op != "_grouped_mm"]
    assert others and all(set(c.dtypes) == {"bfloat16"} for c in others), \
        sorted({(c.phase, c.op, c.dtypes) for c in others if set(c.dtypes) != {"bfloat16"}})
    assert not [c for c in calls if "strided" in c.layouts]


def test_bf16_autocast_gradients_within_bf16_rounding_of_fp32(model):
    m, ids = model
    ref = _grads(m, ids, bf16=False)
    got = _grads(m, ids, bf16=True)
    # bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3 per cast); the whole gradient vector measured
    # 1.4e-3 to 1.9e-3 away from fp32's over three seeds, so 1e-2 allows a few roundings' drift, not a wrong path.
    assert float((got - ref).norm() / ref.norm()) < 1e-2
