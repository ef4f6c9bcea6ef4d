"""A Triton kernel that fails where it runs falls back to its torch path: one warning naming it, the same result, and
the kernel switched off for the rest of the process (``zaya.core.kernels.guarded``).

No GPU is needed: the kernels are let run on CPU tensors (``triton_device`` patched), where launching a compiled
Triton kernel fails as a broken compile would on a GPU; the forward of the fused norm's autograd functions is
replaced by its torch arithmetic where a test needs the backward kernel to be the one that fails.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import zaya.core.kernels as kernels
from zaya.model.layers import ResidualScale, RMSNorm


@pytest.fixture(autouse=True)
def fresh_switches(monkeypatch):
    monkeypatch.setattr(kernels, "failed", {})


def _allow_cpu(monkeypatch, module) -> None:
    """Let ``module``'s kernels be chosen for CPU tensors (their launch then fails)."""
    monkeypatch.setattr(module, "triton_device", lambda device, name: name not in kernels.failed)


def test_guarded_falls_back_warns_once_and_switches_the_kernel_off():
    calls = []

    def broken():
        calls.append("kernel")
        raise RuntimeError("PassManager::run failed\nmore detail")

    with pytest.warns(RuntimeWarning, match=r"Triton kernel 'k1' failed \(RuntimeError: PassManager::run failed\)"):
        assert kernels.guarded("k1", broken, lambda: 7) == 7
    assert kernels.failed == {"k1": "RuntimeError: PassManager::run failed"}
    cuda = torch.device("cuda")
    assert not kernels.triton_device(cuda, "k1")
    assert kernels.triton_device(cuda, "k2") == kernels.ENABLED  # another kernel is untouched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.guarded("k2", lambda: 3, lambda: 4) == 3
    assert calls == ["kernel"]


def test_out_of_memory_is_not_a_kernel_failure():
    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        kernels.guarded("k", oom, lambda: 0)
    assert kernels.failed == {}


def test_newton_schulz_products_fall_back_to_torch(monkeypatch):
    """A failing symmetric-product kernel: Muon's orthogonalisation still returns torch's result (fp32: only the
    failing product's GEMM split differs, so within fp32 rounding of the polynomial)."""
    from zaya.optim import newton_schulz as ns

    torch.manual_seed(0)
    x = torch.randn(40, 72)
    want = ns.orthogonalize(x, dtype=torch.float32, method="standard")

    class Broken:
        TILE = 16

        @staticmethod
        def supports(device, dtype):
            return True

        @staticmethod
        def sym_matmul(*args):
            raise RuntimeError("triton compile failed")

    _allow_cpu(monkeypatch, ns)
    monkeypatch.setattr(ns, "_kernels", lambda: Broken)
    assert ns.triton_products(x.device, torch.float32, 40)
    with pytest.warns(RuntimeWarning, match=ns.KERNEL):
        got = ns.orthogonalize(x, dtype=torch.float32, method="standard")
    assert ns.KERNEL in kernels.failed and not ns.triton_products(x.device, torch.float32, 40)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _norm_case(dtype=torch.float32):
    torch.manual_seed(1)
    scale, norm = ResidualScale(24), RMSNorm(24)
    with torch.no_grad():
        for p in (*scale.parameters(), norm.weight):
            p.add_(0.3 * torch.randn_like(p))
    branch = torch.randn(3, 5, 24, dtype=dtype, requires_grad=True)
    residual = torch.randn(3, 5, 24, requires_grad=True)
    return scale, norm, branch, residual


def _grads(outputs, inputs):
    torch.manual_seed(2)
    weights = [torch.randn_like(o) for o in outputs]
    return torch.autograd.grad(outputs, inputs, weights)


def test_fused_norm_forward_failure_takes_the_torch_path(monkeypatch):
    pytest.importorskip("triton")
    from zaya.model import fused_norm

    scale, norm, branch, residual = _norm_case()
    params = [branch, residual, *scale.parameters(), norm.weight]
    want = fused_norm.residual_norm(scale, branch, residual, norm, torch.float32)
    want_grads = _grads(want, params)
    _allow_cpu(monkeypatch, fused_norm)
    assert fused_norm.uses_triton(branch)
    with pytest.warns(RuntimeWarning, match=fused_norm.KERNEL):  # a compiled kernel cannot launch on CPU tensors
        got = fused_norm.residual_norm(scale, branch, residual, norm, torch.float32)
    assert not fused_norm.uses_triton(branch)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, w in zip(_grads(got, params), want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _torch_forward(branch, residual, vectors, weight, eps, residual_dtype):
    """``fused_norm_triton._forward``'s outputs computed by torch (so that only the backward kernel fails)."""
    n = residual.shape[-1]
    x = residual.reshape(-1, n).contiguous()
    a = x if branch is None else branch.reshape(-1, n).contiguous()
    res = None if branch is None else ((a + vectors[0]) * vectors[1] + (x + vectors[2]) * vectors[3]).to(residual_dtype)
    if weight is None:
        return res, None, None, a, x
    inp = (x if res is None else res).to(weight.dtype)
    rstd = torch.rsqrt(inp.float().pow(2).mean(-1) + eps)
    return res, weight * (inp.float() * rstd[:, None]).to(weight.dtype), rstd, a, x


@pytest.mark.parametrize("kind", ["residual_norm", "residual", "norm"])
def test_fused_norm_backward_failure_takes_the_torch_path(monkeypatch, kind):
    """Each autograd function's backward kernel fails: its gradients come from the torch path, equal to the
    module path's within fp32 rounding (the fallback differentiates the same expressions by autograd, where the
    modules' own backward functions order some fp32 sums differently)."""
    pytest.importorskip("triton")
    from zaya.model import fused_norm, fused_norm_triton

    scale, norm, branch, residual = _norm_case()
    vectors = (scale.branch_bias, scale.branch_scale, scale.residual_bias, scale.residual_scale)
    if kind == "residual_norm":
        params = [branch, residual, *vectors, norm.weight]
        fused = lambda: fused_norm_triton.ResidualNormFunction.apply(branch, residual, *vectors, norm.weight,  # noqa
                                                                     norm.eps, torch.float32)
        reference = lambda: fused_norm.residual_norm(scale, branch, residual, norm, torch.float32)  # noqa: E731
    elif kind == "residual":
        params = [branch, residual, *vectors]
        fused = lambda: (fused_norm_triton.ResidualFunction.apply(branch, residual, *vectors, torch.float32),)  # noqa
        reference = lambda: (fused_norm.join_residual(scale, branch, residual, torch.float32),)  # noqa: E731
    else:
        params = [residual, norm.weight]
        fused = lambda: (fused_norm_triton.NormFunction.apply(residual, norm.weight, norm.eps),)  # noqa: E731
        reference = lambda: (fused_norm.rms_norm(norm, residual),)  # noqa: E731
    want_grads = _grads(reference(), params)
    monkeypatch.setattr(fused_norm_triton, "_forward", _torch_forward)
    out = fused()
    with pytest.warns(RuntimeWarning, match=fused_norm.KERNEL):
        got_grads = _grads(out, params)
    assert fused_norm.KERNEL in kernels.failed
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
