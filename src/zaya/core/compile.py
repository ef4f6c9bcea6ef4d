"""What the training and serving sides share about ``torch.compile``: when "auto" compiles, and where inductor keeps
its compiled code.

"auto" compiles on GPUs (CUDA, or ROCm under the same name) and not on the CPU: there inductor's first compile of
a block or a decode step takes minutes on a few cores (docs/training.md "Compiled blocks", docs/serving.md). The
compiled graphs persist in inductor's on-disk caches (FX graph and AOTAutograd caches) under
``<zaya cache>/inductor`` (``$ZAYA_CACHE_DIR``, else ``~/.cache/zaya``; ``$TORCHINDUCTOR_CACHE_DIR`` when set wins),
so a second run, a resume or a restarted server with the same shapes skips the code generation and C++ compile.
"""

from __future__ import annotations

import os

import torch

from zaya.core.fsutil import cache_root

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Inductor's cache directory variable; zaya sets it (to ``<zaya cache>/inductor``) only when it is unset."""
CHOICES = ("auto", "on", "off")


def compile_wanted(choice: str, device: torch.device) -> bool:
    """A compile choice (``train.compile``, ``zaya serve --compile``) on ``device``: "auto" compiles on GPUs and
    not on the CPU; "on" / "off" as they say."""
    if choice == "auto":
        return device.type == "cuda"
    return choice == "on"


def use_compile_cache() -> None:
    """Point inductor's caches at ``<zaya cache>/inductor`` unless ``$TORCHINDUCTOR_CACHE_DIR`` says otherwise."""
    os.environ.setdefault(CACHE_ENV, str(cache_root() / "inductor"))


def failure_cause(err: BaseException) -> str:
    """"Type: first line" of why compiling failed: the backend's own error under dynamo's wrapper, if any."""
    inner = getattr(err, "inner_exception", None) or err
    return f"{type(inner).__name__}: {(str(inner).strip().splitlines() or [''])[0]}"
