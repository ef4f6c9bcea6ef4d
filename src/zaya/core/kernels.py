"""The one switch and device check that every Triton kernel of zaya shares (``zaya.model.fused_norm``,
``zaya.optim.newton_schulz``), and the lazy import of a kernel module.

A kernel runs for a tensor on a CUDA or ROCm device (ROCm answers to "cuda"), not while torch.compile traces (inductor
generates its own kernels there, and a Triton launch would break the graph), and only while ``ENABLED``; each kernel
module adds its own limits (dtypes, shapes). Elsewhere the callers take their torch paths.

A kernel that fails where it runs (Triton's compiler on an untested GPU or version, too little shared memory for its
tiles, a launch error) must not end a run that its torch path would finish: ``guarded`` runs it, and on a failure
warns once, naming the kernel and the cause, switches that kernel off for the rest of the process (``failed``) and
returns the torch path's result. Running out of GPU memory is not a kernel failure and is raised as it is.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType
from typing import Callable, TypeVar

import torch

ENABLED = True
"""Whether zaya's Triton kernels may run at all (set False to force every torch path, e.g. to compare)."""


failed: dict[str, str] = {}
"""Kernels switched off by a failure in this process, by name, with the failure (``guarded``)."""
T = TypeVar("T")


def triton_device(device: torch.device, name: str) -> bool:
    """Whether the Triton kernel ``name`` may run on ``device`` now: enabled, a GPU, not inside a torch.compile
    trace, and it has not failed in this process."""
    return ENABLED and device.type == "cuda" and not torch.compiler.is_compiling() and name not in failed


def guarded(name: str, kernel: Callable[[], T], fallback: Callable[[], T]) -> T:
    """``kernel()``, or where it raises anything but an out-of-memory error, ``fallback()`` (the torch path) after
    ``switch_off(name, error)``."""
    try:
        return kernel()
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of a kernel: its torch path computes the same
        switch_off(name, err)
    return fallback()


def switch_off(name: str, err: BaseException) -> None:
    """Record that the kernel ``name`` failed (so ``triton_device`` refuses it from now on) and warn once."""
    first = (str(err).strip().splitlines() or [""])[0][:300]
    failed[name] = f"{type(err).__name__}: {first}"
    warnings.warn(f"zaya: the Triton kernel '{name}' failed ({failed[name]}); it is switched off for the rest of "
                  "this process and its torch path computes the same result. Please report it with the GPU's name "
                  "and the torch and triton versions (zaya.core.kernels.ENABLED = False skips every kernel).",
                  RuntimeWarning, stacklevel=3)


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
