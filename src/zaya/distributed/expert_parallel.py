"""Expert parallelism: each rank holds num_experts / ep of every MoE layer's experts; tokens travel to them.

**Groups.** ``train.expert_parallel = ep`` folds an expert-parallel dimension into data parallelism, as torchtitan
and Megatron do: the world's ranks form a grid (replica, ep), ep fastest, so each *ep group* is ep consecutive
ranks (inside a node where ep divides the ranks per node) and holds all the experts between them, rank ``i`` of the
group experts ``[i * E / ep, (i + 1) * E / ep)``; the ranks with the same index in every group (its *replica
group*) hold the same experts. Every rank still trains on tokens of its own, as in plain data parallelism. Both
kinds of group take ``train.timeout_s`` as their collective timeout.

**Dispatch** (``Dispatch``, installed on every ``Experts`` module as its ``dispatcher``). Per MoE layer: the
(token, slot) assignments are sorted by class as on one rank (the skip class last: never sent, its output zero),
the per-expert counts are exchanged with one small all-to-all on the device, and both count vectors come to the
host together: ``all_to_all_single`` with variable splits takes Python lists, so this is the layer's one host read
(every step's forward, and again in a recomputed forward under activation checkpointing; the backward reuses the
forward's splits). The rows then go to their experts' ranks with one ``all_to_all_single``, are regrouped by local
expert (a stable sort: source rank order within an expert), run through ``Experts.run_grouped`` and come back with
a second ``all_to_all_single``; both are ``Exchange``s (torch's functional collective, as torchtitan uses, in an
autograd function), whose backward sends the gradients the opposite way. Dropless: every routed assignment is
computed. A rank that sends or receives nothing still joins every collective, forward and backward (its outputs
depend on the exchanged tensors). Every exchange of a layer (the counts, the rows out and back, and the rows'
backward) is waited for where it is issued, so one that fails (a rank of the group died, or none answered within the
timeout) is a ``CollectiveError`` (exit code 6) naming the MoE layer, the exchange and the group's ranks, not a
bare backend timeout somewhere later in the step.

**Gradients.** The expert weights are left out of DDP's all-reduce (``ignored_parameters``) and of FSDP2's
sharding (``ignored_params``: plain tensors, whole on their rank); after the last micro-batch
``reduce_gradients`` sums each rank's expert gradients over its replica group only and divides by the world size
(the same mean as DDP's and FSDP2's over every rank: a rank's expert gradient already sums its ep group's tokens).
``clip_gradients`` takes the global norm with the expert part summed over the ep group (and FSDP2's part over
every rank's shards). Non-expert parameters are reduced as before (DDP, ZeRO-1 or FSDP2); Muon orthogonalises the
shards a rank holds, its work split over their replica group under DDP and FSDP2 (one owner per shard under
ZeRO-1); the routers' balancing counts are the step's global counts as always.

**Checkpoints** hold the experts whole (``Consolidated``): saved at one degree, they load at any other, or at none.
``train.init_from`` fills each rank's experts only: ``placed`` shows the loader its shards as DTensors over the ep
group, whose slices it reads as it reads FSDP2's.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zaya.core.errors import CollectiveError, ConfigError
from zaya.distributed.runtime import Runtime


class ExpertParallel:
    """This rank's place in the expert-parallel layout and the operations on its expert shards."""

    def __init__(self, runtime: Runtime, size: int) -> None:
        """Collective (every rank builds it, in the same order); ``size`` = ``train.expert_parallel`` > 1."""
        world = runtime.world_size
        if world % size:
            fits = [n for n in range(1, world + 1) if world % n == 0]
            raise ConfigError(f"train.expert_parallel = {size} does not divide the world size {world}: launch a "
                              f"multiple of {size} processes, or pass --set train.expert_parallel=N with N one of "
                              f"{fits}")
        timeout = datetime.timedelta(seconds=runtime.timeout_s)  # new groups would take torch's default otherwise
        self.ranks = [r for r in range(world) if r // size == runtime.rank // size]  # this rank's ep group
        self.group, _ = dist.new_subgroups_by_enumeration(
            [list(range(g * size, (g + 1) * size)) for g in range(world // size)], timeout=timeout)
        self.replica_group = None
        if world > size:
            self.replica_group, _ = dist.new_subgroups_by_enumeration(
                [list(range(i, world, size)) for i in range(size)], timeout=timeout)
        self.size, self.index = size, runtime.rank % size
        self.replicas, self.replica_rank = world // size, runtime.rank // size
        self.world_size = world
        self.device_type = runtime.device.type
        self.fqns: list[str] = []
        """The expert shards' qualified names in the model ``shard`` was given (DDP's ignored parameters, the
        checkpoint keys)."""
        self._model: nn.Module | None = None
        self._mesh = None

    @property
    def params(self) -> list[nn.Parameter]:
        """The expert shards, looked up by name (``to_empty`` after a build on the meta device replaces them)."""
        return [] if self._model is None else [self._model.get_parameter(n) for n in self.fqns]

    def describe(self) -> str:
        return f"expert parallel {self.size} (this rank holds experts slice {self.index} of {self.size})"

    def shard(self, model: nn.Module) -> None:
        """Keep only this rank's experts of every MoE layer (slices of the full, identically initialised stacks; on
        the meta device nothing is allocated) and install the dispatcher."""
        from zaya.model.moe import Experts

        self._model = model
        for where, module in model.named_modules():
            if not isinstance(module, Experts):
                continue
            held = module.num_experts // self.size
            lo = self.index * held
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(module, name)
                part = nn.Parameter(full.detach()[lo:lo + held].clone(), requires_grad=full.requires_grad)
                setattr(module, name, part)
                self.fqns.append(f"{where}.{name}")
            module.dispatcher = Dispatch(self.group, self.size, held, f"{where} (ep group of ranks {self.ranks})")

    def consolidated(self, part: Any) -> Consolidated:
        """``part`` (a checkpoint part over the model) saving and loading the expert shards whole."""
        return Consolidated(part, self, self.fqns)

    def placed(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (a model state dict by qualified name) with each expert shard as a DTensor of the whole
        [E, ...] stack over the ep group (``Shard(0)``: this rank's slice), sharing the shard's storage: readers
        that place DTensors (DCP's planner, ``train.init_from``'s safetensors slices) then fill only this rank's
        experts, as they fill FSDP2's shards (a mesh over the ep group, built once from it: nothing collective)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.group, self.device_type)
        names = set(self.fqns)
        return {k: DTensor.from_local(v, self._mesh, [Shard(0)], run_check=False) if k in names else v
                for k, v in state.items()}

    def reduce_gradients(self) -> None:
        """Sum the expert shards' gradients over the replica group and divide by the world size: the mean over
        every rank that DDP takes of the other gradients (collective; a shard without a gradient counts zero)."""
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if not grads:
            return
        if self.replica_group is not None:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.replica_group)
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        torch._foreach_div_(grads, float(self.world_size))

    def clip_gradients(self, params, max_norm: float) -> torch.Tensor:
        """The global gradient norm before clipping (the same on every rank; expert shards' squares summed over the
        ep group) and the gradients scaled by ``max_norm / norm`` where it is smaller than one."""
        from torch.distributed.tensor import DTensor

        mine = {id(p) for p in self.params}
        params = [p for p in params if p.grad is not None]
        grads = [p.grad for p in params]
        expert = [p.grad for p in params if id(p) in mine]
        dense = [p.grad for p in params if id(p) not in mine]
        device = grads[0].device
        total = torch.zeros(2, dtype=torch.float32, device=device)
        if dense and isinstance(dense[0], DTensor):  # FSDP2's shards: the norm over every rank's
            total[0] = torch.nn.utils.get_total_norm(dense).full_tensor()
            grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        elif dense:
            total[0] = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(dense)))
        if expert:
            total[1] = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(expert)))
        total.square_()
        expert_sq = total[1:].clone()
        dist.all_reduce(expert_sq, group=self.group)
        norm = (total[0] + expert_sq[0]).sqrt()
        if max_norm > 0:
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, scale)
        return norm


