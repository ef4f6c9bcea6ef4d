"""Newton-Schulz's symmetric-product Triton kernel against torch, on CPU tensors under Triton's interpreter, and the
choice between it and torch's GEMMs.

The kernel runs in one subprocess (tests/triton_ns_helpers.py, the plumbing shared with tests/test_triton_kernels.py:
the interpreter must be set before triton is first imported, and its bf16 casts and bf16 ``tl.dot`` are made to
compute as a GPU's do), whose figures the tests below assert on. The interpreter checks the kernel's tile numbering,
masks, mirror stores, epilogue and strides, not a GPU compiler's code or its speed (the GPU suite's ``ns_triton``
check measures those). Skipped only where triton does not import (the dev extra installs it).
"""

from __future__ import annotations

import pytest
import torch

from triton_helpers import run_interpreted
from triton_ns_helpers import DTYPES, ITERATIONS, PRODUCTS, SHAPES

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]' brings it)")

from zaya.core import kernels as core_kernels  # noqa: E402
from zaya.core.hardware import load_profile  # noqa: E402
from zaya.optim import newton_schulz as ns  # noqa: E402

FP32_PRODUCT_TOL = 2e-6
"""fp32 products, max |kernel - torch| / max |torch|: the same sums of up to 130 products in another order (tiles of
K), each addition within 2^-24; a random walk of 130 such roundings is about 1e-6 of the largest entry.
Measured: at most 3.8e-7."""
BF16_PRODUCT_TOL = 2.0 ** -8
"""bf16 products: both accumulate in fp32 and round the result to bf16 (2^-9 relative); the kernel rounds once where
torch's CPU ``addmm`` may round the product before adding ``beta * c``, and a different fp32 sum can round to the
neighbouring bf16 value: one bf16 ulp of the largest entry. Measured: at most 2.3e-5."""
FP32_ITERATION_TOL = 1e-5
"""Whole fp32 iterations, ||kernel - torch|| / ||torch||: each path is within 6.7e-7 of the fp64 polynomial (measured),
so they cannot differ by much more than twice that; 1e-5 leaves room for other seeds. Measured: at most 7.7e-7."""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_interpreted("triton_ns_helpers.py")


@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_products_match_torch(interpreted, product, dtype):
    """``X X^T``, ``b A + c A A`` and ``a Q + Q Z`` by the kernel (upper tiles, mirrored, epilogue fused) against
    torch's full ``@`` / ``addmm`` / ``baddbmm``, 2-D and a batch of 3, ragged tiles and K steps: every entry written
    (the output starts as NaN), the dtype kept, values within one rounding of the result."""
    tol = FP32_PRODUCT_TOL if dtype == "fp32" else BF16_PRODUCT_TOL
    for shape in SHAPES:
        r = interpreted["products"][f"{product}-{dtype}-{shape}"]
        assert r["written"] and r["dtype_ok"], (shape, r)
        assert r["err"] <= tol, f"{shape}: max |kernel - torch| / max |torch| = {r['err']:.2e} > {tol:.1e}"


@pytest.mark.parametrize("name", list(ITERATIONS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_iterations_match_torch(interpreted, name, dtype):
    """``orthogonalize`` (standard: a tall matrix and a batched stack; Gram: one matrix) with every symmetric product
    through the kernel, against the torch path: every product went through the kernel; fp32 within rounding; bf16
    (where both paths' results carry the iteration's bf16 noise, about 1e-2 of the fp64 polynomial) as close to the
    fp64 polynomial as the torch path (measured ratio at most 1.0), and no further from the torch path than the torch
    path is from fp64 (measured at most 0.24x; the standard iteration's bf16 results are the torch path's, bit for
    bit, on the CPU)."""
    r = interpreted["iterations"][f"{name}-{dtype}"]
    assert r["same"] and r["products"] > 0 and r["kernel_calls"] == r["products"], r
    if dtype == "fp32":
        assert r["err"] <= FP32_ITERATION_TOL, r
        return
    assert r["kernel_vs_fp64"] <= 1.1 * r["torch_vs_fp64"], r
    assert r["err"] <= r["torch_vs_fp64"], r


@pytest.fixture
def gpu_capability(monkeypatch):
    """Sets the compute capability ``torch.cuda`` reports (a GPU stands in for the choice), with the kernel module's
    cached answers cleared before and after."""
    capability = [(8, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    supports = ns._kernels().supports
    supports.cache_clear()
    yield lambda value: capability.__setitem__(0, value) or supports.cache_clear()
    supports.cache_clear()


def test_the_kernel_is_chosen_on_a_gpu_only(monkeypatch, gpu_capability):
    """The choice, without a GPU: CUDA/ROCm devices take the kernel for bf16 and fp32 matrices of more than one tile;
    the CPU, fp16, one tile's rows, bf16 before Ampere, ``zaya.core.kernels.ENABLED = False`` and a torch.compile
    trace take torch."""
    cuda, cpu, tile = torch.device("cuda"), torch.device("cpu"), ns._kernels().TILE
    assert ns.triton_products(cuda, torch.bfloat16, 2048) and ns.triton_products(cuda, torch.float32, tile + 1)
    assert not ns.triton_products(cpu, torch.bfloat16, 2048)
    assert not ns.triton_products(cuda, torch.float16, 2048)
    assert not ns.triton_products(cuda, torch.bfloat16, tile)
    with monkeypatch.context() as m:
        m.setattr(core_kernels, "ENABLED", False)
        assert not ns.triton_products(cuda, torch.bfloat16, 2048)
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not ns.triton_products(cuda, torch.bfloat16, 2048)
    gpu_capability((7, 5))
    assert ns.triton_products(cuda, torch.float32, 2048) and not ns.triton_products(cuda, torch.bfloat16, 2048)


def test_gpu_plan_counts_the_kernel_tiles(monkeypatch, gpu_capability):
    """On a GPU the FLOP model (``ns_flops``, which picks standard or Gram under "auto" and balances ranks) counts
    the kernel's tiles as row blocks (a 2,048-row matrix: 16 tiles of 128, 136 of 256 computed); torch's GEMMs count
    as one block; the CPU keeps its profile's row blocks."""
    cfg = ns.NSConfig(ns.iteration_coefficients("keller", 5), ns.EPS, torch.bfloat16, "standard", (3,))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert ns.plan(cfg, 2048, 4096, cuda, True) == ("standard", 2048 // ns._kernels().TILE)
    profile = load_profile(cpu)
    assert ns.plan(cfg, 2048, 4096, cpu, False) == ("standard", min(profile.muon_max_blocks,
                                                                    2048 // profile.muon_block_rows))
    monkeypatch.setattr(core_kernels, "ENABLED", False)
    assert ns.plan(cfg, 2048, 4096, cuda, True) == ("standard", 1)
