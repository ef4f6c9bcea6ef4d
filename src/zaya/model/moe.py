"""Experts and dropless token dispatch.

Expert weights are stored stacked, one 3-D tensor per projection per layer, in the layout of the released
checkpoints: ``gate_up_proj`` [E, 2I, D] (gate rows first, then up rows) and ``down_proj`` [E, D, I].

Dispatch never loops over tokens in Python: the (token, slot) assignments are sorted by expert, the tokens
gathered into one contiguous [M, D] block, both projections run as one grouped matmul each over the per-expert
row ranges (``F.grouped_mm``), the result is weighted and scattered back. Assignments to the skip class sort last
and are simply not computed. Where grouped_mm is missing or not supported for the device/dtype, the same sorted
layout is multiplied expert by expert over contiguous slices.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zaya.config import ModelConfig
from zaya.model.layers import swiglu
from zaya.model.router import build_router


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm's backward requires it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.contiguous()


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` is available and known-good for this device and dtype."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    if device.type == "cuda" and torch.version.hip is None:
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return False


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], offsets: torch.Tensor,
                    use_grouped_mm: bool) -> torch.Tensor:
    """Rows of ``x`` [M, in], grouped by expert (``counts``), times ``weight[e].T`` ([E, out, in])."""
    if use_grouped_mm:
        return _ContiguousGrad.apply(F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets))
    outs = []
    start = 0
    for e, count in enumerate(counts):
        if count:
            outs.append(x[start:start + count] @ weight[e].t())
        start += count
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights; ``forward`` runs dropless dispatch over routed tokens."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.hidden_size = cfg.hidden_size
        self.expert_hidden_size = cfg.expert_hidden_size
        self.impl = cfg.moe_impl
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2 * cfg.expert_hidden_size, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, cfg.expert_hidden_size))

    def _use_grouped_mm(self, x: torch.Tensor, dtype: torch.dtype) -> bool:
        if self.impl == "loop":
            return False
        ok = grouped_mm_supported(x.device, dtype)
        if self.impl == "grouped_mm" and not ok:
            raise RuntimeError(f"moe_impl = 'grouped_mm' is not supported on {x.device} with {dtype}; "
                               "use moe_impl = 'auto' or 'loop'")
        return ok

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, D]; experts/weights [N, k]. Returns sum over slots of weight * expert(x), shape [N, D]."""
        n, k = experts.shape
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts_all = torch.bincount(flat, minlength=self.num_experts + 1)
        counts = counts_all[: self.num_experts].tolist()
        routed = sum(counts)
        out = x.new_zeros(n * k, self.hidden_size, dtype=dtype)
        if routed == 0:
            return out.view(n, k, -1).sum(1)
        order = order[:routed]
        tokens = order // k
        xs = x[tokens].to(dtype)
        use_gmm = self._use_grouped_mm(x, dtype)
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32) if use_gmm else None
        h = _grouped_linear(xs, self.gate_up_proj.to(dtype), counts, offsets, use_gmm)
        y = _grouped_linear(swiglu(h), self.down_proj.to(dtype), counts, offsets, use_gmm)
        y = y * weights.reshape(-1)[order, None].to(dtype)
        if routed == n * k:
            out = y[torch.argsort(order)]
        else:
            out = out.index_copy(0, order, y)
        return out.view(n, k, -1).sum(1) if k > 1 else out

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=out_std)


class MoEBlock(nn.Module):
    """Router + experts. Returns the MoE output, the router latent for the next layer and per-class token counts."""

    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.router = build_router(cfg, layer_index)
        self.experts = Experts(cfg)
        self.num_classes = self.router.num_classes

    def forward(self, h: torch.Tensor, prev_latent: torch.Tensor | None,
                token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """h [B, T, D]; token_mask [B, T] (False = padding, left out of the counts)."""
        routing = self.router(h, prev_latent)
        b, t, d = h.shape
        chosen = routing.experts.reshape(b * t, -1)
        out = self.experts(h.reshape(b * t, d), chosen, routing.weights.reshape(b * t, -1))
        counted = chosen if token_mask is None else chosen[token_mask.reshape(-1)]
        counts = torch.bincount(counted.reshape(-1), minlength=self.num_classes)
        return out.view(b, t, d), routing.latent, counts

    def reset_parameters(self, std: float, num_layers: int) -> None:
        self.router.reset_parameters()
        self.experts.reset_parameters(std, std / math.sqrt(2 * num_layers))
