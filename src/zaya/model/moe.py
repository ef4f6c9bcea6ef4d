"""Experts and dropless token dispatch.

Expert weights are stored stacked, one 3-D tensor per projection per layer, in the layout of the released
checkpoints: ``gate_up_proj`` [E, 2I, D] (gate rows first, then up rows) and ``down_proj`` [E, D, I].

Dispatch never loops over tokens in Python: the (token, slot) assignments are sorted by expert, the tokens
gathered into one contiguous [M, D] block, both projections run as one grouped matmul each over the per-expert
row ranges (``F.grouped_mm``), the result is scattered back to token order and weighted. Assignments to the skip
class sort last and are simply not computed. Where grouped_mm is missing or not supported for the device/dtype, the
same sorted layout is multiplied expert by expert over contiguous slices.

The gather/scatter, SwiGLU and grouped matmul have small hand-written backwards (the same arithmetic as autograd's;
only the k > 1 sum of a token's slot gradients may round differently): the row permutations' backwards are
gathers/copies with distinct indices instead of accumulating scatters (``index_put_`` with accumulate, serial on
CPU), the mixing weights are applied while scattering back (no extra [N, D] tensor), the SwiGLU backward writes the
gate and up gradients into one buffer instead of concatenating them, and no [N * k, D] zero tensor is allocated
unless some assignment is skipped. On CPU these memory-bound steps otherwise add ~10% to the expert matmuls at the
ZAYA1-base shape (see benchmarks/moe_block.py and benchmarks/results.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from zaya.config import ModelConfig
from zaya.model.router import build_router


class _DispatchRows(torch.autograd.Function):
    """``x[tokens]``: gather the routed (token, slot) assignments in expert order, rows ``[M, D]``.

    ``dest`` holds each sorted row's flat assignment index ``token * k + slot``. The backward writes every row's
    gradient to its assignment (``index_copy_``, the indices are distinct, so no accumulating scatter) and sums a
    token's k slots; assignments to the skip class get zero.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, tokens: torch.Tensor, dest: torch.Tensor, k: int) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(dest)
        ctx.n, ctx.k = x.shape[0], k
        return x.index_select(0, tokens)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        (dest,) = ctx.saved_tensors
        slots = ctx.n * ctx.k
        full = grad.new_empty(slots, grad.shape[1]) if dest.numel() == slots else grad.new_zeros(slots, grad.shape[1])
        full.index_copy_(0, dest, grad)
        return (full.view(ctx.n, ctx.k, -1).sum(1) if ctx.k > 1 else full), None, None, None


class _CombineRows(torch.autograd.Function):
    """Inverse of the dispatch, fused with the mixing weights: ``out[dest[p]] = y[p] * weights[dest[p]]``.

    ``y`` [M, D] holds the sorted rows, ``weights`` [N * k] the mixing weight of every assignment (in y's dtype);
    the result is [N * k, D] in assignment order, zero for skipped assignments. Same products as ``combined *
    weights[:, None]``, without the intermediate tensor; the backward gathers the incoming gradient once into sorted
    order and gets both gradients from it.
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(y, weights, dest)
        slots = weights.shape[0]
        out = y.new_empty(slots, y.shape[1]) if dest.numel() == slots else y.new_zeros(slots, y.shape[1])
        return out.index_copy_(0, dest, y).mul_(weights[:, None])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        y, weights, dest = ctx.saved_tensors
        g = grad.index_select(0, dest)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = weights.new_zeros(weights.shape[0]).index_copy_(0, dest, (g * y).sum(-1))
        grad_y = g.mul_(weights.index_select(0, dest)[:, None]) if ctx.needs_input_grad[0] else None
        return grad_y, grad_w, None


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` on a packed [M, 2I] tensor (same kernels and rounding as the unfused ops).

    Saves only the packed input; the backward writes the gate and up gradients straight into one [M, 2I] buffer
    (no concatenation) and recomputes silu(gate) instead of keeping it alive between forward and backward.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(h)
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        grad_h = torch.empty_like(h)
        grad_gate, grad_up = grad_h.chunk(2, dim=-1)
        torch.ops.aten.silu.out(gate, out=grad_up)
        grad_up.mul_(grad)
        torch.mul(grad, up, out=grad_gate)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_h


class _GroupedLinear(torch.autograd.Function):
    """Rows of ``x`` [M, in] grouped by expert (cumulative row ``offsets``) times ``weight[e].T`` ([E, out, in]).

    Forward and both backward products are single ``F.grouped_mm`` calls, the weight gradient (``grad.T @ x``,
    grouped over rows) in the parameter's own [E, out, in] layout. The incoming gradient is made contiguous, as
    grouped_mm's backward requires.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(x, weight, offsets)
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        x, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = F.grouped_mm(grad, weight, offs=offsets) if ctx.needs_input_grad[0] else None
        grad_w = F.grouped_mm(grad.t(), x, offs=offsets) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` is available and known-good for this device and dtype."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    if device.type == "cuda" and torch.version.hip is None:
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return False


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], offsets: torch.Tensor | None,
                    use_grouped_mm: bool) -> torch.Tensor:
    """Rows of ``x`` [M, in], grouped by expert (``counts``), times ``weight[e].T`` ([E, out, in])."""
    if use_grouped_mm:
        return _GroupedLinear.apply(x, weight, offsets)
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
        counts_all = torch.bincount(flat, minlength=self.num_experts + 1)
        counts = counts_all[: self.num_experts].tolist()
        routed = sum(counts)
        if routed == 0:
            return x.new_zeros(n, self.hidden_size, dtype=dtype)
        # Assignments sorted by expert (stable: token order within an expert); the skip class sorts last and is cut.
        dest = torch.argsort(flat, stable=True)[:routed]
        tokens = dest // k if k > 1 else dest
        xs = _DispatchRows.apply(x, tokens, dest, k).to(dtype)
        use_gmm = self._use_grouped_mm(x, dtype)
        offsets = counts_all[: self.num_experts].cumsum(0).to(torch.int32) if use_gmm else None
        h = _grouped_linear(xs, self.gate_up_proj.to(dtype), counts, offsets, use_gmm)
        y = _grouped_linear(_SwiGLU.apply(h), self.down_proj.to(dtype), counts, offsets, use_gmm)
        out = _CombineRows.apply(y, weights.reshape(-1).to(dtype), dest)
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
