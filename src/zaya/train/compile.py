"""Regional compilation of the decoder (``train.compile``): every block compiled on its own with ``torch.compile``
(torchtitan's per-block compilation), and the loss as one more region (``zaya.model.loss.fused_cross_entropy``:
inductor fuses it into a row reduction forward and one pass backward, where the eager loss loops over row chunks),
forward and backward, with the eager trainer as the fallback.

Per block rather than the whole model: the blocks of one kind share one graph (parameters are graph inputs), so
compile time does not grow with depth, and what lies between the regions (the embedding, the head's GEMM, the
optimizers, the collectives) stays eager. Shapes are static (``dynamic=False``): a training run sees a
few fixed shapes (its micro-batch, the validation batch, the routing probe's one sequence), each compiled once;
dynamic shapes would recompile on the second and run slower kernels.

Compiled graphs persist in inductor's on-disk caches (FX graph and AOTAutograd caches) under
``<zaya cache>/inductor`` (``$ZAYA_CACHE_DIR``, else ``~/.cache/zaya``; ``$TORCHINDUCTOR_CACHE_DIR`` when set wins),
so a second run or a resume of the same shapes skips inductor's code generation and C++ compile.

A compilation that fails (an inductor error, no working C++ compiler, a dynamo error) does not end the run: the
trainer logs one warning naming the cause, puts the blocks back to eager and redoes the step (or validation) that
hit it (``CompiledBlocks.run``).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
from torch import nn
from torch._dynamo.exc import TorchDynamoException

from zaya.core.compile import failure_cause, use_compile_cache
from zaya.model.loss import cross_entropy, fused_cross_entropy

BACKEND = "inductor"
"""The ``torch.compile`` backend of the blocks (tests swap in a cheaper one that traces the same graphs)."""
RECOMPILE_LIMIT = 64
"""Compiled variants dynamo keeps of one function before it runs further ones eagerly (its default, 8, is too few
here): every block shares ``Block.forward``, and a run needs one variant per block kind (two) and shape (training,
validation, the routing probe) of each ``[[stages]]`` shape."""
T = TypeVar("T")


class CompiledBlocks:
    """The model's blocks and loss under ``torch.compile``, and the way back to eager when compiling fails."""

    def __init__(self, model: nn.Module, log: Callable[[str], None]) -> None:
        self.model, self.log = model, log
        self.active = True
        use_compile_cache()
        limits = torch._dynamo.config
        limits.recompile_limit = max(limits.recompile_limit, RECOMPILE_LIMIT)
        for block in model.blocks:
            block.compile(backend=BACKEND, dynamic=False)
        model.cross_entropy = torch.compile(fused_cross_entropy, backend=BACKEND, dynamic=False)

    def run(self, work: Callable[[], T]) -> T:
        """``work()``; if compiling one of its graphs fails: one warning, every region eager again, gradients
        cleared, and ``work()`` once more."""
        if not self.active:
            return work()
        try:
            return work()
        except TorchDynamoException as err:
            self.log(f"warning: train.compile: compiling the blocks or the loss failed ({failure_cause(err)}); "
                     "training eagerly. Set train.compile = \"off\" to skip the attempt")
            self.uncompile()
            self.model.zero_grad(set_to_none=True)
            return work()

    def uncompile(self) -> None:
        """Every block back to its eager forward (``nn.Module.compile`` keeps the compiled call in
        ``_compiled_call_impl``; None is its eager state), and the loss to the chunked eager one."""
        for block in self.model.blocks:
            block._compiled_call_impl = None
        self.model.cross_entropy = cross_entropy
        self.active = False
