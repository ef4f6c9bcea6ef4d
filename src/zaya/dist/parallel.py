"""Data parallelism: DDP, DDP with a ZeRO-1 sharded optimizer, and FSDP2, behind one small interface.

* ``ddp``: gradients all-reduced by DistributedDataParallel; every rank runs the whole optimizer, except Muon's
  Newton-Schulz: each matrix is orthogonalised by one rank and the results are broadcast (``optim.muon_distributed``).
* ``zero1``: gradients as DDP, but each rank owns a disjoint, size-balanced subset of the parameters, keeps
  optimizer state only for those and updates only those; owners then broadcast their updated parameters. Optimizer
  memory (and Muon's Newton-Schulz work) falls as 1/world. This is what ZAYA1 trained with.
* ``fsdp``: FSDP2 ``fully_shard`` on every block and the root; parameters, gradients and optimizer state are
  sharded DTensors.

A single process (no process group) gets the bare model whichever mode is configured.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from zaya.dist.runtime import Runtime


@dataclass
class Parallel:
    """The wrapped model and what the training loop needs to drive it."""

    mode: str
    module: nn.Module          # what to call forward on (DDP / FSDP / the bare model)
    model: nn.Module           # the underlying ZayaForCausalLM (its parameters may be DTensors under FSDP)
    runtime: Runtime
    owner: dict[int, int] = field(default_factory=dict)   # zero1: id(param) -> owning rank

    def owned(self, params: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
        """The parameters this rank's optimizer steps (all of them except under zero1)."""
        if self.mode != "zero1" or not self.runtime.distributed:
            return params
        return [(n, p) for n, p in params if self.owner[id(p)] == self.runtime.rank]

    @contextmanager
    def accumulating(self, is_last: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on all but the last micro-batch of a step."""
        if not self.runtime.distributed or is_last:
            yield
            return
        if self.mode == "fsdp":
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)
            return
        with self.module.no_sync():
            yield

    def after_step(self) -> None:
        """zero1: every owner broadcasts the parameters it updated (coalesced, one collective per owner)."""
        if self.mode != "zero1" or not self.runtime.distributed:
            return
        by_owner: dict[int, list[torch.Tensor]] = {}
        for p in self.model.parameters():
            if p.requires_grad:
                by_owner.setdefault(self.owner[id(p)], []).append(p.data)
        for rank in sorted(by_owner):
            tensors = by_owner[rank]
            flat = torch._utils._flatten_dense_tensors(tensors)
            dist.broadcast(flat, src=rank)
            if rank != self.runtime.rank:
                for dst, src in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
                    dst.copy_(src)


def assign_owners(params: list[nn.Parameter], world_size: int) -> dict[int, int]:
    """Greedy size balancing: largest parameters first, each to the least-loaded rank (deterministic)."""
    load = [0] * world_size
    owner: dict[int, int] = {}
    order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
    for i in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[id(params[i])] = rank
        load[rank] += params[i].numel()
    return owner


def wrap(model: nn.Module, mode: str, runtime: Runtime) -> Parallel:
    if not runtime.distributed:
        return Parallel(mode, model, model, runtime)
    if mode in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        module = DDP(model, device_ids=device_ids, broadcast_buffers=False)
        params = [p for p in model.parameters() if p.requires_grad]
        owner = assign_owners(params, runtime.world_size) if mode == "zero1" else {}
        return Parallel(mode, module, model, runtime, owner)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return Parallel(mode, model, model, runtime)
    raise ValueError(f"unknown parallel mode {mode!r}")
