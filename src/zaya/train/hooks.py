"""What a callback sees of the run it is attached to: the ``Run`` protocol, which the trainer provides.

It sits below both the trainer and the callbacks, so neither imports the other's file: a callback reads the run's
parts and calls the few actions named here, and never reaches further into the trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from zaya.checkpoint.store import CheckpointStore
    from zaya.config import Config
    from zaya.distributed.parallel import Parallel
    from zaya.distributed.runtime import Runtime
    from zaya.train.state import RunCounters


class Run(Protocol):
    config: "Config"
    runtime: "Runtime"
    run_dir: Path
    progress: "RunCounters"
    parallel: "Parallel"
    store: "CheckpointStore"
    log: Callable[[str], None]
    """A line for the user (rank 0 shows it; on a terminal above the progress line)."""
    checkpoint_failed: bool
    """The ranks agreed, in the last step's reduction, that a save failed on one of them."""
    stopping: bool
    """The ranks agreed, in the last step's reduction, to stop after it (a signal)."""

    def tokenizer(self) -> Any: ...

    def autocast(self) -> ContextManager: ...

    def full_sequences(self) -> ContextManager: ...

    def evaluate(self) -> float | None:
        """Validation now (collective); calls every callback's ``on_evaluation``."""

    def save(self, reason: str) -> None:
        """Checkpoint now (collective); calls every callback's ``on_save``."""

    def newest_checkpoint(self) -> Path | None: ...

    def skip_batches(self, steps: int) -> int:
        """Consume the data of the next ``steps`` steps without training on it; returns the micro-batches."""

    def scale_lr(self, factor: float) -> None:
        """Scale the learning rate of the coming step only (from ``on_step_start``)."""
