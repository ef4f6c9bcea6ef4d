"""Small building blocks shared by the decoder: RMSNorm, residual scaling, the input affine, partial RoPE."""

from __future__ import annotations

import torch
from torch import nn


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
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

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
        return (branch + self.branch_bias) * self.branch_scale + (residual + self.residual_bias) * self.residual_scale


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

