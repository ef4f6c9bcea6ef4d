"""One optimizer step (docs/architecture.md, "The trainer as parts", steps 3-7): the micro-batches, clip, ONE
all-reduce and ONE host read of the step's scalars, then the optimizers and the router's balancing update.

The scalars the ranks must agree on are the named fields of ``StepTotals``: views into one float64 tensor, so that
one all-reduce and one read carry them all; the read gives ``StepValues``, host numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zaya.core.device import autocast
from zaya.core.hardware import compute_dtype
from zaya.model import update_balancing_biases
from zaya.model.router import routers_of

HOST_READS_PER_STEP = 2
"""The host reads (device-to-host waits) a training step may do, whatever its accumulation and parallel mode: the
step's one read of its reduced scalars, and Muon's one read of its Newton-Schulz drift checks (only in a step where
some matrix takes the Gram-space path: ``zaya.optim.muon``). tests/test_trainer.py and tests/test_cluster.py hold
the trainer to it. Expert parallelism adds one per MoE layer and forward (the all-to-all's split sizes:
``zaya.distributed.expert_parallel``)."""


@dataclass
class StepValues:
    """The step's scalars on the host, the same on every rank."""

    loss: float
    """Mean loss per target token over all ranks' micro-batches."""
    grad_norm: float
    """The global gradient norm before clipping."""
    stop_requested: bool
    checkpoint_failed: bool
    expert_counts: list[list[float]]
    """Tokens per router class, per layer, over all ranks."""
    probe: list[float]
    """The routing probe's flip rate per layer then token entropy per layer (empty without a probe)."""
    probe_compared: bool

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


class StepTotals:
    """The step's sums on the device, named views into one float64 tensor (``flat``)."""

    def __init__(self, device: torch.device, count_shape: tuple[int, int], probe_values: int) -> None:
        self.sizes = [1, 1, 1, 1, math.prod(count_shape), probe_values]
        self.flat = torch.zeros(sum(self.sizes), dtype=torch.float64, device=device)
        (self.loss_sum, self.targets, self.stop_requested, self.checkpoint_failed, counts,
         self.probe) = self.flat.split(self.sizes)
        self.expert_counts = counts.view(count_shape)
        self.probe_compared = False

    def reduce_and_read(self, rt, grad_norm: torch.Tensor) -> StepValues:
        """Sum over the ranks, then the step's one host read (with the clipping norm, already global)."""
        rt.all_reduce(self.flat)
        values = rt.read(torch.cat((self.flat, grad_norm.reshape(1).double())))
        (loss_sum,), (targets,), (stop,), (failed,), counts, probe, (norm,) = _split(values, self.sizes + [1])
        classes = self.expert_counts.shape[1]
        return StepValues(loss_sum / targets, norm, stop > 0, failed > 0,
                          [counts[i:i + classes] for i in range(0, len(counts), classes)],
                          # Every rank routed the same probe, so the reduction summed world_size equal values.
                          [v / rt.world_size for v in probe], self.probe_compared)


