"""The model's hand-written autograd functions against autograd through the plain expressions they replace.

- ``zaya.model.loss.cross_entropy`` (chunked fp32 cross-entropy on logits of any dtype) against
  ``F.cross_entropy(logits.float(), ignore_index=-100)``: loss to fp32 rounding, gradient to fp32 rounding before its
  single cast to the logits' dtype (so at most one ulp of that dtype apart);
- ``ResidualScale``'s function: the same operations in the same order, so bitwise equal output and gradients for
  every dtype mix the model uses (fp32 residual with bf16 or fp32 branches and parameters);
- ``RMSNorm``'s function: bitwise equal output; gradients equal to fp32 rounding (the backward is the same formula as
  autograd's chain, evaluated in a different order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zaya.model import loss as zloss
from zaya.model.layers import ResidualScale, RMSNorm


def _ulp_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """a and b equal to within one ulp of ``dtype`` (relative to each element's magnitude) plus fp32 noise."""
    a, b = a.float(), b.float()
    tol = torch.finfo(dtype).eps * b.abs() + 1e-7 * b.abs().max()
    assert bool(((a - b).abs() <= tol).all()), float(((a - b).abs() - tol).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(300, 97), (40, 70_000), (3, 5)])
def test_chunked_cross_entropy_matches_autograd(dtype, rows, vocab, monkeypatch):
    monkeypatch.setattr(zloss, "CHUNK_ELEMENTS", 1000)  # several chunks, and a ragged last one, even when small
    g = torch.Generator().manual_seed(rows)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[::4] = -100
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    got = zloss.cross_entropy(a, labels)
    want = F.cross_entropy(b.float(), labels, ignore_index=-100)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    (2.5 * got).backward()
    (2.5 * want).backward()
    assert a.grad.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6 * float(b.grad.abs().max()))
    else:
        _ulp_close(a.grad, b.grad, dtype)
    assert bool((a.grad[::4] == 0).all())  # ignored rows get no gradient


def test_chunked_cross_entropy_shapes_and_all_ignored():
    logits = torch.randn(2, 3, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 3))
    torch.testing.assert_close(zloss.cross_entropy(logits, labels),
                               F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1)))
    ignored = torch.full((2, 3), -100)
    assert torch.isnan(zloss.cross_entropy(logits, ignored))
    assert torch.isnan(F.cross_entropy(logits.reshape(-1, 11), ignored.reshape(-1), ignore_index=-100))


def _plain_residual(m: ResidualScale, branch, residual):
    return (branch + m.branch_bias) * m.branch_scale + (residual + m.residual_bias) * m.residual_scale


@pytest.mark.parametrize("branch_dtype,param_dtype,residual_dtype", [
    (torch.bfloat16, torch.float32, torch.float32),   # autocast: bf16 branch, fp32 weights and residual stream
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.float32),  # bf16 weights, fp32 residual stream
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
])
def test_residual_scale_function_is_bitwise_autograd(branch_dtype, param_dtype, residual_dtype):
    g = torch.Generator().manual_seed(0)
    m = ResidualScale(24).to(param_dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    branch = torch.randn(3, 5, 24, generator=g).to(branch_dtype).requires_grad_()
    residual = torch.randn(3, 5, 24, generator=g).to(residual_dtype).requires_grad_()
    upstream = torch.randn(3, 5, 24, generator=g)
    inputs = [branch, residual, *m.parameters()]
    got = m(branch, residual)
    want = _plain_residual(m, branch, residual)
    assert got.dtype == want.dtype and torch.equal(got, want)
    got_grads = torch.autograd.grad(got, inputs, upstream.to(got.dtype))
    want_grads = torch.autograd.grad(want, inputs, upstream.to(want.dtype))
    for x, y in zip(got_grads, want_grads):
        assert x.dtype == y.dtype and torch.equal(x, y)
    with torch.no_grad():
        assert torch.equal(m(branch, residual), want)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
def test_rmsnorm_function_matches_autograd(x_dtype, w_dtype):
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(40).to(w_dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(40, generator=g))
    x = (2 * torch.randn(4, 6, 40, generator=g)).to(x_dtype).requires_grad_()
    upstream = torch.randn(4, 6, 40, generator=g)

    def plain(x):
        x32 = x.float()
        return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)

    got, want = norm(x), plain(x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    got_grads = torch.autograd.grad(got, [x, norm.weight], upstream.to(got.dtype))
    want_grads = torch.autograd.grad(want, [x, norm.weight], upstream.to(want.dtype))
    for a, b in zip(got_grads, want_grads):
        assert a.dtype == b.dtype
        if a.dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        else:  # the same fp32 value up to rounding order, then one cast: at most one ulp of the dtype apart
            _ulp_close(a, b, a.dtype)


def test_custom_backwards_run_without_autocast():
    """The trainer's backward runs inside autocast; zaya's custom backwards must not be re-cast by it (CUDA's autocast
    computes sum/pow/exp in fp32 and broke the MoE combine's bf16 index_copy_ on a GPU). Checked on every custom
    Function of the model: each backward sees autocast off."""
    import inspect

    import zaya.distributed.context_parallel as cp
    from zaya.model import layers, loss, moe

    functions = [obj for module in (layers, loss, moe, cp) for _, obj in inspect.getmembers(module, inspect.isclass)
                 if issubclass(obj, torch.autograd.Function) and obj.__module__ == module.__name__]
    assert len(functions) >= 10
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        @__import__("zaya.core.device", fromlist=["backward_without_autocast"]).backward_without_autocast
        def backward(ctx, grad):
            seen.append(torch.is_autocast_enabled("cpu"))
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Probe.apply(x).sum().backward()
    assert seen == [False]
    for fn in functions:
        marks, f = [], fn.backward
        while f is not None:
            marks.append(getattr(f, "autocast_off", False))
            f = getattr(f, "__wrapped__", None)
        assert any(marks), fn.__name__
