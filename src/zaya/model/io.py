"""Model files: the zaya checkpoint directory (writing and reading it) and reading a zaya or Hugging Face directory.

A zaya checkpoint is a directory with ``zaya.json`` (format tag, the ModelConfig, and, when the weights came from
a Hugging Face checkpoint, that checkpoint's config.json and generation_config.json so that converting back is
lossless) and ``model.safetensors`` holding every parameter and persistent buffer under zaya's own names (the
router's balancing biases and their moment estimates included).

Every write goes to a temporary sibling directory that is renamed into place only when complete, so a crash never
leaves a half-written checkpoint where a good one was, and ends with the directory's checksum manifest
(``zaya.model.checksums``).

Every read treats the files as untrusted data: the manifest is checked first (when there is one); safetensors are
parsed by the ``safetensors`` library, whose refusals (a 0-byte, truncated or header-corrupt file, offsets that lie)
become a ``CheckpointError`` naming the file and the fix, as do a tensor that is not float32/bfloat16/float16, one
holding NaN or inf, a missing, extra or misshapen tensor, and a JSON file that does not parse.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from zaya.config import ModelConfig, model_config_from_dict, to_dict
from zaya.core.device import DTYPES
from zaya.core.errors import CheckpointError
from zaya.core import fsutil
from zaya.core.fsutil import atomic_directory
from zaya.model.checksums import check_listed, verify_checksums, write_checksums
from zaya.model.router import BALANCING_STATE, initial_balancing_state
from zaya.model.zaya import ZayaForCausalLM

ZAYA_META = "zaya.json"
ZAYA_WEIGHTS = "model.safetensors"
FORMAT_TAG = "zaya-checkpoint"
FORMAT_VERSION = 1
WEIGHT_DTYPES = tuple(DTYPES.values())
"""The dtypes a zaya model's weights may have in a file (what ``zaya export --dtype`` writes)."""
DAMAGED = "the file is damaged or incomplete: export it again (or download it again)"
MAX_JSON_BYTES = 64 << 20
"""The largest JSON file of a model directory read (config.json, zaya.json, a shard index: a few KB to a few MB)."""


def _unreadable(path: Path, exc: BaseException) -> CheckpointError:
    if isinstance(exc, FileNotFoundError):
        return CheckpointError(f"{path} is missing; {DAMAGED}")
    detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return CheckpointError(f"{path}: not a readable safetensors file ({detail}); {DAMAGED}")


_READ_ERRORS = (SafetensorError, OSError, ValueError, TypeError, RuntimeError, OverflowError)
"""What the safetensors library and torch raise on a file they cannot turn into tensors."""


def check_weight(path: Path, name: str, tensor: torch.Tensor) -> None:
    """Refuse a weight of a dtype a zaya model cannot hold, or one holding NaN or inf, naming file and tensor."""
    if tensor.dtype not in WEIGHT_DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}; a zaya "
                              "model's weights are float32, bfloat16 or float16: this is not a zaya model's weights "
                              "file, or it is damaged: export it again (or download it again)")
    if not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).sum())
        raise CheckpointError(f"{path}: tensor {name!r} holds {bad:,} non-finite values (NaN or inf) of "
                              f"{tensor.numel():,}; such a model generates nothing useful: use an earlier, good "
                              "checkpoint (or export again from one)")


def read_safetensors(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Read every tensor of one or more safetensors files of model weights, each checked by ``check_weight``; a
    name present twice, and any file the library cannot parse, is a ``CheckpointError`` naming the file."""
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in tensors:
                        raise CheckpointError(f"{path}: tensor {name!r} also appears in an earlier shard; {DAMAGED}")
                    tensors[name] = f.get_tensor(name)
                    check_weight(path, name, tensors[name])
        except CheckpointError:
            raise
        except _READ_ERRORS as exc:
            raise _unreadable(path, exc) from None
    return tensors


def safetensors_header(path: Path) -> tuple[list[str], dict[str, str]]:
    """(tensor names, metadata) of a safetensors file, from its header alone; unreadable: ``CheckpointError``."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys()), dict(f.metadata() or {})
    except _READ_ERRORS as exc:
        raise _unreadable(path, exc) from None


def read_json(path: Path) -> Any:
    """A JSON file of a model directory; one that is missing, not a regular file (a FIFO would block), larger than
    any model directory's JSON, or cannot be read or parsed (nested 100,000 deep included) is a
    ``CheckpointError``."""
    try:
        info = Path(path).stat()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; {DAMAGED}") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror or exc}); {DAMAGED}") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} is not a regular file; {DAMAGED}")
    if info.st_size > MAX_JSON_BYTES:
        raise CheckpointError(f"{path} has {info.st_size:,} bytes, more than a model directory's JSON files hold "
                              f"({MAX_JSON_BYTES:,}); {DAMAGED}")
    try:
        return fsutil.read_json(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({str(exc)[:200]}); {DAMAGED}") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """``read_json`` of a file that must hold a JSON object."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object; {DAMAGED}")
    return value


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:blocks|layers)\.(\d+)\.")


