"""Residual scaling and RMSNorm in fused Triton kernels on a GPU, the modules' torch functions elsewhere.

Inside a block the attention's output joins the residual stream through ``attn_residual`` and the result goes
straight into ``moe_norm``: in eager torch that is about ten kernels each way, every one re-reading the activation.
``residual_norm`` computes both in one pass over the rows (``zaya.model.fused_norm_triton``); ``join_residual``
(the MoE output's join) and ``rms_norm`` (a block's attention norm, the final norm) are the two halves alone, one
kernel each way instead of five to eight. The kernels are taken where they help: a CUDA or ROCm tensor, triton
importable, not while torch.compile traces (inductor fuses the same ops itself; these three are
``zaya.core.kernels``'s, shared by every Triton kernel) and rows no wider than ``fused_norm_triton.MAX_COLS``. Set
``zaya.core.kernels.ENABLED = False`` to force the torch path everywhere. Should a kernel fail (forward here, backward
in its autograd function), the torch path computes that result and every later one (``zaya.core.kernels.guarded``).
"""

from __future__ import annotations

from types import ModuleType

import torch

from zaya.core.kernels import guarded, kernel_module, triton_device
from zaya.model.layers import ResidualScale, RMSNorm


@kernel_module
def _kernels() -> ModuleType:
    """The kernel module, or None where triton does not import (imported on the first GPU tensor only)."""
    from zaya.model import fused_norm_triton

    return fused_norm_triton


KERNEL = "fused_residual_norm"
"""The kernels' name for ``zaya.core.kernels`` (one switch-off for all three: they share their source)."""


def uses_triton(x: torch.Tensor) -> bool:
    """Whether ``residual_norm`` takes the Triton kernels for a branch ``x``."""
    if x.numel() == 0 or not triton_device(x.device, KERNEL):
        return False
    kernels = _kernels()
    return kernels is not None and x.shape[-1] <= kernels.MAX_COLS


def residual_norm(scale: ResidualScale, branch: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                  residual_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(``scale(branch, residual)`` cast to ``residual_dtype``: the new residual stream, ``norm`` of it cast to the
    norm's dtype): fused on a GPU (see the module), the torch path elsewhere."""
    def torch_path() -> tuple[torch.Tensor, torch.Tensor]:
        res = scale(branch, residual).to(residual_dtype)
        return res, norm(res.to(norm.weight.dtype))

    if uses_triton(branch):
        return guarded(KERNEL, lambda: _kernels().ResidualNormFunction.apply(
            branch, residual, scale.branch_bias, scale.branch_scale, scale.residual_bias, scale.residual_scale,
            norm.weight, norm.eps, residual_dtype), torch_path)
    return torch_path()


def join_residual(scale: ResidualScale, branch: torch.Tensor, residual: torch.Tensor,
                  residual_dtype: torch.dtype) -> torch.Tensor:
    """``scale(branch, residual)`` cast to ``residual_dtype``: fused on a GPU, the torch path elsewhere."""
    if uses_triton(branch):
        return guarded(KERNEL, lambda: _kernels().ResidualFunction.apply(
            branch, residual, scale.branch_bias, scale.branch_scale, scale.residual_bias, scale.residual_scale,
            residual_dtype), lambda: scale(branch, residual).to(residual_dtype))
    return scale(branch, residual).to(residual_dtype)


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for ``x`` in the norm's dtype (as the model passes it): fused on a GPU, the torch path
    elsewhere."""
    if x.dtype == norm.weight.dtype and uses_triton(x):
        return guarded(KERNEL, lambda: _kernels().NormFunction.apply(x, norm.weight, norm.eps), lambda: norm(x))
    return norm(x)
