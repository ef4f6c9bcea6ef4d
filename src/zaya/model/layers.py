"""Small building blocks shared by the decoder: RMSNorm, residual scaling, the input affine, partial RoPE."""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from zaya.core.device import backward_without_autocast


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * (x * r) in x's dtype, r = rsqrt(mean(x^2) + eps) in fp32 [..., 1])."""
    x32 = x.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 * r).to(x.dtype), r


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm with a hand-written backward: the forward's exact operations; the backward saves only x and the
    per-row rsqrt (autograd's chain of pow/mean/rsqrt/mul keeps four fp32 intermediates) and needs fewer passes.
    Same gradient formula as autograd's chain, in fp32; only fp32 rounding order differs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # noqa: D102
        out, r = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, r)
        return out

    @staticmethod
    @once_differentiable
    @backward_without_autocast
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        x, weight, r = ctx.saved_tensors
        x32 = x.float()
        y = (x32 * r).to(x.dtype)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * y).sum(tuple(range(grad.dim() - 1))).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gy = (grad * weight).to(x.dtype).float()
            # d(x * r)/dx with r = (mean(x^2) + eps)^-1/2:  (gy - x * r^2 * mean(gy * x)) * r
            dot = (gy * x32).mean(-1, keepdim=True)
            grad_x = gy.sub_(x32 * (r * r) * dot).mul_(r).to(x.dtype)
        return grad_x, grad_w, None


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned per-channel scale.

    Normalises in fp32 and casts back before the scale, matching the reference port so that bf16 runs round the
    same way it does.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        return _rms_norm(x, self.weight, self.eps)[0]

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class ResidualScale(nn.Module):
    """ZAYA1 residual scaling: ``(branch + b_out) * s_out + (residual + b_res) * s_res``.

    The paper writes it as ``alpha * x + beta``; this is the same map re-parameterised the way the released
    checkpoints store it (four D-sized vectors). Scales start at 1 and biases at 0, so at init it is the plain
    residual add.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.branch_scale = nn.Parameter(torch.ones(dim))
        self.branch_bias = nn.Parameter(torch.zeros(dim))
        self.residual_scale = nn.Parameter(torch.ones(dim))
        self.residual_bias = nn.Parameter(torch.zeros(dim))

    def forward(self, branch: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        params = (self.branch_bias, self.branch_scale, self.residual_bias, self.residual_scale)
        if torch.is_grad_enabled() and (branch.requires_grad or residual.requires_grad
                                        or any(p.requires_grad for p in params)):
            return _ResidualScaleFunction.apply(branch, residual, *params)
        return (branch + self.branch_bias) * self.branch_scale + (residual + self.residual_bias) * self.residual_scale


class _ResidualScaleFunction(torch.autograd.Function):
    """``(branch + bb) * bs + (residual + rb) * rs`` with the same operations in the same order (bitwise the same
    output and gradients as autograd's), but the forward works in place on two temporaries instead of five, the
    backward recomputes the two sums instead of keeping them alive, and each bias gradient comes from the same
    product as its input gradient."""

    @staticmethod
    def forward(ctx, branch, residual, branch_bias, branch_scale, residual_bias, residual_scale):  # noqa: D102
        ctx.save_for_backward(branch, residual, branch_bias, branch_scale, residual_bias, residual_scale)
        a = _mul(torch.add(branch, branch_bias), branch_scale)
        r = _mul(torch.add(residual, residual_bias), residual_scale)
        return _add(a, r)

    @staticmethod
    @once_differentiable
    @backward_without_autocast
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        branch, residual, bb, bs, rb, rs = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad_branch, grad_bb, grad_bs = _scaled_sum_grads(grad, branch, bb, bs, need[0], need[2], need[3])
        grad_residual, grad_rb, grad_rs = _scaled_sum_grads(grad, residual, rb, rs, need[1], need[4], need[5])
        return grad_branch, grad_residual, grad_bb, grad_bs, grad_rb, grad_rs


def _scaled_sum_grads(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor, need_x: bool,
                      need_bias: bool, need_scale: bool) -> tuple[torch.Tensor | None, ...]:
    """Gradients of ``(x + bias) * scale`` (x, bias, scale; None where not needed) with autograd's steps and
    roundings: the gradient of the product arrives in the product's dtype; the gradient of (x + bias) is
    grad * scale in the sum's dtype, the bias gradient its row sum, x's its cast; the scale gradient is the row sum
    of grad * (x + bias). Row sums come before the cast to the parameter's dtype."""
    grad_x = grad_bias = grad_scale = None
    if not (need_x or need_bias or need_scale):
        return grad_x, grad_bias, grad_scale
    dims = tuple(range(grad.dim() - 1))
    sum_dtype = torch.promote_types(x.dtype, bias.dtype)
    g = grad.to(torch.promote_types(sum_dtype, scale.dtype))
    if need_x or need_bias:
        gs = (g * scale).to(sum_dtype)
        grad_bias = gs.sum(dims).to(bias.dtype) if need_bias else None
        grad_x = gs.to(x.dtype) if need_x else None
    if need_scale:
        grad_scale = _mul(torch.add(x, bias), g).sum(dims).to(scale.dtype)
    return grad_x, grad_bias, grad_scale


def _mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * b``, in place into the temporary ``a`` when that keeps the promoted dtype. (Dtypes by
    ``promote_types``, which torch.compile traces, rather than ``result_type``: no operand here is 0-dim, where
    the two differ.)"""
    keeps = a.dtype == torch.promote_types(a.dtype, b.dtype) and a.shape == torch.broadcast_shapes(a.shape, b.shape)
    return a.mul_(b) if keeps else a * b


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` (commutative, so bitwise the same either way), in place into whichever temporary can hold it."""
    dtype, shape = torch.promote_types(a.dtype, b.dtype), torch.broadcast_shapes(a.shape, b.shape)
    for t, other in ((a, b), (b, a)):
        if t.dtype == dtype and t.shape == shape:
            return t.add_(other)
    return a + b


class InputAffine(nn.Module):
    """Per-channel ``(e + b) * s`` applied to the token embeddings before the first block."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.bias) * self.scale


class RotaryEmbedding(nn.Module):
    """Partial rotary position embedding (rotate-half style) on the leading ``rotary_dim`` channels of a head."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / max(rotary_dim, 1)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_parameters(self) -> None:
        """Recompute the frequency table (buffers on the meta device, or after ``to_empty``)."""
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32,
                                                       device=self.inv_freq.device) / max(self.rotary_dim, 1)))
        with torch.no_grad():
            self.inv_freq.copy_(inv_freq)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin for ``positions`` [B, T] (or [T]), shaped [B, 1, T, rotary_dim] for [B, H, T, D] inputs."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        if emb.dim() == 2:
            emb = emb[None]
        return emb.cos()[:, None], emb.sin()[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading ``cos.shape[-1]`` channels of ``x`` [B, H, T, D]; the rest pass through."""
    rot = cos.shape[-1]
    if rot == 0:
        return x
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1)