def check_layer_count(cfg: ModelConfig, names: Iterable[str], source: str) -> None:
    """Refuse a config whose layer count differs from the layers the weights hold (zaya's ``blocks.i.``, Hugging
    Face's ``model.layers.i.``), before a model of that config is built: a count from an untrusted file must not
    make zaya build a million layers."""
    held = {int(m.group(1)) for name in names if (m := _LAYER_INDEX.search(name))}
    if len(held) != cfg.num_layers:
        raise CheckpointError(f"{source}: the config says {cfg.num_layers} layers, the weights hold {len(held)}; the "
                              "config and the weights do not belong together")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a zaya checkpoint of this config holds (computed on the meta device)."""
    with torch.device("meta"):
        model = ZayaForCausalLM(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def build_from_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor], source: str,
                          dtype: torch.dtype | None = None) -> ZayaForCausalLM:
    """Make a model whose tensors are exactly ``state`` (no re-initialisation), checking names and shapes first."""
    check_layer_count(cfg, state, source)
    with torch.device("meta"):
        model = ZayaForCausalLM(cfg)
    want = model.state_dict()
    state = _with_balancing_state(cfg, state, want)
    missing = [k for k in want if k not in state]
    if missing:
        raise CheckpointError(f"{source}: tensor {missing[0]!r} is missing ({len(missing)} missing in all): the "
                              "config and the weights do not belong together, or the weights are incomplete: export "
                              "them again (or download them again)")
    unexpected = [k for k in state if k not in want]
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in "
                              "all); does the config match the weights?")
    for name, ref in want.items():
        if tuple(state[name].shape) != tuple(ref.shape):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(state[name].shape)} but the config "
                                  f"implies {tuple(ref.shape)}; the config and the weights do not belong together")
    if dtype is not None:
        state = {k: (v.float() if _keeps_fp32(k) else v.to(dtype)) if v.is_floating_point() else v
                 for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (the RoPE frequency table) are derived from the config, not stored.
    model.rope.inv_freq = torch.empty_like(model.rope.inv_freq, device="cpu")
    model.rope.reset_parameters()
    return model


def _with_balancing_state(cfg: ModelConfig, state: dict[str, torch.Tensor],
                          want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` plus, for files written before a balancing rule's state existed, that state as a fresh router has
    it (it is the rule's memory, not a weight: the rule starts afresh from the stored biases)."""
    absent = [k for k in want if k not in state and k.rsplit(".", 1)[-1] in BALANCING_STATE]
    if not absent:
        return state
    fresh = initial_balancing_state(cfg)
    return {**state, **{k: fresh[k.rsplit(".", 1)[-1]].clone() for k in absent}}


def _keeps_fp32(name: str) -> bool:
    """Router balancing state is made fp32 whatever dtype the weights are converted to (it is added to the fp32
    softmax); converting a checkpoint that holds it in another dtype (transformers' ``model.to(bf16)`` casts buffers
    too) therefore upcasts it exactly."""
    return ".router.balanc" in name


def save_checkpoint(model: ZayaForCausalLM, directory: str | Path, overwrite: bool = True,
                    hf_config: dict[str, Any] | None = None) -> Path:
    """Write ``model`` as a zaya checkpoint directory (atomically, with its checksum manifest)."""
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        write_checkpoint(model, tmp, hf_config)
        write_checksums(tmp)
    return Path(directory)


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, except that a write the filesystem refused is the OSError it was (the
    library reports "I/O error: File too large (os error 27)" as a SafetensorError), so a full disk or a file-size
    limit is named as one (``zaya.core.errors.writing``), not a traceback."""
    try:
        save_file(tensors, str(path), metadata=metadata or {"format": "pt"})
    except SafetensorError as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from exc


def write_checkpoint(model: ZayaForCausalLM, directory: Path, hf_config: dict[str, Any] | None = None) -> None:
    """The files of a zaya checkpoint, written into the existing (empty, temporary) ``directory``; not atomic by
    itself: ``save_checkpoint`` and ``zaya.checkpoint.export`` call it inside ``atomic_directory``."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    meta: dict[str, Any] = {"format": FORMAT_TAG, "version": FORMAT_VERSION, "model": to_dict(model.config)}
    if hf_config is not None:
        meta["hf_config"] = hf_config
    elif getattr(model, "hf_config", None) is not None:
        meta["hf_config"] = model.hf_config
    if getattr(model, "hf_generation_config", None) is not None:
        meta["hf_generation_config"] = model.hf_generation_config
    save_safetensors(state, directory / ZAYA_WEIGHTS)
    (directory / ZAYA_META).write_text(json.dumps(meta, indent=2) + "\n")


def is_zaya_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / ZAYA_META).is_file()


def read_zaya_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / ZAYA_META
    meta = read_json_object(path)
    if meta.get("format") != FORMAT_TAG:
        raise CheckpointError(f"{path}: not a zaya checkpoint (format = {meta.get('format')!r})")
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {meta.get('version')!r} is not supported "
                              f"(this zaya reads version {FORMAT_VERSION}): export it again with this zaya")
    if not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"{path}: no model configuration (the 'model' object); {DAMAGED}")
    return meta


def load_checkpoint(directory: str | Path, dtype: torch.dtype | None = None) -> ZayaForCausalLM:
    """Load a zaya checkpoint directory written by ``save_checkpoint`` (or ``zaya export --format safetensors``),
    checking its checksum manifest first."""
    directory = Path(directory)
    listed = verify_checksums(directory)
    weights = directory / ZAYA_WEIGHTS
    check_listed(directory, listed, [directory / ZAYA_META, weights])
    meta = read_zaya_meta(directory)
    cfg = model_config_from_dict(meta["model"], f"{directory / ZAYA_META} [model]")
    if not weights.is_file():
        raise CheckpointError(f"{weights} is missing or not a regular file; {DAMAGED}")
    model = build_from_state_dict(cfg, read_safetensors([weights]), str(weights), dtype)
    model.hf_config = meta.get("hf_config")
    model.hf_generation_config = meta.get("hf_generation_config")
    return model
