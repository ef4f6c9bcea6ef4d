"""``train.init_from``: a new run's weights from a Hugging Face ``zaya`` directory, a zaya export, a run or a
training checkpoint (resolved as ``consolidate.resolve_checkpoint`` resolves it for inference).

``open_source`` (collective) resolves the path, verifies the files and reads the model config and the tensor names
on rank 0 only, and hands every rank the result. ``merged_model_config`` takes the run's model config from the
source: a key the source fixes (``SETTABLE`` lists the others) that the run sets to another value is an error.
``load_weights`` (collective) fills the model already built, and wrapped for its parallel mode, in place, tensor by
tensor in row blocks: under FSDP2 each rank reads only the bytes of its own shards (safetensors slices, DCP's
planner for a training checkpoint), and under expert parallelism only the experts it holds; otherwise each rank
reads every tensor into its one copy of the model. The router's balancing state comes from the source when it holds
it (a plain HF download does not: then it starts as a fresh router's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from zaya.config import ModelConfig, model_config_from_dict, to_dict
from zaya.core.errors import CheckpointError, ConfigError
from zaya.model.io import DAMAGED, ZAYA_META, ZAYA_WEIGHTS, check_layer_count, check_weight, read_zaya_meta
from zaya.model.router import BALANCING_STATE, initial_balancing_state

READ_CHUNK_BYTES = 16 << 20
"""The most bytes (as fp32) read from a safetensors file at a time: a large tensor (ZAYA1's 2 GB embedding) is
read in row blocks, each file mapping closed after its block, so reading adds tens of MB to a rank's resident
memory, not a tensor's size (benchmarks/init_memory.py)."""
SETTABLE = frozenset({
    "rope_theta", "max_seq_len", "residual_fp32", "moe_impl", "qk_temperature_init", "router_skip_bias_init",
    "init_std", "router_balancing", "router_balance_step", "router_balance_step_max", "router_balance_step_min",
    "router_aux_loss_coef", "router_balance_lr", "router_balance_betas", "router_balance_eps"})
"""Model keys a run may set that the source's weights do not fix: the context length and RoPE base of a new stage,
the residual stream's precision, the expert matmul path, the balancing rule, and the init-only keys (nothing is
initialised). Every other model key is the source's."""


@dataclass(frozen=True)
class InitSource:
    """A resolved ``train.init_from``: what to load and what comes with it."""

    path: str
    kind: str
    """"training" (a DCP step directory), "zaya" (a zaya checkpoint or export) or "hf"."""
    directory: Path
    config: ModelConfig
    tensors: tuple[tuple[str, str, str], ...]
    """(file, name in the file, zaya name) of every tensor of a safetensors source; empty for "training"."""
    tokenizer: Path | None
    """The source's tokenizer.json (its directory holds the files that travel with it), or None."""


def open_source(path: str, runtime, log: Callable[[str], None]) -> InitSource:
    """Resolve and check ``path`` on rank 0 (collective): every rank gets the same ``InitSource`` or the same
    error."""
    source, error = None, None
    if runtime.is_main:
        try:
            source = _open(path, log)
        except Exception as exc:  # noqa: BLE001 - reported on every rank by agree()
            error = exc
    runtime.agree(error, "start-up (train.init_from)")
    return runtime.broadcast_object(source)


def _open(path: str, log: Callable[[str], None]) -> InitSource:
    from zaya.checkpoint.commit import read_meta
    from zaya.checkpoint.consolidate import find_tokenizer, resolve_checkpoint
    from zaya.checkpoint.reader import AllowListReader
    from zaya.model.checksums import check_listed, verify_checksums

    kind, directory = resolve_checkpoint(path, log)  # a training checkpoint's checksums are verified here
    tensors: list[tuple[str, str, str]] = []
    shapes: dict[str, tuple[int, ...]] = {}
    if kind == "training":
        meta = read_meta(directory)
        if not isinstance(meta.get("model_config"), dict):
            raise CheckpointError(f"{directory}/meta.json has no model_config: not a checkpoint of a zaya model")
        config = model_config_from_dict(meta["model_config"], f"{directory}/meta.json")
        names = list(AllowListReader(directory).read_metadata().state_dict_metadata)
        source = str(directory)
    elif kind == "zaya":
        listed = verify_checksums(directory)
        weights = directory / ZAYA_WEIGHTS
        check_listed(directory, listed, [directory / ZAYA_META, weights])
        config = model_config_from_dict(read_zaya_meta(directory)["model"], str(directory / ZAYA_META))
        tensors = [(str(weights), name, name) for name in _header(weights, shapes)]
        names, source = [t[2] for t in tensors], str(weights)
    else:
        from zaya.model.hf import EXTRAS_FILE, checked_weight_files, hf_model_config, hf_to_zaya_name

        files = checked_weight_files(directory)
        extras = directory / EXTRAS_FILE
        config, _ = hf_model_config(directory)
        for file in files:
            for name in _header(file, shapes):
                if name == "lm_head.weight" and config.tie_embeddings:
                    continue  # a tied head is the embedding: the copy some writers add is not loaded
                try:
                    tensors.append((str(file), name, hf_to_zaya_name(name)))
                except KeyError:
                    raise CheckpointError(f"{file}: unexpected tensor {name!r}; it has no place in the zaya layout "
                                          "(not a zaya model, or config.json does not belong to these weights)"
                                          ) from None
        if extras.is_file():
            tensors += [(str(extras), name, name) for name in _header(extras, shapes)]
        names, source = [t[2] for t in tensors], str(directory)
    check_layer_count(config, names, source)  # before a model of that many layers is built
    if tensors:
        _check_names(config, tensors, shapes, source)
    tokenizer = find_tokenizer(kind, directory)
    return InitSource(str(path), kind, directory, config, tuple(tensors), tokenizer)


def _header(file: Path, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The tensor names of a safetensors file, from its header; their shapes go into ``shapes`` under
    ``file:name``."""
    from zaya.model.io import safetensors_header

    names = safetensors_header(file)[0]  # an unreadable file is named here
    with safe_open(str(file), framework="pt") as f:
        for name in names:
            shapes[f"{file}:{name}"] = tuple(f.get_slice(name).get_shape())
    return names


def _check_names(config: ModelConfig, tensors: list[tuple[str, str, str]], shapes: dict[str, tuple[int, ...]],
                 source: str) -> None:
    """Every tensor of the model present once (the balancing state may be absent), shaped as the config says,
    nothing else: from the headers, before anything is built or read."""
    from zaya.model.io import expected_shapes

    want = expected_shapes(config)
    seen: dict[str, str] = {}
    for file, name, ours in tensors:
        if ours in seen:
            raise CheckpointError(f"{file}: tensor {name!r} also appears in {seen[ours]}; {DAMAGED}")
        seen[ours] = file
        if ours not in want:
            raise CheckpointError(f"{file}: unexpected tensor {name!r}; does the config match the weights?")
        shape = shapes[f"{file}:{name}"]
        if shape != want[ours]:
            raise CheckpointError(f"{file}: tensor {name!r} has shape {shape} but the config implies {want[ours]}; "
                                  "the config and the weights do not belong together")
    missing = [k for k in want if k not in seen and k.rsplit(".", 1)[-1] not in BALANCING_STATE]
    if missing:
        raise CheckpointError(f"{source}: tensor {missing[0]!r} is missing ({len(missing)} missing in all): the "
                              "weights are incomplete: export them again (or download them again)")


def merged_model_config(run: ModelConfig, source: InitSource) -> ModelConfig:
    """The model config of a run started from ``source``: the source's, with the run's own value of each
    ``SETTABLE`` key it sets. A key the run leaves at its default takes the source's value; a fixed key set to
    another value than the source's is a ConfigError naming both."""
    default, mine, theirs = to_dict(ModelConfig()), to_dict(run), to_dict(source.config)
    merged = dict(theirs)
    for f in fields(ModelConfig):
        key = f.name
        if mine[key] == default[key] or mine[key] == theirs[key]:
            continue
        if key not in SETTABLE:
            raise ConfigError(f"model.{key} = {mine[key]!r} contradicts train.init_from {source.path}, whose model has "
                              f"{key} = {theirs[key]!r}: the weights fix it; remove model.{key} from the config (or "
                              f"set it to {theirs[key]!r})")
        merged[key] = mine[key]
    return model_config_from_dict(merged, f"model config of train.init_from {source.path}")


@torch.no_grad()
def load_weights(source: InitSource, wrapped: torch.nn.Module, runtime, experts=None) -> None:
    """Fill ``wrapped`` (the model in its parallel wrapper, its tensors allocated but not initialised) with the
    source's weights, in place (collective: a failure on any rank is raised on every rank). ``experts``: the
    ``ExpertParallel`` layout whose shards the model holds (each rank reads only its own experts), or None."""
    error = None
    try:
        live = get_model_state_dict(wrapped)
        targets = experts.placed(live) if experts is not None else live
        if source.kind == "training":
            _load_training(source, targets, runtime)
        else:
            _load_safetensors(source, targets)
        set_model_state_dict(wrapped, live)
    except Exception as exc:  # noqa: BLE001 - reported on every rank by agree()
        error = exc
    runtime.agree(error, "start-up (loading train.init_from)")


def _load_training(source: InitSource, live: dict[str, torch.Tensor], runtime) -> None:
    from zaya.checkpoint.reader import load_dcp

    flat = {f"model.{k}": v for k, v in live.items()}
    load_dcp(source.directory, flat, distributed=runtime.distributed)  # DCP reads only this rank's shards
    for key, tensor in flat.items():
        check_weight(source.directory, key, _local(tensor))


def _load_safetensors(source: InitSource, live: dict[str, torch.Tensor]) -> None:
    for file, name, ours in source.tensors:
        target = live[ours]
        local = _local(target)
        if isinstance(target, DTensor):
            shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        else:
            shape, offset = tuple(local.shape), (0,) * local.dim()
        if local.dim() == 0:
            with safe_open(file, framework="pt") as f:
                _fill(local, f.get_tensor(name), file, name)
            continue
        rows = max(1, READ_CHUNK_BYTES // max(1, math.prod(shape[1:]) * 4))
        for start in range(0, shape[0], rows):
            n = min(rows, shape[0] - start)
            index = (slice(offset[0] + start, offset[0] + start + n),
                     *(slice(o, o + size) for o, size in zip(offset[1:], shape[1:])))
            with safe_open(file, framework="pt") as f:  # closed after each piece: its mapped pages leave the RSS
                _fill(local[start:start + n], f.get_slice(name)[index], file, name)
    held = {ours for _, _, ours in source.tensors}
    fresh = None
    for key, tensor in live.items():
        if key not in held:  # only balancing state may be absent (checked by open_source)
            fresh = fresh if fresh is not None else initial_balancing_state(source.config)
            _local(tensor).copy_(fresh[key.rsplit(".", 1)[-1]])


def _fill(target: torch.Tensor, piece: torch.Tensor, file: str, name: str) -> None:
    check_weight(Path(file), name, piece)
    target.copy_(piece)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def check_tokenizer(source: InitSource, datasets: dict, log: Callable[[str], None]) -> Path | None:
    """The directory whose tokenizer files the run keeps: the source's, after checking that every dataset was
    prepared with that tokenizer (``Tokenizer.sha256``) and that its ids fit the model; None when the source has no
    tokenizer (the datasets' is kept)."""
    from zaya.data.tokenizer import Tokenizer

    if source.tokenizer is None:
        log(f"train.init_from {source.path} has no tokenizer.json: the run keeps its data's tokenizer")
        return None
    tokenizer = Tokenizer.from_file(source.tokenizer)
    warning = tokenizer.check_model(source.config.vocab_size, source.config.eos_token_id, source.path)
    if warning:
        log(f"warning: {warning}")
    for name, dataset in datasets.items():
        theirs = dataset.manifest["tokenizer"].get("sha256") or dataset.tokenizer().sha256
        if theirs != tokenizer.sha256:
            raise ConfigError(f"data.datasets.{name} ({dataset.directory}) was prepared with another tokenizer "
                              f"({dataset.manifest['tokenizer'].get('source')}, sha256 {theirs[:12]}) than "
                              f"train.init_from's ({source.tokenizer}, sha256 {tokenizer.sha256[:12]}): prepare the "
                              f"data with the model's tokenizer: zaya data prepare --tokenizer {source.tokenizer} ...")
    return source.tokenizer.parent