class TrainStep:
    """One optimizer step of a model in its parallel wrapper; built once per run by the trainer."""

    def __init__(self, config, runtime, parallel, optimizers: list, *, probe, stop_request, store) -> None:
        self.config, self.runtime, self.parallel, self.optimizers = config, runtime, parallel, optimizers
        self.probe, self.stop_request, self.store = probe, stop_request, store
        self.count_shape = (config.model.num_layers, config.model.num_router_classes)
        self.dtype = compute_dtype(config.train.dtype, runtime.device)  # "auto" resolved once, not per step

    def __call__(self, batches: list) -> StepValues:
        rt, model, dtype = self.runtime, self.parallel.model, self.dtype
        totals = StepTotals(rt.device, self.count_shape, 0 if self.probe is None else self.probe.num_values)
        if self.probe is not None:
            # First, with the weights and biases the last step left (and before any backward: FSDP2 wants no
            # forward between a backward and the optimizer step); compared with the previous step's probe.
            with full_sequences(model):
                measured, totals.probe_compared = self.probe.measure(model, routers_of(model),
                                                                     lambda: autocast(rt.device, dtype))
            totals.probe.copy_(measured)
        global_targets = sum(b.global_targets for b in batches)
        for i, batch in enumerate(batches):
            inputs, labels, positions = local_tokens(batch, rt)
            with self.parallel.accumulating(is_last=i == len(batches) - 1), autocast(rt.device, dtype):
                out = self.parallel.wrapped(inputs, labels=labels, position_ids=positions,
                                           document_mask=self.config.data.document_mask)
                targets, objective = weighted_objective(out, batch, labels, global_targets, len(batches), rt)
                objective.backward()
            # No targets (chat data, all masked): a NaN mean loss that adds nothing.
            if isinstance(targets, torch.Tensor):  # counted on the device under context parallelism
                totals.loss_sum += torch.where(targets > 0, out.loss.detach().double() * targets, 0.0)
            elif targets:
                totals.loss_sum += out.loss.detach().double() * targets
            totals.targets += targets
            totals.expert_counts += out.tokens_per_expert.detach()
        # The flags are read before the clip: a signal arriving during the collectives waits for the next step.
        totals.stop_requested.fill_(float(self.stop_request.requested))
        totals.checkpoint_failed.fill_(float(self.store.poll_failed()))
        self.parallel.finish_gradients()
        grad_norm = clip_gradients(self.parallel.wrapped.parameters(), self.config.optim.grad_clip,
                                   self.parallel.experts)
        values = totals.reduce_and_read(rt, grad_norm)
        if values.finite:
            for opt in self.optimizers:
                opt.step()
        # Every gradient, not only the optimizers' own: under zero1 a rank's optimizers hold only the parameters it
        # owns, and a stale gradient elsewhere would skew the next step's clipping norm.
        model.zero_grad(set_to_none=True)
        if values.finite:
            self.parallel.after_step()
            update_balancing_biases(model, totals.expert_counts)
        return values


def weighted_objective(out, batch, labels: torch.Tensor, global_targets: int, micro_batches: int, rt):
    """(this rank's target count, the micro-batch's objective): its mean loss weighted so that the gradients,
    averaged over the ranks, are those of the step's global mean loss; plus its share of the router's aux loss."""
    cp = rt.cp_size
    if cp == 1:
        # d(global mean)/d(this rank's mean): its share of the step's targets, times dp (the gradient reduction
        # averages over the ranks).
        targets = batch.num_targets
        objective = out.loss / (global_targets / (targets * rt.grad_size)) if targets else \
            out.logits.sum() * 0.0  # every label masked (chat data): no loss, but a backward the reduction waits on
    else:
        # This rank's share of the sequence's targets, counted on the device (no host read); a shard without
        # targets (chat data) has a NaN mean loss, replaced by a zero whose backward is zero.
        targets = (labels != -100).sum()
        loss = torch.where(targets > 0, out.loss, torch.zeros_like(out.loss))
        objective = loss * (targets * rt.grad_size / global_targets)
    if out.aux_loss is not None:  # a per-micro-batch mean, averaged like the gradients
        objective = objective + out.aux_loss / (micro_batches * cp)
    return targets, objective


def local_tokens(batch, rt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input ids, labels, position ids) of this rank on its device: under context parallelism its zigzag
    chunks, with their global positions (cut on the host: no device work, no read)."""
    from zaya.distributed.context_parallel import shard

    inputs, labels, positions = batch.input_ids, batch.labels, batch.position_ids
    if rt.cp_size > 1:
        if positions is None:
            positions = torch.arange(inputs.shape[1], device="cpu").expand(inputs.shape[0], -1)
        inputs, labels, positions = (shard(t, rt.cp_size, rt.cp_rank) for t in (inputs, labels, positions))
    return (rt.to_device(inputs), rt.to_device(labels), None if positions is None else rt.to_device(positions))


def clip_gradients(params, max_norm: float, experts=None) -> torch.Tensor:
    """Clip the global gradient norm (over all ranks' shards under FSDP, and over the ep group's expert shards
    under expert parallelism: ``experts``); the norm before clipping, on the device, the same on every rank."""
    if experts is not None:
        return experts.clip_gradients(params, max_norm)
    grads = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _split(values: list, sizes: list[int]) -> list[list]:
    out, start = [], 0
    for size in sizes:
        out.append(values[start:start + size])
        start += size
    return out


class full_sequences:  # noqa: N801 - a context manager used like a function
    """Within it, ``model`` attends over whole sequences in each process (the local sequence seam)."""

    def __init__(self, model) -> None:
        self.model = model

    def __enter__(self):
        from zaya.model.attention import LOCAL_SEQUENCE

        self.seam = self.model.sequence_seam
        self.model.set_sequence_seam(LOCAL_SEQUENCE)
        return self

    def __exit__(self, *exc) -> None:
        self.model.set_sequence_seam(self.seam)