class Consolidated:
    """A checkpoint part (``state_dict()`` / ``load_state_dict()``: the model's or the optimizers') whose expert
    shards are saved whole: every expert-shard tensor of its state (the weights, Muon's momentum, AdamW's moments;
    keyed by the shards' names) is all-gathered over the ep group into the full [E, ...] stack, the same on every
    rank, so the checkpoint holds the model as one process would and loads at any expert-parallel degree (each
    rank keeps its slice on load). Costs a full copy of the experts' tensors on every rank while a save runs."""

    def __init__(self, part: Any, ep: ExpertParallel, names: list[str]) -> None:
        self.part, self.ep, self.names = part, ep, set(names)

    def state_dict(self) -> dict[str, Any]:
        return self._map(self.part.state_dict(), self._gather)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.part.load_state_dict(self._map(state, self._slice))

    def _map(self, tree: Any, fn, under: bool = False) -> Any:
        """``tree`` with ``fn`` applied to every tensor (of at least one dimension) below a shard's name."""
        if isinstance(tree, dict):
            return {k: self._map(v, fn, under or k in self.names) for k, v in tree.items()}
        if under and isinstance(tree, torch.Tensor) and tree.dim() > 0:
            return fn(tree)
        return tree

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(shard) for _ in range(self.ep.size)]
        dist.all_gather(parts, shard.contiguous(), group=self.ep.group)
        return torch.cat(parts)

    def _slice(self, full: torch.Tensor) -> torch.Tensor:
        held = full.shape[0] // self.ep.size
        return full[self.ep.index * held:(self.ep.index + 1) * held]


