"""Data parallelism: DDP, DDP with a ZeRO-1 sharded optimizer, and FSDP2, behind one small interface.

All three run over the runtime's gradient mesh: every rank (data parallel x context parallel: cp ranks hold
different tokens of the same sequences, so their gradients are averaged like data-parallel ones).

* ``ddp``: gradients all-reduced by DistributedDataParallel (written straight into its buckets:
  ``gradient_as_bucket_view``, no second copy); every rank runs the whole optimizer, except Muon's Newton-Schulz:
  each matrix is orthogonalised by one rank and the results are broadcast (``optim.muon_distributed``).
* ``zero1``: gradients as DDP, but each rank owns a disjoint, size-balanced subset of the parameters, keeps
  optimizer state only for those and updates only those; owners then broadcast their updated parameters. Optimizer
  memory (and Muon's Newton-Schulz work) falls as 1/dp. This is what ZAYA1 trained with.
* ``fsdp``: FSDP2 ``fully_shard`` on every block and the root; parameters, gradients and optimizer state are
  sharded DTensors. With bf16 training the parameters are all-gathered and computed in bf16 and gradients
  reduce-scattered in fp32 (``MixedPrecisionPolicy``); the sharded fp32 master weights stay fp32.

The collective settings come from this device's hardware profile (``zaya.core.hardware``; written by ``zaya tune
comm``, defaults otherwise): DDP's and ZeRO-1's gradient bucket size (``bucket_cap_mb``) and FSDP2's
``reshard_after_forward`` for each block. ``Parallel.describe()`` names them and where they came from (the trainer's
start-up line).

Under expert parallelism (``train.expert_parallel``: ``zaya.distributed.expert_parallel``) each rank holds a slice
of the experts: DDP and FSDP2 leave those shards out (plain tensors, whole on their rank, never FSDP2's DTensors),
ZeRO-1 splits their ownership over the ranks that hold the same slice (their replica group), and
``finish_gradients`` reduces them over that group.

A single process (no process group) gets the bare model whichever mode is configured.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from zaya.config import PARALLEL_MODES
from zaya.core.balance import assign
from zaya.core.hardware import load_profile
from zaya.distributed.runtime import Runtime

MODES = PARALLEL_MODES


@dataclass
class Parallel:
    """The wrapped model and what the training loop needs to drive it."""

    mode: str
    wrapped: nn.Module         # what to call forward on: the model in its DDP wrapper, or the model itself (FSDP2
    #                            shards it in place, one process needs no wrapper)
    model: nn.Module           # the underlying ZayaForCausalLM (its parameters may be DTensors under FSDP)
    runtime: Runtime
    owner: dict[int, int] = field(default_factory=dict)   # zero1: id(param) -> owning dp rank
    settings: dict[str, Any] = field(default_factory=dict)
    """The collective settings in use (``bucket_cap_mb`` or ``reshard_after_forward``) and their ``source``."""
    experts: Any = None
    """The ``ExpertParallel`` layout under ``train.expert_parallel`` > 1 (its expert shards are outside DDP), else
    None."""
    expert_owner: dict[int, int] = field(default_factory=dict)
    """zero1 with expert parallelism: id(expert shard) -> owning rank of its replica group."""

    def describe(self) -> str:
        """The collective settings and where they came from, for the start-up log ("" in a single process)."""
        if not self.settings:
            return ""
        values = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in self.settings.items() if k != "source")
        ep = "" if self.experts is None else f", {self.experts.describe()}"
        return f"{self.mode} {values} ({self.settings['source']}){ep}"

    @property
    def sharded(self) -> bool:
        """Whether the parameters are FSDP2 DTensors (a rank holds only its shards)."""
        return self.mode == "fsdp" and self.runtime.distributed

    @property
    def replica_group(self) -> Any:
        """The group over which every rank holds the same plain parameters (DDP), for Muon to split its work
        over; None when parameters are per-rank subsets (zero1), shards (fsdp) or in a single process."""
        if self.mode == "ddp" and self.runtime.distributed:
            return self.runtime.grad_group or dist.group.WORLD
        return None

    def owned(self, params: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
        """The parameters this rank's optimizer steps (all of them except under zero1, where it steps its own
        subset and, under expert parallelism, its expert shards)."""
        if self.mode != "zero1" or not self.runtime.distributed:
            return params
        return [(n, p) for n, p in params if self._owns(p)]

    def _owns(self, p: nn.Parameter) -> bool:
        if id(p) in self.expert_owner:
            return self.expert_owner[id(p)] == self.experts.replica_rank
        return self.owner.get(id(p), self.runtime.grad_rank) == self.runtime.grad_rank  # a shard nobody shares

    def finish_gradients(self) -> None:
        """After the last micro-batch's backward: the expert shards' gradient reduction (expert parallelism)."""
        if self.experts is not None:
            self.experts.reduce_gradients()

    @contextmanager
    def accumulating(self, is_last: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on all but the last micro-batch of a step."""
        if not self.runtime.distributed or is_last:
            yield
            return
        if self.mode == "fsdp":
            self.wrapped.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.wrapped.set_requires_gradient_sync(True)
            return
        with self.wrapped.no_sync():
            yield

    def after_step(self) -> None:
        """zero1: every owner broadcasts the parameters it updated (coalesced, one collective per owner); expert
        shards within their replica group."""
        if self.mode != "zero1" or not self.runtime.distributed:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        broadcast_owned([p for p in params if id(p) in self.owner], self.owner, self.runtime.grad_group,
                        self.runtime.grad_rank)
        if self.expert_owner:
            broadcast_owned(self.experts.params, self.expert_owner, self.experts.replica_group,
                            self.experts.replica_rank)


