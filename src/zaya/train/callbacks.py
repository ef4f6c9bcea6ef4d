"""Everything around a training run that is not the step itself attaches as a callback.

The protocol: the trainer calls these hooks, in order, on every rank; a callback decides for itself whether it
acts on this rank (most act on rank 0 only). Only the trainer's own callbacks below (evaluation, checkpoints) take
part in collectives.

    on_start(trainer)                 the parts are built, the run (re)starts at trainer.progress.step
    on_step_start(trainer, step)      before optimizer step ``step`` (1-based) plans and reads its batches
    on_step_end(trainer, record)      after every optimizer step (a skipped step too: record["skipped"])
    on_evaluation(trainer, record)    after every validation
    on_save(trainer, step, reason)    after a checkpoint is issued ("periodic", "final" or the stop reason)
    on_stop(trainer, summary)         the run ends normally: finished, or stopped on request
    on_error(trainer, error)          the run ends with an exception (it is re-raised afterwards)

``trainer`` is a ``zaya.train.hooks.Run``; ``record`` is the dict written to metrics.jsonl (docs/training.md lists
its fields). The trainer's callbacks come first (progress line, metrics.jsonl, plots, sample), then the caller's
(Aegis's heartbeats and directives), then the scheduled work of every step: ``CheckpointFailure``, ``Evaluation``,
``Checkpoints``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zaya.core.errors import CheckpointError
from zaya.train.hooks import Run
from zaya.train.metrics import MetricsLog, Progress


class Callback:
    """Base class: every hook does nothing."""

    def on_start(self, trainer: Run) -> None:
        pass

    def on_step_start(self, trainer: Run, step: int) -> None:
        pass

    def on_step_end(self, trainer: Run, record: dict[str, Any]) -> None:
        pass

    def on_evaluation(self, trainer: Run, record: dict[str, Any]) -> None:
        pass

    def on_save(self, trainer: Run, step: int, reason: str) -> None:
        pass

    def on_stop(self, trainer: Run, summary: dict[str, Any]) -> None:
        pass

    def on_error(self, trainer: Run, error: BaseException) -> None:
        pass


class MetricsFile(Callback):
    """``metrics.jsonl`` (and TensorBoard scalars with ``tensorboard_dir``), rank 0."""

    def __init__(self, path: Path, tensorboard_dir: Path | None = None):
        self.path, self.tensorboard_dir = path, tensorboard_dir
        self.writer: MetricsLog | None = None

    def _open(self, trainer: Run) -> MetricsLog:
        """The file, opened on first use (a trainer driven step by step, without fit(), writes records too)."""
        if self.writer is None:
            self.writer = MetricsLog(self.path, trainer.runtime.is_main, self.tensorboard_dir)
        return self.writer

    def on_step_end(self, trainer: Run, record: dict[str, Any]) -> None:
        self._open(trainer).write(record)

    def on_evaluation(self, trainer: Run, record: dict[str, Any]) -> None:
        self._open(trainer).write(record)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def on_stop(self, trainer: Run, summary: dict[str, Any]) -> None:
        self.close()

    def on_error(self, trainer: Run, error: BaseException) -> None:
        self.close()


class ProgressDisplay(Callback):
    """The live progress line on a terminal, plain log lines otherwise (rank 0); the trainer's ``log`` too."""

    def __init__(self, total_steps: int, log_every: int, enabled: bool):
        self.total, self.log_every, self.enabled = total_steps, log_every, enabled
        self.display = Progress(total_steps, 0, enabled, log_every)

    def log(self, text: str) -> None:
        self.display.log(text)

    def on_start(self, trainer: Run) -> None:
        # Restart the bar at the resumed step (it was made before the checkpoint was loaded, to show start-up).
        self.display.close()
        self.display = Progress(self.total, trainer.progress.step, self.enabled, self.log_every)

    def on_step_end(self, trainer: Run, record: dict[str, Any]) -> None:
        if not record.get("skipped"):
            self.display.step(record)

    def on_evaluation(self, trainer: Run, record: dict[str, Any]) -> None:
        self.log(f"step {record['step']:>6}  validation loss {record['val_loss']:.4f}  (ppl {record['val_ppl']:.2f})")

    def close(self) -> None:
        self.display.close()

    def on_stop(self, trainer: Run, summary: dict[str, Any]) -> None:
        self.close()

    def on_error(self, trainer: Run, error: BaseException) -> None:
        self.close()


