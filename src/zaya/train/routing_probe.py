"""The routing probe: one fixed sequence routed every step, to see how the routers' choices move.

A training batch is new tokens every step, so whether "the same token would now go elsewhere" cannot be read from
it. The probe keeps one validation sequence (the same on every rank) and, once per step before the optimizers run,
passes it through the model without gradients, recording each router's top choice and probabilities per token.
From those it gives, per MoE layer:

* the flip rate: the share of the probe's tokens whose top choice differs from the previous step's (how much the
  last step's weight and bias updates moved the routing; a bang-bang balancer shows as a high rate);
* the token entropy: the mean over tokens of the router distribution's entropy over its classes, divided by
  log(classes) (1 = a router that cannot tell its classes apart, 0 = certain).

Everything stays on the device: ``measure`` returns a tensor that the step (``zaya.train.step``) folds into its
reduced scalars, so the probe adds no host read. It costs one forward pass of ``seq_len`` tokens per step. After a
resume the previous choices are unknown, so the first step's flip rate is reported as missing (None).
"""

from __future__ import annotations

import math
from contextlib import ExitStack

import torch
from torch import nn


class RoutingProbe:
    """One fixed sequence and the routers' previous top choices on it."""

    def __init__(self, input_ids: torch.Tensor, num_layers: int) -> None:
        self.input_ids = input_ids
        self.num_layers = num_layers
        self._previous: torch.Tensor | None = None

    @property
    def num_values(self) -> int:
        """Slots the probe adds to the step's scalars: flip rate and token entropy per layer."""
        return 2 * self.num_layers

    @torch.no_grad()
    def measure(self, module: nn.Module, routers: list[nn.Module], autocast) -> tuple[torch.Tensor, bool]:
        """Route the probe through ``module`` (every rank: under FSDP the forward gathers parameters). Returns
        ([flip rate per layer, token entropy per layer] as float64 on the probe's device, whether the flip rates
        compare with a previous step)."""
        captured: list = [None] * len(routers)

        def keep(index: int):
            def hook(_module, _inputs, routing) -> None:
                captured[index] = routing
            return hook

        was_training = module.training
        module.eval()
        try:
            with ExitStack() as stack:
                for i, router in enumerate(routers):
                    stack.callback(router.register_forward_hook(keep(i)).remove)
                with autocast():
                    module(self.input_ids)
        finally:
            module.train(was_training)
        choices = torch.stack([r.experts.reshape(-1, r.experts.shape[-1])[:, 0] for r in captured])
        entropy = torch.stack([_normalised_entropy(r.probs) for r in captured])
        compared = self._previous is not None
        flips = ((choices != self._previous).double().mean(1) if compared
                 else torch.zeros(len(routers), dtype=torch.float64, device=choices.device))
        self._previous = choices
        return torch.cat((flips, entropy.double())), compared


def _normalised_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of H(p) / log(classes) for probabilities [..., classes]."""
    p = probs.float().reshape(-1, probs.shape[-1])
    h = -(p * p.clamp(min=1e-30).log()).sum(-1).mean()
    return h / math.log(p.shape[-1])


def probe_sequence(dataset, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """The first validation sequence of ``dataset`` (the training split's first when there is no val split), as
    [1, seq_len] ids on ``device``; None when the dataset holds no whole sequence."""
    from zaya.data.loader import validation_batches

    for split in ("val", "train"):
        if split not in dataset.splits or dataset.split(split).num_tokens <= seq_len:
            continue
        for x, _, _ in validation_batches(dataset, seq_len, 1, 0, 1, 1, split):
            return x.to(device)
    return None
