"""``load_directory``: a model from a zaya checkpoint or a Hugging Face ``zaya`` directory, whichever it holds."""

from __future__ import annotations

from pathlib import Path

import torch

from zaya.model.hf import load_hf
from zaya.model.io import ZAYA_META, is_zaya_checkpoint, load_checkpoint
from zaya.model.zaya import ZayaForCausalLM


def load_directory(path: str | Path, dtype: torch.dtype | None = None) -> ZayaForCausalLM:
    """A model from a zaya checkpoint or a Hugging Face ``zaya`` directory (config.json + safetensors), in eval mode.

    Tensors keep their stored dtype unless ``dtype`` is given. Nothing is re-initialised: the router's balancing
    biases come from the file. The reader behind ``zaya.load_pretrained`` (``zaya.checkpoint.consolidate``), which
    also takes run directories and training checkpoints.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory (expected a zaya checkpoint or a Hugging Face model "
                                "directory)")
    if is_zaya_checkpoint(path):
        model = load_checkpoint(path, dtype)
    elif (path / "config.json").is_file():
        model = load_hf(path, dtype)
    else:
        raise FileNotFoundError(f"{path} holds neither {ZAYA_META} (zaya checkpoint) nor config.json "
                                "(Hugging Face checkpoint)")
    return model.eval()
