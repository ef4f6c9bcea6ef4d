"""Experts and dropless token dispatch.

Expert weights are stored stacked, one 3-D tensor per projection per layer, in the layout of the released
checkpoints: ``gate_up_proj`` [E, 2I, D] (gate rows first, then up rows) and ``down_proj`` [E, D, I].

Dispatch never loops over tokens in Python and never reads a value back to the host: the N * k (token, slot)
assignments are sorted by class (stable; the skip class sorts last), the tokens gathered into one contiguous
[N * k, D] block, both projections run as one grouped matmul each (``F.grouped_mm``) with int32 row offsets, the
cumulative per-expert counts computed on the device, and the result is scattered back to assignment order and
weighted. Every shape is static (N * k rows whatever the routing), so nothing waits for the device and the experts
are always part of the autograd graph (DDP needs a gradient for every parameter on every rank, also on a rank whose
tokens all went to the skip class).

Rows past the last offset (the skipped assignments) are not computed: ``F.grouped_mm`` leaves them uninitialised
(garbage, NaN or 1e38 included), in the forward output and in the input gradient alike. They are zeroed, with a
device-side mask, where they could reach a result: the down projection's output before combining, and the gradient
flowing back into ``x`` (the dispatch's backward). The rows in between (the gate/up output and SwiGLU, the down
projection's input gradient) may hold garbage in those rows; nothing reads it. The grouped weight-gradient GEMM can
leave an empty expert's gradient uninitialised on some GPUs, so it is masked with ``counts == 0`` as well.

The gather/scatter, SwiGLU and grouped matmul have small hand-written backwards (the same arithmetic as autograd's;
only the k > 1 sum of a token's slot gradients may round differently): the row permutations' backwards are
gathers/copies with distinct indices instead of accumulating scatters (``index_put_`` with accumulate, serial on
CPU), the mixing weights are applied while scattering back (no extra [N, D] tensor), and the SwiGLU backward writes
the gate and up gradients into one buffer instead of concatenating them. On CPU these memory-bound steps otherwise
add ~10% to the expert matmuls at the ZAYA1-base shape (see benchmarks/moe_block.py and benchmarks/results.md).

``moe_impl = "loop"`` is the reference: the same sorted layout multiplied expert by expert over contiguous slices.
It reads the per-expert counts to the host (one sync per layer) and is not meant for training on a GPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from zaya.config import ModelConfig
from zaya.core.device import backward_without_autocast
from zaya.model.router import build_router


CPU_EXPERTS_IN_WEIGHT_DTYPE = True
"""Under autocast on a CPU, the experts' GEMMs run in the weights' dtype (``Experts._gemm_dtype``). The activation
trace (``zaya.tune.activation_trace``), which models a GPU's autocast on the CPU, turns it off."""


