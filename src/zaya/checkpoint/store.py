"""Training checkpoints through ``torch.distributed.checkpoint`` (DCP): each rank writes its own part.

Layout under ``<run_dir>/checkpoints/``::

    step-00000100/            a complete checkpoint
        .metadata, __*_*.distcp   DCP's files: model and optimizer state (sharded as they are in memory)
        meta.json              step, tokens, data-loader state, RNG states, the model config, world size, mode
        COMMIT                 written last: every file's size; its presence is what makes the checkpoint valid
    .step-00000200.partial/   a save in progress (or one that died): never loaded, removed by the next save

A save writes into the ``.partial`` directory, waits for every rank, then rank 0 writes ``meta.json`` and
``COMMIT`` and renames the directory into place: a crash at any point leaves the previous checkpoint as the
newest valid one. Keys are fully qualified parameter names (``torch.distributed.checkpoint.state_dict``), so a
checkpoint loads under another world size or another of DDP / ZeRO-1 / FSDP2.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_state_dict)

from zaya.fsutil import atomic_write_text, fsync_dir

COMMIT = "COMMIT"
META = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt, or made for another model."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def is_complete(path: Path) -> bool:
    """A directory with a COMMIT marker whose listed files all exist with their recorded sizes."""
    marker = path / COMMIT
    if not marker.is_file():
        return False
    try:
        files = json.loads(marker.read_text())["files"]
    except (json.JSONDecodeError, KeyError, OSError):
        return False
    return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in files.items())


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted((p for p in found if is_complete(p)), key=lambda p: p.name)


def latest_checkpoint(directory: Path) -> Path | None:
    done = list_checkpoints(directory)
    return done[-1] if done else None


def read_meta(path: Path) -> dict[str, Any]:
    if not is_complete(path):
        raise CheckpointError(f"{path}: not a complete checkpoint (no valid {COMMIT} marker); it is never loaded")
    return json.loads((path / META).read_text())


class CheckpointStore:
    def __init__(self, directory: str | Path, keep: int = 3, distributed: bool = False, rank: int = 0):
        self.directory = Path(directory)
        self.keep = keep
        self.distributed = distributed
        self.rank = rank

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def save(self, step: int, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
             meta: dict[str, Any]) -> Path:
        """Save collectively (every rank calls this); returns the committed directory."""
        final = self.directory / step_dir_name(step)
        partial = self.directory / f".{final.name}.partial"
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(".step-*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            partial.mkdir()
        self._barrier()
        model_sd, optim_sd = get_state_dict(model, optimizers, options=StateDictOptions())
        with warnings.catch_warnings():  # DCP warns that a single process "assumes" no process group: intended
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
        self._barrier()
        if self.rank == 0:
            atomic_write_text(partial / META, json.dumps(meta, indent=1) + "\n")
            files = {f.name: f.stat().st_size for f in sorted(partial.iterdir()) if f.is_file()}
            for f in partial.iterdir():
                if f.is_file():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
            atomic_write_text(partial / COMMIT, json.dumps({"step": step, "files": files}) + "\n")
            if final.exists():  # re-saving a step (after a resume): swap, never a moment without a valid one
                old = self.directory / f".{final.name}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(partial, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(partial, final)
            fsync_dir(self.directory)
            self._retain()
        self._barrier()
        return final

    def _retain(self) -> None:
        done = list_checkpoints(self.directory)
        for old in done[:-self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer] | None) -> dict:
        """Load model (and optimizer) state from a complete checkpoint into the live objects; return meta."""
        meta = read_meta(path)
        # Hyperparameters come from the config, not the file: a DCP round trip keeps only the state tensors
        # reliably (e.g. a torch.dtype group option does not survive), and the config may legitimately change.
        hyper = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                 for opt in optimizers or []]
        model_sd, optim_sd = get_state_dict(model, optimizers or [], options=StateDictOptions())
        state: dict[str, Any] = {"model": model_sd}
        if optimizers:
            state["optim"] = optim_sd
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, checkpoint_id=str(path))
        if optimizers:
            set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
            for opt, groups in zip(optimizers, hyper):
                for group, saved in zip(opt.param_groups, groups):
                    group.update(saved)
        else:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(model, state["model"])
        return meta


def check_model_config(meta: dict[str, Any], model_config: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint made for another model shape, naming the first differing key."""
    saved = meta.get("model_config", {})
    for key in sorted(set(saved) | set(model_config)):
        if saved.get(key) != model_config.get(key):
            raise CheckpointError(f"{path}: made for a different model: model.{key} = {saved.get(key)!r} there, "
                                  f"{model_config.get(key)!r} here (use --resume never or a new --run-dir to "
                                  "start fresh)")
