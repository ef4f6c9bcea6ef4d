"""The one switch and device check that every Triton kernel of zaya shares (``zaya.model.fused_norm``,
``zaya.optim.newton_schulz``), and the lazy import of a kernel module.

A kernel runs for a tensor on a CUDA or ROCm device (ROCm answers to "cuda"), not while torch.compile traces (inductor
generates its own kernels there, and a Triton launch would break the graph), and only while ``ENABLED``; each kernel
module adds its own limits (dtypes, shapes). Elsewhere the callers take their torch paths.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Callable

import torch

ENABLED = True
"""Whether zaya's Triton kernels may run at all (set False to force every torch path, e.g. to compare)."""


def triton_device(device: torch.device) -> bool:
    """Whether a Triton kernel may run on ``device`` now: enabled, a GPU, not inside a torch.compile trace."""
    return ENABLED and device.type == "cuda" and not torch.compiler.is_compiling()


def kernel_module(load: Callable[[], ModuleType]) -> Callable[[], ModuleType | None]:
    """``load`` (a function that imports a kernel module, and so triton) made lazy and cached: it runs on the first
    call only, and the result is None where triton does not import."""

    @functools.cache
    def module() -> ModuleType | None:
        try:
            return load()
        except ImportError:
            return None

    module.__doc__ = load.__doc__
    return module
