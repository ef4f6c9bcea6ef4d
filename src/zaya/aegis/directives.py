"""The trainer side of a rewind: the supervisor writes ``directives.json`` (skip the batches of steps F..F+n-1, cut
the learning rate for a while after F) before it relaunches from an earlier checkpoint, and this callback applies
it on every rank as the run passes those steps.

Why a file and a callback rather than new trainer options: a directive belongs to the run, not to one launch. A
later restart from a checkpoint before F must skip the same batches again (or it would replay the batch that
blew up), and one after F must not skip twice: the decision depends only on the step, so it is the same on every
rank and every relaunch. Skipping consumes the loader's batches without training on them (the step counter does
not move), as PaLM skipped the batches around a spike; the loader's position, and so every later batch, is then
exactly as if those batches had been trained on and discarded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zaya.aegis.heartbeat import write_json_atomic
from zaya.train.callbacks import Callback

DIRECTIVES_FILE = "directives.json"


def read_directives(aegis: Path) -> dict[str, Any]:
    path = Path(aegis) / DIRECTIVES_FILE
    if not path.is_file():
        return {"skip": [], "lr_cut": []}
    doc = json.loads(path.read_text())
    return {"skip": list(doc.get("skip", [])), "lr_cut": list(doc.get("lr_cut", []))}


def add_directive(aegis: Path, *, bad_step: int, skip_steps: int, lr_cut: float, lr_cut_steps: int) -> dict:
    """Record a rewind's directives for the bad step ``bad_step`` (1-based, the step that failed or spiked): skip
    the batches of ``skip_steps`` steps starting there, and scale the LR by ``lr_cut`` for ``lr_cut_steps`` steps
    from there. Returns what was added."""
    doc = read_directives(aegis)
    added: dict[str, Any] = {}
    if skip_steps > 0 and not any(s["from_step"] == bad_step for s in doc["skip"]):
        added["skip"] = {"from_step": bad_step, "steps": skip_steps}
        doc["skip"].append(added["skip"])
    if lr_cut < 1.0 and lr_cut_steps > 0:
        added["lr_cut"] = {"from_step": bad_step, "steps": lr_cut_steps, "factor": lr_cut}
        doc["lr_cut"].append(added["lr_cut"])
    Path(aegis).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(aegis) / DIRECTIVES_FILE, doc)
    return added


class Directives(Callback):
    """Applies ``directives.json`` (read once, at the start of each launch); see the module docstring."""

    def __init__(self, aegis: Path):
        self.aegis = Path(aegis)
        self.doc = read_directives(aegis)
        self.peaks: list[list[float]] | None = None
        self.skipped: list[dict[str, Any]] = []

    def on_start(self, trainer) -> None:
        self.peaks = [list(g) for g in trainer.peaks]
        self._before_step(trainer)

    def on_step_end(self, trainer, record: dict[str, Any]) -> None:
        self._before_step(trainer)

    def _before_step(self, trainer) -> None:
        """Called when ``trainer.progress.step`` steps are done, i.e. before step ``progress.step + 1``."""
        p = trainer.progress
        for skip in self.doc["skip"]:
            # Step numbers are 1-based: step F is trained when progress.step == F - 1.
            if p.step + 1 == skip["from_step"]:
                self._skip(trainer, skip["steps"], skip["from_step"])
        factor = 1.0
        for cut in self.doc["lr_cut"]:
            if cut["from_step"] <= p.step + 1 < cut["from_step"] + cut["steps"]:
                factor = min(factor, float(cut["factor"]))
        if self.peaks is not None:
            trainer.peaks = [[lr * factor for lr in group] for group in self.peaks]

    def _skip(self, trainer, steps: int, from_step: int) -> None:
        p, loader = trainer.progress, trainer.loader
        batches = 0
        for i in range(steps):
            plan = trainer.schedule.plan(p.step, p.tokens, loader.state_dict())
            if plan is None:
                break
            for _ in range(plan.accumulation):
                try:
                    next(loader)
                except StopIteration:
                    break
                batches += 1
        done = {"from_step": from_step, "steps": steps, "micro_batches": batches, "rank": trainer.runtime.rank}
        self.skipped.append(done)
        trainer.say(f"aegis: skipped the batches of steps {from_step}..{from_step + steps - 1} ({batches} "
                    "micro-batch(es) on this rank), as the rewind directive says")
