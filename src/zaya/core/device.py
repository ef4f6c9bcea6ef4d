"""Which device a command runs on, the autocast context for it, and the one map from dtype names to torch dtypes.

Every command and benchmark takes ``--device`` (``train.device`` for training): ``auto`` (the default) is the
best available, a GPU when torch sees one (CUDA, or ROCm, which answers to the same name) and the CPU otherwise.
Under torchrun each process takes the GPU of its ``LOCAL_RANK``.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Callable, ContextManager

import torch

from zaya.core.errors import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The floating-point dtypes zaya computes in and stores weights in, by the name configs and options use."""
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
"""The short names options and reports also use."""
_LONG_NAMES = {short: name for name, short in SHORT_NAMES.items()}


def resolve_device(spec: str = "auto", local_rank: int = 0, what: str = "--device") -> torch.device:
    """The device ``spec`` names: "auto", "cpu", "cuda" (the local rank's GPU), "cuda:N", or "mps"."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"{what} = {spec!r} is not a device; use one of {', '.join(DEVICE_CHOICES)}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{what} = {spec!r} but this torch sees no GPU (torch {torch.__version__}, "
                              f"CUDA {torch.version.cuda}, ROCm {torch.version.hip}); use {what} = cpu or install "
                              "a GPU build of torch (docs/gpu.md)")
        index = local_rank if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ConfigError(f"{what} = {spec!r}: GPU {index} does not exist ({torch.cuda.device_count()} visible)")
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{what} = {spec!r} but MPS is not available on this machine")
    if device.type not in ("cpu", "mps"):
        raise ConfigError(f"{what} = {spec!r}: zaya runs on cpu, cuda (NVIDIA or AMD ROCm) or mps")
    return device


def default_inference_dtype(device: torch.device) -> str:
    """The dtype ``zaya generate``, ``zaya serve`` and ``zaya eval`` run a model in unless ``--dtype`` says
    otherwise: "bfloat16" on a GPU (CUDA, or ROCm under the same name), "float32" elsewhere (a CPU has no fast bf16
    matmul on most machines, and fp32 is what transformers runs an export in by default)."""
    return "bfloat16" if device.type == "cuda" else "float32"


def to_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The torch dtype ``dtype`` names: a torch.dtype as it is, or a name such as "bfloat16", "torch.bfloat16",
    "bf16", "int64". ValueError for a name that is not a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    found = getattr(torch, _LONG_NAMES.get(name, name), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{dtype!r} is not a torch dtype (e.g. float32, bfloat16)")
    return found


def dtype_name(dtype: torch.dtype | str) -> str:
    """torch's name of a dtype, as configs and files write it: torch.bfloat16 or "bf16" -> "bfloat16"."""
    return str(to_dtype(dtype)).removeprefix("torch.")


def short_name(dtype: torch.dtype | str) -> str:
    """The short name reports use: "bf16", "fp32", "fp16" (another dtype by its own name)."""
    name = dtype_name(dtype)
    return SHORT_NAMES.get(name, name)


def autocast(device: torch.device, dtype: str) -> ContextManager:
    """bf16 autocast on ``device`` for ``dtype == "bfloat16"``; nothing for "float32"."""
    if dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def backward_without_autocast(backward: Callable) -> Callable:
    """For a custom ``autograd.Function.backward``: run it with autocast off, in the dtypes of its saved tensors.

    The trainer's backward runs inside its autocast region, and autograd carries that state into custom backwards.
    Autocast's op lists differ by device: CUDA's computes ``sum``, ``pow``, ``exp``... in fp32 (the CPU's does
    not), so a backward written for bf16 operands gets an fp32 intermediate on a GPU only (``index_copy_`` into a
    bf16 buffer then fails). The backwards pick their dtypes explicitly; autocast has no say in them.
    """

    @functools.wraps(backward)
    def run(ctx, *grads):
        device = next((g.device.type for g in grads if isinstance(g, torch.Tensor)), "cpu")
        with torch.autocast(device, enabled=False):
            return backward(ctx, *grads)

    run.autocast_off = True  # a mark tests check every custom backward for
    return run


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU); for timing only, never inside a training step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