def broadcast_owned(params: list[nn.Parameter], owner: dict[int, int], group: Any, rank: int) -> None:
    """Each parameter from its owner (a rank of ``group``; this rank is ``rank``) to the group's other ranks."""
    by_owner: dict[int, list[torch.Tensor]] = {}
    for p in params:
        by_owner.setdefault(owner[id(p)], []).append(p.data)
    for src_rank in sorted(by_owner):
        tensors = by_owner[src_rank]
        flat = torch._utils._flatten_dense_tensors(tensors)
        src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
        dist.broadcast(flat, src=src, group=group)
        if src_rank != rank:
            for dst, src_tensor in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
                dst.copy_(src_tensor)


def assign_owners(params: list[nn.Parameter], world_size: int) -> dict[int, int]:
    """ZeRO-1's owner of each parameter (by ``id``): by size, ``zaya.core.balance`` (largest first, each to the
    least-loaded rank; deterministic)."""
    owner = assign([p.numel() for p in params], world_size)
    return {id(p): rank for p, rank in zip(params, owner)}


def mixed_precision(dtype: str) -> Any:
    """FSDP2's policy for the compute dtype: bf16 all-gathers and compute, fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "bfloat16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def wrap(model: nn.Module, mode: str, runtime: Runtime, dtype: str = "float32", experts: Any = None) -> Parallel:
    """Wrap ``model`` (on ``runtime.device``, or on the meta device under fsdp) for ``mode`` over the gradient mesh
    (every rank). ``experts``: an ``ExpertParallel`` that has sharded the model's experts."""
    if mode not in MODES:
        raise ValueError(f"unknown parallel mode {mode!r}; use one of {', '.join(MODES)}")
    if not runtime.distributed:
        return Parallel(mode, model, model, runtime)
    profile = load_profile(runtime.device)
    source = f"hardware profile {profile.path}" if profile.path else "defaults: no hardware profile, see zaya tune comm"
    if mode in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        if experts is not None:  # reduced over their replicas only (ExpertParallel.reduce_gradients)
            DDP._set_params_and_buffers_to_ignore_for_model(model, experts.fqns)
        with warnings.catch_warnings():
            # torch 2.13 deprecates broadcast_buffers but advises keeping broadcast_buffers=False for rank-local
            # buffers (the routers' balancing state is updated identically on every rank, never broadcast) until
            # its replacement can skip the initial sync too.
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*deprecated", category=FutureWarning)
            wrapped = DDP(model, device_ids=device_ids, broadcast_buffers=False, gradient_as_bucket_view=True,
                         process_group=runtime.grad_group, bucket_cap_mb=profile.ddp_bucket_mb)
        shards = {id(p) for p in experts.params} if experts is not None else set()
        params = [p for p in model.parameters() if p.requires_grad and id(p) not in shards]
        owner = assign_owners(params, runtime.grad_size) if mode == "zero1" else {}
        expert_owner = {}
        if mode == "zero1" and experts is not None and experts.replica_group is not None:
            expert_owner = assign_owners(experts.params, experts.replicas)  # the same on every rank of an ep group
        return Parallel(mode, wrapped, model, runtime, owner,
                        settings={"bucket_cap_mb": float(profile.ddp_bucket_mb), "source": source}, experts=experts,
                        expert_owner=expert_owner)
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision(dtype)
    reshard = profile.fsdp_reshard_after_forward
    ignored = set(experts.params) if experts is not None else None  # reduced over their replicas only, as above
    for block in model.blocks:
        fully_shard(block, mesh=runtime.grad_mesh, mp_policy=policy, reshard_after_forward=reshard,
                    ignored_params=ignored)
    fully_shard(model, mesh=runtime.grad_mesh, mp_policy=policy, ignored_params=ignored)  # the root: FSDP2's choice
    return Parallel(mode, model, model, runtime, settings={"reshard_after_forward": reshard, "source": source},
                    experts=experts)
