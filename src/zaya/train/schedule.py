"""What the next optimizer step looks like: its stage, global batch, gradient accumulation and learning rate.

Stages (sequence length, micro-batch, mixture, RoPE base) come from the data loader, which knows the token count
at which each starts; the global batch follows the batch-size ramp of the tokens seen; the learning rate is a
function of the step. All of it is a pure function of the config and the run's position, which is what makes
resuming exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from zaya.config import Config, OptimConfig
from zaya.core.errors import ConfigError
from zaya.data.loader import Stage


@dataclass(frozen=True)
class StepPlan:
    stage: Stage
    rope_theta: float
    batch_tokens: int
    """Tokens of this optimizer step over all data-parallel ranks."""
    accumulation: int
    """Micro-batches per rank."""
    lr_factor: float


def stages_of(config: Config) -> list[Stage]:
    """The data schedule: the config's [[stages]], or one stage of train.seq_len / micro_batch_size."""
    mixture = config.data.mixture()
    if not config.stages:
        return [Stage("main", config.train.seq_len, config.train.micro_batch_size, mixture, 0)]
    return [Stage(s.name, s.seq_len or config.train.seq_len, s.micro_batch_size or config.train.micro_batch_size,
                  s.weights or mixture, s.tokens) for s in config.stages]


def stage_at(stages: list[Stage], loader_state: dict[str, Any]) -> Stage | None:
    """The stage the loader's next micro-batch falls in (None when the schedule is over)."""
    index, done = loader_state["stage"], loader_state["stage_tokens"]
    while index < len(stages) and stages[index].tokens and done >= stages[index].tokens:
        index, done = index + 1, 0
    return stages[index] if index < len(stages) else None


class Schedule:
    def __init__(self, config: Config, dp_size: int):
        self.config = config
        self.stages = stages_of(config)
        self.dp_size = dp_size

    def plan(self, step: int, tokens: int, loader_state: dict[str, Any]) -> StepPlan | None:
        """The next step, or None once the data schedule has ended."""
        tc, oc = self.config.train, self.config.optim
        stage = stage_at(self.stages, loader_state)
        if stage is None:
            return None
        theta = self.config.model.rope_theta
        if self.config.stages:
            theta = self.config.stages[self.stages.index(stage)].rope_theta or theta
        default_batch = stage.micro_batch_size * stage.seq_len * self.dp_size
        batch = global_batch_tokens(tokens, tc.global_batch_tokens or default_batch, tc.batch_ramp)
        accumulation = accumulation_steps(batch, stage.micro_batch_size, stage.seq_len, self.dp_size)
        return StepPlan(stage, theta, batch, accumulation, lr_factor(step, oc, oc.schedule_steps or tc.max_steps))


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of each group's peak lr at optimizer step ``step`` (0-based).

    Warmup: linear from 1/warmup to 1. Then "cosine": half-cosine to min_lr/lr at max_steps; "wsd": flat, then a
    linear decay to min_lr/lr over the last ``decay_fraction`` of the steps; "constant": 1.
    """
    floor = cfg.min_lr / cfg.lr
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        span = max(1, max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + 0.5 * (1 - floor) * (1 + math.cos(math.pi * progress))
    decay_steps = max(1, round(cfg.decay_fraction * max_steps))
    decay_start = max_steps - decay_steps
    if step < decay_start:
        return 1.0
    return 1.0 - (1 - floor) * min(1.0, (step - decay_start + 1) / decay_steps)


def peak_lrs(optimizers: list[torch.optim.Optimizer]) -> list[list[float]]:
    """Each group's peak lr, taken before a checkpoint load can overwrite ``lr`` with a scheduled value."""
    return [[group["lr"] for group in opt.param_groups] for opt in optimizers]


def set_lr(optimizers: list[torch.optim.Optimizer], peaks: list[list[float]], factor: float,
           scale: float = 1.0) -> None:
    """Every group's lr: its peak, times ``scale`` (a hook's temporary cut), times the schedule's ``factor``."""
    for opt, group_peaks in zip(optimizers, peaks):
        for group, peak in zip(opt.param_groups, group_peaks):
            group["lr"] = peak * scale * factor


def global_batch_tokens(tokens_seen: int, default: int, ramp: list[tuple[int, int]]) -> int:
    """The global batch (tokens per optimizer step) once ``tokens_seen`` tokens have been trained on."""
    batch = default
    for threshold, tokens in ramp:
        if tokens_seen >= threshold:
            batch = tokens
    return batch


def accumulation_steps(batch_tokens: int, micro_batch: int, seq_len: int, world_size: int) -> int:
    """Micro-batches per rank that make exactly ``batch_tokens`` per step; anything else is a config error."""
    per_micro = micro_batch * seq_len * world_size
    if batch_tokens % per_micro:
        raise ConfigError(
            f"global batch of {batch_tokens:,} tokens is not a multiple of one micro-step over all ranks "
            f"(micro_batch_size {micro_batch} x seq_len {seq_len} x {world_size} rank(s) = {per_micro:,} tokens); "
            f"choose a multiple, e.g. {max(1, round(batch_tokens / per_micro)) * per_micro:,}")
    return batch_tokens // per_micro