class Dispatch:
    """An ``Experts`` module's forward over an ep group: send each routed assignment to the rank that holds its
    expert, compute there, send the result back and mix it (see the module docstring)."""

    def __init__(self, group: Any, size: int, held: int, where: str) -> None:
        self.group, self.size, self.held, self.where = group, size, held, where

    def __call__(self, experts: nn.Module, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
                 ) -> torch.Tensor:
        n, k = chosen.shape
        e, size, held = experts.num_experts, self.size, self.held
        flat = chosen.reshape(-1)
        counts = torch.zeros(e + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        counts = counts[:e].contiguous()
        order = torch.argsort(flat, stable=True)
        incoming = torch.empty_like(counts)  # [source rank, held expert]: what each rank sends to this one
        try:
            dist.all_to_all_single(incoming, counts, group=self.group)
            host = torch.cat((counts, incoming)).tolist()  # the layer's one host read: the splits
        except RuntimeError as exc:
            raise lost(self.where, "counts", exc) from exc
        send = [sum(host[r * held:(r + 1) * held]) for r in range(size)]
        recv = [sum(host[e + s * held:e + (s + 1) * held]) for s in range(size)]
        per_expert = [sum(host[e + s * held + j] for s in range(size)) for j in range(held)]
        routed, received = sum(send), sum(recv)
        dest = order[:routed]  # the skip class sorts last and is cut: handled here, never sent
        rows = Exchange.apply(x.index_select(0, dest // k), recv, send, self.group, self.where, "rows out")
        # Regroup by held expert (the rows come grouped by source rank, then expert), compute, and undo it.
        key = torch.arange(held, device=flat.device).repeat(size)
        perm = torch.argsort(key.repeat_interleave(incoming, output_size=received), stable=True)
        y_sorted = experts.run_grouped(rows.index_select(0, perm), incoming.view(size, held).sum(0), per_expert)
        y = torch.zeros_like(y_sorted).index_copy(0, perm, y_sorted)
        back = Exchange.apply(y, send, recv, self.group, self.where, "rows back")
        mixed = back * weights.reshape(-1).index_select(0, dest).to(y.dtype)[:, None]
        out = y.new_zeros(n * k, y.shape[1]).index_copy(0, dest, mixed)
        if not routed:  # keep the exchanges' backward and the mixing weights in the graph on this rank too
            out = out + (back.sum() + weights.sum().to(y.dtype)) * 0
        return out.view(n, k, -1).sum(1) if k > 1 else out


class Exchange(torch.autograd.Function):
    """``all_to_all_single`` of rows (``recv[r]`` rows come from rank ``r`` of the group, ``send[r]`` go to it) whose
    backward sends the gradients the opposite way; each direction waits for its exchange where it is issued, so that
    a peer that stops answering is reported as the layer's (``where``) exchange ``what``, forward or backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group: Any, where: str, what: str
                ) -> torch.Tensor:
        ctx.args = (send, recv, group, where, f"{what}, backward")
        return all_to_all(x, recv, send, group, where, what)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_to_all(grad.contiguous(), *ctx.args), None, None, None, None, None


def all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group: Any, where: str, what: str) -> torch.Tensor:
    """One variable-split exchange over ``group``, waited for (torch's functional collective, as torchtitan uses);
    a failure or a timeout is ``lost``'s CollectiveError."""
    from torch.distributed._functional_collectives import all_to_all_single, wait_tensor

    try:
        return wait_tensor(all_to_all_single(x, recv, send, group))
    except RuntimeError as exc:
        raise lost(where, what, exc) from exc


def lost(where: str, what: str, exc: BaseException) -> CollectiveError:
    """The error of an expert exchange that did not complete: the layer and its ep group's ranks (``where``), the
    exchange (``what``: counts, rows out, rows back, or a backward) and the backend's first line."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return CollectiveError(
        f"the expert all-to-all of {where}, {what}, did not complete ({type(exc).__name__}: {first}): a rank of that "
        "group died, hung or could not be reached within train.timeout_s. Check the other ranks' logs; resume from "
        "the newest checkpoint once every node is healthy")
