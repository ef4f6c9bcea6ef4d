"""Load a model for inference from whatever the user points at: a run directory (or its ``checkpoints/``), one
training checkpoint, a zaya checkpoint directory, or a Hugging Face ``zaya`` directory. Used by ``zaya generate``,
``zaya eval``, ``zaya serve``, ``zaya export`` and ``zaya.load_pretrained``.

A training checkpoint must be complete and pass its checksums, and is read through the allow-list reader
(``reader.py``: its files are data, never code). Given a run, the newest checkpoint that passes verification is
loaded, as training's resume does (``commit.newest_loadable``); each newer one that fails (damaged: its COMMIT
marker, a file's presence, kind or size, or a checksum) is named on stderr with the reason, and left where it is: an
inference command reads a run directory, it never changes it (training moves a failed checkpoint aside, as the run
directory is its own). A step directory without a COMMIT marker is a save in progress (or one that died), skipped
without a word. A training checkpoint named directly is loaded or refused,
never swapped for another. The weights read are checked for NaN and inf, whatever the source.

A training checkpoint (DCP, possibly written by many ranks) is read whole into one process: DCP reassembles the
shards, whatever world size or parallel mode wrote them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

import torch

from zaya.checkpoint.commit import (METADATA, NO_MARKER, STEP_DIR, committed_checkpoints, has_marker, newest_loadable,
                                    read_meta, unloadable, verification_problem)
from zaya.checkpoint.errors import CheckpointError
from zaya.checkpoint.reader import AllowListReader, check_entries, load_dcp
from zaya.core.errors import ConfigError
from zaya.core.layout import checkpoints_dir

TOKENIZER = "tokenizer.json"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def resolve_checkpoint(path: str | Path, log: Callable[[str], None] = _stderr) -> tuple[str, Path]:
    """(kind, directory): kind is "training" (a DCP step directory that passed verification), "zaya" or "hf".
    A run directory (or its ``checkpoints/``) gives its newest checkpoint that passes verification; ``log`` hears
    about each newer one skipped."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such checkpoint or run directory")
    checkpoints = checkpoints_dir(path) if checkpoints_dir(path).is_dir() else path
    if checkpoints != path or (path.is_dir() and any(STEP_DIR.match(p.name) for p in path.iterdir())):
        candidates = committed_checkpoints(checkpoints)  # a save in progress (no COMMIT yet) is no candidate
        if not candidates:
            raise CheckpointError(f"{path}: the run has no complete checkpoint yet ({checkpoints})")
        failures: list[str] = []

        def skipped(step: Path, problem: str) -> None:
            failures.append(f"{step.name}: {problem}")
            if step != candidates[0]:  # the oldest one's failure ends in the error below
                log(f"warning: skipping checkpoint {step}: it fails verification ({problem}); trying the previous "
                    "one")

        chosen = newest_loadable(candidates, verification_problem, skipped)
        if chosen is None:
            raise CheckpointError(f"{path}: no checkpoint of the run passes verification ({'; '.join(failures)})")
        return "training", chosen
    if has_marker(path) or os.path.lexists(path / METADATA):
        if not has_marker(path):
            raise CheckpointError(f"{path}: incomplete checkpoint ({NO_MARKER}); not loaded")
        problem = verification_problem(path)
        if problem is not None:
            raise unloadable(path, problem)
        return "training", path
    if (path / "zaya.json").is_file():
        return "zaya", path
    if (path / "config.json").is_file():
        return "hf", path
    raise CheckpointError(f"{path}: not a run directory, training checkpoint, zaya checkpoint or Hugging Face "
                          "zaya directory")


def find_tokenizer(kind: str, directory: Path) -> Path | None:
    """The tokenizer.json beside a checkpoint (or its run's), or None. An export's must be one its ``SHA256SUMS``
    lists, as every other file a load reads (``load_for_inference`` has checked the listed ones)."""
    from zaya.model.checksums import check_listed, read_manifest

    candidates = [directory / TOKENIZER]
    if kind == "training":
        candidates.append(directory.parent.parent / TOKENIZER)  # <run>/checkpoints/step-N -> <run>/tokenizer.json
    found = next((c for c in candidates if c.is_file()), None)
    if found is not None and found.parent == directory and kind != "training":
        listed = read_manifest(directory)
        check_listed(directory, None if listed is None else set(listed), [found])
    return found


def load_for_inference(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                       log: Callable[[str], None] = _stderr):
    """(model in eval mode, tokenizer path or None, the resolved directory): the one loader behind
    ``zaya.load_pretrained``, ``zaya generate``, ``zaya eval``, ``zaya serve`` and ``zaya export``.

    Tensors keep their stored dtype unless ``dtype`` is given (the router's balancing state stays fp32). A training
    checkpoint is read into a model allocated without initialisation (built on the meta device), so nothing is
    computed twice; its checksums are verified first (``resolve_checkpoint``; ``log`` hears of a checkpoint skipped).
    Anything wrong with the files is a ``CheckpointError`` naming the file and the fix.
    """
    from zaya.config import model_config_from_dict
    from zaya.model import ZayaForCausalLM
    from zaya.model.info import parameter_count
    from zaya.model.io import check_layer_count, check_weight

    kind, directory = resolve_checkpoint(path, log)
    if kind == "training":
        meta = read_meta(directory)
        if not isinstance(meta.get("model_config"), dict):
            raise CheckpointError(f"{directory}/meta.json has no model_config: not a checkpoint of a zaya model")
        config = model_config_from_dict(meta["model_config"], f"{directory}/meta.json")
        reader = AllowListReader(directory)
        metadata = reader.read_metadata()
        check_layer_count(config, metadata.state_dict_metadata, str(directory))  # before building that many
        with torch.device("meta"):
            model = ZayaForCausalLM(config)
        check_entries(directory, metadata, {f"model.{k}": v for k, v in model.state_dict().items()})
        try:
            model.to_empty(device="cpu")
        except (RuntimeError, MemoryError) as exc:
            raise CheckpointError(f"{directory}: its model ({parameter_count(model):,} parameters) cannot be allocated here "
                                  f"({type(exc).__name__}); load it on a machine with more memory") from None
        state = {f"model.{k}": v for k, v in model.state_dict().items()}
        load_dcp(directory, state, reader=reader)
        for key, tensor in state.items():
            check_weight(directory, key, tensor)
        model.rope.reset_parameters()  # its frequency table is derived, not stored
        if dtype is not None:
            from zaya.model.io import build_from_state_dict

            model = build_from_state_dict(model.config, model.state_dict(), str(directory), dtype)
    else:
        from zaya.model.load import load_directory

        model = load_directory(directory, dtype)
    return model.to(device).eval(), find_tokenizer(kind, directory), directory


def describe(directory: Path) -> str:
    try:
        meta = read_meta(directory)
        return f"{directory} (step {int(meta['step'])}, {int(meta['tokens']):,} tokens)"
    except (CheckpointError, KeyError, TypeError, ValueError, OverflowError):
        return str(directory)