class _DispatchRows(torch.autograd.Function):
    """``x[dest // k]``: gather the (token, slot) assignments in expert order, rows ``[M, D]``.

    ``dest`` holds each sorted row's flat assignment index ``token * k + slot``. The backward writes every row's
    gradient to its assignment (``index_copy_``, the indices are distinct, so no accumulating scatter) and sums a
    token's k slots. Skipped assignments get zero: either they are not among the rows (``dest`` shorter than N * k,
    the loop reference), or ``skipped`` [N * k] (bool) marks them and their rows' gradient, which the grouped GEMMs
    leave uninitialised, is overwritten with zeros.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, dest: torch.Tensor, k: int,  # noqa: D102
                skipped: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(dest, skipped)
        ctx.n, ctx.k = x.shape[0], k
        return x.index_select(0, dest // k if k > 1 else dest)

    @staticmethod
    @once_differentiable
    @backward_without_autocast
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        dest, skipped = ctx.saved_tensors
        slots = ctx.n * ctx.k
        full = grad.new_empty(slots, grad.shape[1]) if dest.numel() == slots else grad.new_zeros(slots, grad.shape[1])
        full.index_copy_(0, dest, grad)
        if skipped is not None:
            full.masked_fill_(skipped[:, None], 0)
        return (full.view(ctx.n, ctx.k, -1).sum(1) if ctx.k > 1 else full), None, None, None


class _CombineRows(torch.autograd.Function):
    """Inverse of the dispatch, fused with the mixing weights: ``out[dest[p]] = y[p] * weights[dest[p]]``.

    ``y`` [M, D] holds the sorted rows, ``weights`` [N * k] the mixing weight of every assignment (in y's dtype);
    the result is [N * k, D] in assignment order, zero for skipped assignments (their rows of ``y`` are zero, or
    absent when ``dest`` is shorter than N * k). Same products as ``combined * weights[:, None]``, without the
    intermediate tensor; the backward gathers the incoming gradient once into sorted order and gets both gradients
    from it.
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(y, weights, dest)
        slots = weights.shape[0]
        out = y.new_empty(slots, y.shape[1]) if dest.numel() == slots else y.new_zeros(slots, y.shape[1])
        return out.index_copy_(0, dest, y).mul_(weights[:, None])

    @staticmethod
    @once_differentiable
    @backward_without_autocast
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
    @backward_without_autocast
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        if torch.compiler.is_compiling():
            # dynamo traces no out= into a strided view; the same products, concatenated (inductor fuses them).
            return torch.cat((torch.ops.aten.silu_backward(grad * up, gate), F.silu(gate) * grad), dim=-1)
        grad_h = torch.empty_like(h)
        grad_gate, grad_up = grad_h.chunk(2, dim=-1)
        torch.ops.aten.silu.out(gate, out=grad_up)
        grad_up.mul_(grad)
        torch.mul(grad, up, out=grad_gate)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_h


@torch.library.custom_op("zaya::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm(a, b, offs=offsets)`` as an opaque op for ``torch.compile``: aten's own grouped_mm has no
    fake-tensor kernel for fp32 on the CPU, so dynamo cannot trace it there; this op's fake says only the shape."""
    return F.grouped_mm(a, b, offs=offsets)


@_grouped_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:  # [M, K] x [E, K, N] -> [M, N]
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[1])  # [K, M] x [M, N] grouped over M -> [E, K, N]


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm`` with int32 cumulative row ``offsets``; under ``torch.compile`` in a dtype whose aten fake
    kernel is missing (fp32), through ``zaya::grouped_mm``. Eager calls aten directly (no custom-op dispatch)."""
    if torch.compiler.is_compiling() and a.dtype != torch.bfloat16:
        return _grouped_mm_op(a, b, offsets)
    return F.grouped_mm(a, b, offs=offsets)


class _GroupedLinear(torch.autograd.Function):
    """Rows of ``x`` [M, in] grouped by expert (cumulative row ``offsets``) times ``weight[e].T`` ([E, out, in]).

    Forward and both backward products are single ``F.grouped_mm`` calls, the weight gradient (``grad.T @ x``,
    grouped over rows) in the parameter's own [E, out, in] layout. The incoming gradient is made contiguous, as
    grouped_mm's backward requires. ``empty`` [E] (bool) marks the experts with no rows: their weight gradient is
    set to zero (a grouped GEMM may leave an empty group uninitialised). ``tail`` [M] (bool), when given, marks the
    rows past ``offsets[-1]``: their output, which grouped_mm leaves uninitialised, is set to zero. (The gradient of
    those rows is never read: neither product of the backward uses rows outside the groups.)
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,  # noqa: D102
                empty: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offsets, empty)
        out = _grouped_mm(x, weight.transpose(-2, -1), offsets)
        return out if tail is None else out.masked_fill_(tail[:, None], 0)

    @staticmethod
    @once_differentiable
    @backward_without_autocast
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        x, weight, offsets, empty = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _grouped_mm(grad, weight, offsets) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = _grouped_mm(grad.t(), x, offsets).masked_fill_(empty[:, None, None], 0)
        return grad_x, grad_w, None, None, None


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` is available and known-good for this device and dtype.

    CPU: fp32 and bf16. GPUs: bf16 on NVIDIA compute capability 8.0+ (9.0/10.x run CUTLASS kernels; others torch's
    fallback, a loop of GEMMs that reads the offsets to the host inside the op) and on every ROCm GPU (CK kernels on
    gfx942/gfx950, the same fallback elsewhere).
    """
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return False
        return torch.version.hip is not None or torch.cuda.get_device_capability(device) >= (8, 0)
    return False


def _loop_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Reference for ``_GroupedLinear``: rows of ``x`` grouped by expert (host ``counts``, at least one row in all),
    times ``weight[e].T``, one matmul per non-empty expert. ``split``/``unbind`` rather than slicing and indexing,
    so the backward assembles one [M, in] and one [E, out, in] gradient instead of zero-filling a full-size
    gradient per expert. Autocast off: both operands come in the experts' dtype (``Experts._gemm_dtype``), as
    grouped_mm, which has no autocast rule, takes them."""
    with torch.autocast(x.device.type, enabled=False):
        outs = [rows @ w.t() for rows, w, count in zip(x.split(counts), weight.unbind(0), counts) if count]
    return torch.cat(outs)


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights; ``forward`` runs dropless dispatch over routed tokens."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.hidden_size = cfg.hidden_size
        self.expert_hidden_size = cfg.expert_hidden_size
        self.impl = cfg.moe_impl
        # Whether assignments to the skip class (== num_experts) can occur; without one no row is ever skipped and
        # the masks that zero skipped rows are left out.
        self.has_skip = cfg.num_router_classes > cfg.num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2 * cfg.expert_hidden_size, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, cfg.expert_hidden_size))
        self.dispatcher = None
        """The seam for experts held on other ranks (``zaya.distributed.expert_parallel``): when set, ``forward``
        is ``dispatcher(self, x, experts, weights)``, which runs this rank's experts with ``run_grouped``."""

    def _use_grouped_mm(self, x: torch.Tensor, dtype: torch.dtype) -> bool:
        if self.impl == "loop":
            return False
        ok = grouped_mm_supported(x.device, dtype)
        if self.impl == "grouped_mm" and not ok:
            raise RuntimeError(f"moe_impl = 'grouped_mm' is not supported on {x.device} with {dtype}; "
                               "use moe_impl = 'auto' or 'loop'")
        # grouped_mm wants every row stride a multiple of 16 bytes (all its operands and gradients have rows of
        # hidden_size, expert_hidden_size or 2 * expert_hidden_size elements); "auto" takes the loop otherwise.
        size = dtype.itemsize
        aligned = (self.hidden_size * size) % 16 == 0 and (self.expert_hidden_size * size) % 16 == 0
        if ok and not aligned:
            if self.impl == "grouped_mm":
                raise RuntimeError(f"moe_impl = 'grouped_mm' needs hidden_size ({self.hidden_size}) and "
                                   f"expert_hidden_size ({self.expert_hidden_size}) to be multiples of "
                                   f"{16 // size} for {dtype}; use moe_impl = 'auto' or 'loop'")
            return False
        return ok

    def _gemm_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The experts' compute dtype: autocast's where it is on, else x's; but on a CPU under autocast the weights'
        (fp32), as transformers' grouped_mm path does. A CPU runs a grouped GEMM as one matmul per expert, with row
        counts that change every step; a bf16 matmul there goes through oneDNN, which builds a kernel per new shape,
        and these bf16 expert matmuls are where zaya's aten::mm time went 3.3x transformers' on an AMX Xeon
        (benchmarks/results.md, "GEMM dtypes")."""
        if not torch.is_autocast_enabled(x.device.type):
            return x.dtype
        if x.device.type == "cpu" and CPU_EXPERTS_IN_WEIGHT_DTYPE:
            return torch.promote_types(x.dtype, self.gate_up_proj.dtype)
        return torch.get_autocast_dtype(x.device.type)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, D]; experts/weights [N, k] (class ``num_experts`` = skip: zero output, zero gradient).

        Returns the sum over slots of weight * expert(x), shape [N, D]."""
        if self.dispatcher is not None:
            return self.dispatcher(self, x, experts, weights)
        n, k = experts.shape
        e = self.num_experts
        dtype = self._gemm_dtype(x)
        flat = experts.reshape(-1)
        # Per-class counts on the device (no bincount: on a GPU it reads the maximum back to size its output).
        counts = torch.zeros(e + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        counts = counts[:e]
        # Assignments sorted by class (stable: token order within an expert); the skip class sorts last.
        order = torch.argsort(flat, stable=True)
        if not self._use_grouped_mm(x, dtype):
            return self._loop(x, order, counts, weights, k, dtype)
        offsets = counts.cumsum(0).to(torch.int32)
        tail = skipped = None
        if self.has_skip:
            tail = torch.arange(flat.numel(), device=flat.device) >= offsets[-1]  # sorted rows past the experts'
            skipped = flat >= e  # the same assignments, in assignment order
        empty = counts == 0
        xs = _DispatchRows.apply(x, order, k, skipped).to(dtype)
        h = _GroupedLinear.apply(xs, self.gate_up_proj.to(dtype), offsets, empty, None)
        y = _GroupedLinear.apply(_SwiGLU.apply(h), self.down_proj.to(dtype), offsets, empty, tail)
        out = _CombineRows.apply(y, weights.reshape(-1).to(dtype), order)
        return out.view(n, k, -1).sum(1) if k > 1 else out

    def _loop(self, x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor, k: int,
              dtype: torch.dtype) -> torch.Tensor:
        """The reference path: reads ``counts`` to the host and multiplies expert by expert over the routed rows."""
        n = x.shape[0]
        host_counts = counts.tolist()
        routed = sum(host_counts)
        if routed == 0:
            # Nothing routed: a zero output that still depends on both weight stacks and on the mixing weights (zero
            # gradients), so that the experts and the router stay in the autograd graph, as on the grouped_mm path
            # (DDP expects a gradient for every parameter on every rank).
            anchor = (self.gate_up_proj.reshape(-1)[0] + self.down_proj.reshape(-1)[0]).to(dtype) * 0
            anchor = anchor + weights.sum().to(dtype) * 0
            return x.new_zeros(n, self.hidden_size, dtype=dtype) + anchor
        dest = order[:routed]  # the skip class sorts last and is cut
        xs = _DispatchRows.apply(x, dest, k, None).to(dtype)
        h = _loop_linear(xs, self.gate_up_proj.to(dtype), host_counts)
        y = _loop_linear(_SwiGLU.apply(h), self.down_proj.to(dtype), host_counts)
        out = _CombineRows.apply(y, weights.reshape(-1).to(dtype), dest)
        return out.view(n, k, -1).sum(1) if k > 1 else out

    def run_grouped(self, xs: torch.Tensor, counts: torch.Tensor, host_counts: list[int]) -> torch.Tensor:
        """The experts this module holds over rows ``xs`` [M, D] already grouped by expert (``counts`` [E_held] on
        the device, ``host_counts`` the same on the host), in the experts' compute dtype; [M, D]. The
        expert-parallel dispatcher's compute step (every row is routed: no skipped tail). With M = 0 the empty result
        still depends on ``xs``, so that a backward passes through whatever produced it."""
        dtype = self._gemm_dtype(xs)
        xs = xs.to(dtype)
        if not sum(host_counts):
            return xs * 0
        if self._use_grouped_mm(xs, dtype):
            offsets, empty = counts.cumsum(0).to(torch.int32), counts == 0
            h = _GroupedLinear.apply(xs, self.gate_up_proj.to(dtype), offsets, empty, None)
            return _GroupedLinear.apply(_SwiGLU.apply(h), self.down_proj.to(dtype), offsets, empty, None)
        h = _loop_linear(xs, self.gate_up_proj.to(dtype), host_counts)
        return _loop_linear(_SwiGLU.apply(h), self.down_proj.to(dtype), host_counts)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=out_std)


class MoEBlock(nn.Module):
    """Router + experts. Returns the MoE output, the router latent for the next layer, per-class token counts and,
    when ``router_aux_loss_coef`` > 0, the layer's auxiliary load-balancing loss."""

    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.router = build_router(cfg, layer_index)
        self.experts = Experts(cfg)
        self.num_classes = self.router.num_classes
        self.aux_loss = cfg.router_aux_loss_coef > 0

    def forward(self, h: torch.Tensor, prev_latent: torch.Tensor | None, token_mask: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """h [B, T, D]; token_mask [B, T] (False = padding, left out of the counts and the auxiliary loss)."""
        routing = self.router(h, prev_latent)
        b, t, d = h.shape
        chosen = routing.experts.reshape(b * t, -1)
        out = self.experts(h.reshape(b * t, d), chosen, routing.weights.reshape(b * t, -1))
        # Counts on the device: a scatter-add of one per assignment (zero for padding); no bincount, no mask indexing.
        flat = chosen.reshape(-1)
        valid = None if token_mask is None else token_mask.reshape(-1, 1).to(torch.float32)
        ones = torch.ones_like(flat) if valid is None else valid.expand_as(chosen).reshape(-1).to(flat.dtype)
        counts = torch.zeros(self.num_classes, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, ones)
        aux = None
        if self.aux_loss and torch.is_grad_enabled():
            aux = switch_balancing_loss(routing.probs.reshape(b * t, -1), counts, self.router.num_experts, valid)
        return out.view(b, t, d), routing.latent, counts, aux

    def reset_parameters(self, std: float, num_layers: int) -> None:
        self.router.reset_parameters()
        self.experts.reset_parameters(std, std / math.sqrt(2 * num_layers))


def switch_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, num_experts: int,
                          valid: torch.Tensor | None = None) -> torch.Tensor:
    """The conventional auxiliary load-balancing loss (Switch Transformer): E * sum_e f_e * P_e over the real
    experts, f_e the share of the layer's assignments that went to expert e (counts, no gradient) and P_e the mean
    router probability of e over the tokens; 1.0 when both are uniform. ``probs`` [N, classes]; ``valid`` [N, 1]
    (1 = a real token) leaves padding out of P_e as the counts already leave it out of f_e."""
    real = counts[:num_experts].to(probs.dtype)
    f = real / counts.sum().clamp(min=1).to(probs.dtype)
    if valid is None:
        mean_probs = probs[:, :num_experts].mean(0)
    else:
        mean_probs = (probs[:, :num_experts] * valid).sum(0) / valid.sum().clamp(min=1)
    return num_experts * (f * mean_probs).sum()
