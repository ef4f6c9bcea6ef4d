"""What the next optimizer step looks like: its stage, global batch, gradient accumulation and learning-rate factor.

Stages (sequence length, micro-batch, mixture, RoPE base) come from the data loader, which knows the token count
at which each starts; the global batch follows the batch-size ramp of the tokens seen; the learning rate is a
function of the step. Everything here is a pure function of the config and the run's position, which is what
makes resuming exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zaya.config import Config
from zaya.data.loader import Stage
from zaya.optim.build import accumulation_steps, global_batch_tokens, lr_factor


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
