"""Load a model for inference from whatever the user points at: a run directory, one training checkpoint, a zaya
checkpoint directory, or a Hugging Face ``zaya`` directory. Used by ``zaya generate``, ``zaya eval`` and ``zaya
export``. A training checkpoint must be complete and pass its checksums: a corrupt file is named, never loaded.

A training checkpoint (DCP, possibly written by many ranks) is read whole into one process: DCP reassembles the
shards, whatever world size or parallel mode wrote them.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from zaya.checkpoint.commit import checksum_problem, is_complete, latest_checkpoint, read_commit, read_meta
from zaya.checkpoint.errors import CheckpointError
from zaya.errors import ConfigError

TOKENIZER = "tokenizer.json"


def resolve_checkpoint(path: str | Path) -> tuple[str, Path]:
    """(kind, directory): kind is "training" (a DCP step directory), "zaya" or "hf"."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such checkpoint or run directory")
    if (path / "checkpoints").is_dir():
        newest = latest_checkpoint(path / "checkpoints")
        if newest is None:
            raise CheckpointError(f"{path}: the run has no complete checkpoint yet ({path / 'checkpoints'})")
        return "training", newest
    if (path / "COMMIT").exists() or (path / ".metadata").exists():
        if not is_complete(path):
            raise CheckpointError(f"{path}: incomplete checkpoint (no valid COMMIT marker); not loaded")
        return "training", path
    if (path / "zaya.json").is_file():
        return "zaya", path
    if (path / "config.json").is_file():
        return "hf", path
    raise CheckpointError(f"{path}: not a run directory, training checkpoint, zaya checkpoint or Hugging Face "
                          "zaya directory")


def find_tokenizer(kind: str, directory: Path) -> Path | None:
    candidates = [directory / TOKENIZER]
    if kind == "training":
        candidates.append(directory.parent.parent / TOKENIZER)  # <run>/checkpoints/step-N -> <run>/tokenizer.json
    return next((c for c in candidates if c.is_file()), None)


def load_for_inference(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """(model in eval mode, tokenizer path or None, the resolved directory): the one loader behind
    ``zaya.load_pretrained``, ``zaya generate``, ``zaya eval`` and ``zaya export``.

    Tensors keep their stored dtype unless ``dtype`` is given (the router's balancing state stays fp32). A training
    checkpoint is read into a model allocated without initialisation (built on the meta device), so nothing is
    computed twice; its checksums are verified first.
    """
    from zaya.config import model_config_from_dict
    from zaya.model import ZayaForCausalLM

    kind, directory = resolve_checkpoint(path)
    if kind == "training":
        import torch.distributed.checkpoint as dcp

        records = read_commit(directory)  # complete (resolve_checkpoint checked): now the checksums too
        problem = checksum_problem(directory, sorted(records), records)
        if problem is not None:
            raise CheckpointError(f"{directory}: cannot be loaded: {problem}")
        meta = read_meta(directory)
        with torch.device("meta"):
            model = ZayaForCausalLM(model_config_from_dict(meta["model_config"], f"{directory}/meta.json"))
        model.to_empty(device="cpu")
        state = {"model": model.state_dict()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, checkpoint_id=str(directory), no_dist=True)
        model.load_state_dict(state["model"])
        model.rope.reset_parameters()  # its frequency table is derived, not stored
        if dtype is not None:
            from zaya.model.io import build_from_state_dict

            model = build_from_state_dict(model.config, model.state_dict(), str(directory), dtype)
    else:
        from zaya.model.io import load_directory

        model = load_directory(directory, dtype)
    return model.to(device).eval(), find_tokenizer(kind, directory), directory


def describe(directory: Path) -> str:
    meta_path = directory / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        return f"{directory} (step {meta['step']}, {meta['tokens']:,} tokens)"
    return str(directory)