class Plots(Callback):
    """The PNGs of ``zaya plot`` at the end of a finished run (rank 0); a failure is a warning, never an error."""

    def on_stop(self, trainer: Run, summary: dict[str, Any]) -> None:
        if not (summary["finished"] and trainer.runtime.is_main):
            return
        try:
            from zaya.train.plot import plot_run

            paths = plot_run(trainer.run_dir)
            summary["plots"] = [str(p) for p in paths]
            trainer.log(f"plots: {', '.join(str(p) for p in paths)}")
        except Exception as exc:  # noqa: BLE001 - plots are a convenience; never fail a finished run over them
            trainer.log(f"warning: could not write plots ({exc})")


class Sample(Callback):
    """A generated sample from the final model, shown and put in the summary (rank 0; not under FSDP or expert
    parallelism, where the parameters are sharded over the ranks: use ``zaya generate``)."""

    def __init__(self, prompt: str, tokens: int, seed: int):
        self.prompt, self.tokens, self.seed = prompt, tokens, seed

    def on_stop(self, trainer: Run, summary: dict[str, Any]) -> None:
        if not (summary["finished"] and trainer.runtime.is_main and self.prompt and self.tokens > 0):
            return
        if trainer.parallel.sharded or trainer.parallel.experts is not None:
            trainer.log("sample: skipped under FSDP or expert parallelism, where no rank holds the whole model (run "
                        "`zaya generate --checkpoint RUN_DIR`)")
            return
        import torch

        model = trainer.parallel.model
        tokenizer = trainer.tokenizer()
        prefix = tokenizer.prefix_ids  # a prompt starts as zaya generate's does
        ids = prefix + tokenizer.encode(self.prompt)
        prompt = torch.tensor([ids], device=trainer.runtime.device)
        model.eval()
        try:
            with torch.no_grad(), trainer.autocast(), trainer.full_sequences():
                from zaya.serve.generate import generate

                out = generate(model, prompt, max_new_tokens=self.tokens, temperature=0.8, top_k=40, seed=self.seed)
        finally:
            model.train()
        sample = tokenizer.decode(out[0, len(prefix):].tolist())
        summary["sample"] = sample
        trainer.log("--- sample ---")
        trainer.log(sample)
        trainer.log("--------------")


class CheckpointFailure(Callback):
    """Stops the run after a step whose reduction says a save failed on some rank (checkpoint.on_error = "stop"
    makes the store report it): CheckpointError, exit 5, naming the step and the newest good checkpoint."""

    def on_step_end(self, trainer: Run, record: dict[str, Any]) -> None:
        if not trainer.checkpoint_failed:
            return
        failed = trainer.store.fatal or trainer.store.last_outcome
        raise CheckpointError(f"checkpoint of step {failed.step if failed else '?'} failed"
                              f"{': ' + failed.error if failed else ' on another rank'}; stopping "
                              '(checkpoint.on_error = "stop"). The newest checkpoint is '
                              f"{trainer.newest_checkpoint() or 'none'}")


class Evaluation(Callback):
    """Validation every ``every`` steps (collective; 0: never), before the last step (the run's end has its own)."""

    def __init__(self, every: int, max_steps: int):
        self.every, self.max_steps = every, max_steps

    def on_step_end(self, trainer: Run, record: dict[str, Any]) -> None:
        step = trainer.progress.step
        if self.every and step % self.every == 0 and step < self.max_steps:
            trainer.evaluate()


class Checkpoints(Callback):
    """A periodic checkpoint every ``every`` steps (collective; 0: never), before the last step and unless the run
    stops after this one (its closing save follows instead)."""

    def __init__(self, every: int, max_steps: int):
        self.every, self.max_steps = every, max_steps

    def on_step_end(self, trainer: Run, record: dict[str, Any]) -> None:
        step = trainer.progress.step
        if self.every and step % self.every == 0 and step < self.max_steps and not trainer.stopping:
            trainer.save("periodic")
