"""The trainer side of a rewind: the supervisor writes ``directives.json`` (skip the batches of steps F..F+n-1, cut
the learning rate for a while after F) before it relaunches from an earlier checkpoint, and this callback applies
it on every rank as the run reaches those steps (its ``on_step_start`` hook).

Why a file and a callback rather than new trainer options: a directive belongs to the run, not to one launch. A
later restart from a checkpoint before F must skip the same batches again (or it would replay the batch that
blew up), and one after F must not skip twice: the decision depends only on the step, so it is the same on every
rank and every relaunch. Skipping consumes the loader's batches without training on them (``skip_batches``: the
step counter does not move), as PaLM skipped the batches around a spike; the loader's position, and so every later
batch, is then exactly as if those batches had been trained on and discarded.
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
    """Applies ``directives.json`` (read once, at the start of each launch) before each step; see the module
    docstring."""

    def __init__(self, aegis: Path):
        self.aegis = Path(aegis)
        self.doc = read_directives(aegis)
        self.skipped: list[dict[str, Any]] = []

    def on_step_start(self, trainer, step: int) -> None:
        for skip in self.doc["skip"]:
            if step == skip["from_step"]:
                batches = trainer.skip_batches(skip["steps"])
                self.skipped.append({"from_step": step, "steps": skip["steps"], "micro_batches": batches,
                                     "rank": trainer.runtime.rank})
                trainer.log(f"aegis: skipped the batches of steps {step}..{step + skip['steps'] - 1} ({batches} "
                            "micro-batch(es) on this rank), as the rewind directive says")
        cuts = [float(c["factor"]) for c in self.doc["lr_cut"]
                if c["from_step"] <= step < c["from_step"] + c["steps"]]
        if cuts:
            trainer.scale_lr(min(cuts))
