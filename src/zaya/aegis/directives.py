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

from pathlib import Path
from typing import Any

from zaya.aegis.heartbeat import write_json_atomic
from zaya.config import INT_LIMIT
from zaya.core.errors import ConfigError
from zaya.core.fsutil import read_json
from zaya.train.callbacks import Callback

DIRECTIVES_FILE = "directives.json"


def read_directives(aegis: Path) -> dict[str, Any]:
    """The run's directives (none when there is no file). A file that is not JSON, or whose entries are not the
    ones ``add_directive`` writes, is a ConfigError naming it: every rank and relaunch acts on it, so a guess
    would skip or rescale different steps than the supervisor decided."""
    path = Path(aegis) / DIRECTIVES_FILE
    if not path.is_file():
        return {"skip": [], "lr_cut": []}
    try:
        doc = read_json(path)
        if not isinstance(doc, dict):
            raise ValueError(f"a JSON {type(doc).__name__}, not an object")
        out = {"skip": doc.get("skip", []), "lr_cut": doc.get("lr_cut", [])}
        for key, entries in out.items():
            if not isinstance(entries, list) or not all(_entry_ok(e, key == "lr_cut") for e in entries):
                raise ValueError(f"{key} is not a list of entries {{from_step >= 1, steps >= 0"
                                 + (", factor in (0, 1]" if key == "lr_cut" else "") + "}")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not the rewind directives Aegis writes ({str(exc)[:200]}); it was damaged or "
                          "written by hand: fix or remove it (without it no batches are skipped and the learning rate "
                          "is not cut)") from None
    return {"skip": list(out["skip"]), "lr_cut": list(out["lr_cut"])}


def _entry_ok(entry: Any, factor: bool) -> bool:
    def count(x: Any, lo: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and lo <= x < INT_LIMIT  # steps: train.max_steps's

    if not isinstance(entry, dict) or not count(entry.get("from_step"), 1) or not count(entry.get("steps"), 0):
        return False
    value = entry.get("factor")
    return not factor or (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1)


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
