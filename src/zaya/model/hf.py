"""Import and export of the Hugging Face ``zaya`` checkpoint layout (config.json + safetensors, sharded or not).

This is the layout ``transformers``' ``ZayaForCausalLM.save_pretrained`` writes and the released ZAYA1 weights use.
Tensor names map one to one onto zaya's (see ``_RENAMES``); the experts are already stacked 3-D tensors in both.
Differences handled here:

- the tied LM head: ``lm_head.weight`` is written only when embeddings are untied; a tied file that carries it
  anyway must hold the same values as the embedding;
- the router's balancing-bias moment estimates and the zaya-only config options (balancing step size, init
  choices, ...) have no place in the HF layout; they travel in a side file, ``zaya_extras.safetensors``, that
  ``transformers`` ignores. Importing a checkpoint without it starts the moments at zero;
- the original config.json (and generation_config.json, when there is one) is kept with the model, so converting
  HF -> zaya -> HF gives back the same files and bit-identical tensors.

Reading a directory checks, before any tensor is used: its ``SHA256SUMS`` (``zaya.model.checksums``; written by
``save_hf`` and ``zaya export``, absent from other sources), a sharded index against its shards' headers (every tensor
in the shard the index names), and each tensor as ``zaya.model.io`` reads it. Every failure is a ``CheckpointError``
naming the file and the fix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from zaya.config import ConfigError, ModelConfig, model_config_from_dict, to_dict
from zaya.core.device import dtype_name
from zaya.core.errors import CheckpointError
from zaya.core.fsutil import loads_json
from zaya.model.checksums import check_listed, verify_checksums, write_checksums
from zaya.model.io import (DAMAGED, atomic_directory, build_from_state_dict, check_layer_count, expected_shapes,
                           read_json_object, read_safetensors, safetensors_header, save_safetensors)
from zaya.model.router import BALANCING_STATE
from zaya.model.zaya import ZayaForCausalLM

# (zaya suffix, HF suffix) for tensors inside decoder layer i: "blocks.{i}." <-> "model.layers.{i}.".
_RENAMES: list[tuple[str, str]] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attention.q_proj.weight", "self_attn.qkv_proj.q_proj.weight"),
    ("attention.k_proj.weight", "self_attn.qkv_proj.k_proj.weight"),
    ("attention.v_current_proj.weight", "self_attn.qkv_proj.v_proj_current.weight"),
    ("attention.v_previous_proj.weight", "self_attn.qkv_proj.v_proj_delayed.weight"),
    ("attention.conv_depthwise.weight", "self_attn.qkv_proj.conv_qk_depthwise.weight"),
    ("attention.conv_depthwise.bias", "self_attn.qkv_proj.conv_qk_depthwise.bias"),
    ("attention.conv_grouped.weight", "self_attn.qkv_proj.conv_qk_grouped.weight"),
    ("attention.conv_grouped.bias", "self_attn.qkv_proj.conv_qk_grouped.bias"),
    ("attention.temperature", "self_attn.qk_norm.temp"),
    ("attention.o_proj.weight", "self_attn.o_proj.weight"),
    ("attn_residual.branch_scale", "post_attention_residual_scale.hidden_states_scale"),
    ("attn_residual.branch_bias", "post_attention_residual_scale.hidden_states_bias"),
    ("attn_residual.residual_scale", "post_attention_residual_scale.residual_scale"),
    ("attn_residual.residual_bias", "post_attention_residual_scale.residual_bias"),
    ("moe_norm.weight", "post_attention_layernorm.weight"),
    ("moe.router.down_proj.weight", "mlp.gate.down_proj.weight"),
    ("moe.router.down_proj.bias", "mlp.gate.down_proj.bias"),
    ("moe.router.eda_scale", "mlp.gate.router_states_scale"),
    ("moe.router.norm.weight", "mlp.gate.router_mlp.norm.weight"),
    ("moe.router.fc1.weight", "mlp.gate.router_mlp.fc1.weight"),
    ("moe.router.fc1.bias", "mlp.gate.router_mlp.fc1.bias"),
    ("moe.router.fc2.weight", "mlp.gate.router_mlp.fc2.weight"),
    ("moe.router.fc2.bias", "mlp.gate.router_mlp.fc2.bias"),
    ("moe.router.out_proj.weight", "mlp.gate.router_mlp.out_proj.weight"),
    ("moe.router.balancing_biases", "mlp.gate.balancing_biases"),
    ("moe.experts.gate_up_proj", "mlp.experts.gate_up_proj"),
    ("moe.experts.down_proj", "mlp.experts.down_proj"),
    ("moe_residual.branch_scale", "post_mlp_residual_scale.hidden_states_scale"),
    ("moe_residual.branch_bias", "post_mlp_residual_scale.hidden_states_bias"),
    ("moe_residual.residual_scale", "post_mlp_residual_scale.residual_scale"),
    ("moe_residual.residual_bias", "post_mlp_residual_scale.residual_bias"),
]
_TOP: list[tuple[str, str]] = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("input_affine.scale", "model.input_hidden_states_scale"),
    ("input_affine.bias", "model.input_hidden_states_bias"),
    ("final_norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]
_ZAYA_ONLY = tuple(f"moe.router.{name}" for name in BALANCING_STATE)
_LAYER = re.compile(r"^blocks\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TO_HF = dict(_RENAMES)
_FROM_HF = {hf: ours for ours, hf in _RENAMES}

MAX_SHARD_BYTES = 5 * 1024**3
EXTRAS_FILE = "zaya_extras.safetensors"
GENERATION_CONFIG = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"


def zaya_to_hf_name(name: str) -> str | None:
    """HF tensor name for a zaya one; None for zaya-only state."""
    m = _LAYER.match(name)
    if m:
        if m.group(2) in _ZAYA_ONLY:
            return None
        return f"model.layers.{m.group(1)}.{_TO_HF[m.group(2)]}"
    return dict(_TOP)[name]


def hf_to_zaya_name(name: str) -> str:
    m = _HF_LAYER.match(name)
    if m and m.group(2) in _FROM_HF:
        return f"blocks.{m.group(1)}.{_FROM_HF[m.group(2)]}"
    top = {hf: ours for ours, hf in _TOP}
    if name in top:
        return top[name]
    raise KeyError(name)


# --------------------------------------------------------------------------------------------------- configs
def model_config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """ModelConfig for a Hugging Face zaya config.json; unsupported settings are errors naming the key."""
    if hf.get("model_type") != "zaya":
        raise ConfigError(f"{source}: model_type = {hf.get('model_type')!r}; only 'zaya' checkpoints are supported")

    def need(key: str, ok: bool, rule: str) -> None:
        if not ok:
            raise ConfigError(f"{source}: {key} = {hf.get(key)!r} is not supported by zaya ({rule})")

    def real(key: str, value: Any) -> float:  # config.json is untrusted: a wrong type is named, never a traceback
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: {key} = {value!r} is not a number")
        return float(value)

    layer_types = hf.get("layer_types")
    need("layer_types", layer_types is None or (isinstance(layer_types, list) and all(t == "hybrid" for t in
                                                                                      layer_types)),
         "only full-attention 'hybrid' layers")
    need("hidden_act", hf.get("hidden_act", "silu") == "silu", "experts are SwiGLU with silu")
    need("attention_bias", not hf.get("attention_bias", False), "attention projections have no bias")
    need("lm_head_bias", not hf.get("lm_head_bias", False), "the LM head has no bias")
    need("tie_word_embeddings", isinstance(hf.get("tie_word_embeddings", True), bool), "true or false")
    rope = hf.get("rope_parameters") or {}
    rope = rope.get("hybrid", rope) if isinstance(rope, dict) else None
    need("rope_parameters", isinstance(rope, dict) and rope.get("rope_type", "default") == "default",
         "only default RoPE")
    eos = hf.get("eos_token_id", 106)
    need("eos_token_id", not isinstance(eos, list) or len(eos) > 0, "an id or a non-empty list of ids")
    vocab = hf.get("vocab_size", 262272)
    for extra in (eos[1:] if isinstance(eos, list) else []):  # the first is checked as the model's eos_token_id
        need("eos_token_id", type(extra) is int and (type(vocab) is not int or 0 <= extra < vocab),
             f"ids of the vocabulary (0 to {vocab - 1 if type(vocab) is int else '?'})")
    values = dict(
        vocab_size=hf.get("vocab_size", 262272),
        hidden_size=hf.get("hidden_size", 2048),
        num_layers=hf.get("num_hidden_layers", 40),
        attention="cca",
        num_query_heads=hf.get("num_attention_heads", 8),
        num_kv_heads=hf.get("num_key_value_heads", 2),
        head_dim=hf.get("head_dim", 128),
        cca_depthwise_kernel=hf.get("cca_time0", 2),
        cca_grouped_kernel=hf.get("cca_time1", 2),
        rope_theta=real("rope_parameters.rope_theta", rope.get("rope_theta", 5_000_000.0)),
        rope_fraction=real("rope_parameters.partial_rotary_factor", rope.get("partial_rotary_factor", 0.5)),
        max_seq_len=hf.get("max_position_embeddings", 131072),
        num_experts=hf.get("num_experts", 16),
        top_k=hf.get("num_experts_per_tok", 1),
        expert_hidden_size=hf.get("moe_intermediate_size", 2048),
        router="zaya",
        router_hidden_size=hf.get("router_hidden_size", 256),
        router_eda=True,
        router_skip_expert=True,
        norm_eps=real("rms_norm_eps", hf.get("rms_norm_eps", 1e-5)),
        residual_fp32=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        init_std=real("initializer_range", hf.get("initializer_range", 0.02)),
        pad_token_id=hf.get("pad_token_id") if hf.get("pad_token_id") is not None else 0,
        bos_token_id=hf.get("bos_token_id") if hf.get("bos_token_id") is not None else 2,
        eos_token_id=(eos[0] if isinstance(eos, list) else eos) if eos is not None else 106,
    )
    return model_config_from_dict(values, source)


# ModelConfig fields that config.json determines (everything model_config_from_hf sets).
_HF_OWNED_FIELDS = frozenset({
    "vocab_size", "hidden_size", "num_layers", "attention", "num_query_heads", "num_kv_heads", "head_dim",
    "cca_depthwise_kernel", "cca_grouped_kernel", "rope_theta", "rope_fraction", "max_seq_len", "num_experts",
    "top_k", "expert_hidden_size", "router", "router_hidden_size", "router_eda", "router_skip_expert", "norm_eps",
    "tie_embeddings", "init_std", "pad_token_id", "bos_token_id", "eos_token_id"})
# residual_fp32 is set by model_config_from_hf (the HF port always keeps the residual stream in fp32) but config.json
# cannot express it, so a side file's value wins: a zaya model with residual_fp32 = false survives zaya -> HF -> zaya.


def hf_config_from_model_config(cfg: ModelConfig, base: dict[str, Any] | None = None,
                                dtype: torch.dtype | None = None) -> dict[str, Any]:
    """config.json for ``cfg``; ``base`` (an imported checkpoint's config) keeps keys zaya does not model."""
    if cfg.attention != "cca" or cfg.router != "zaya" or not cfg.router_skip_expert or not cfg.router_eda:
        raise ConfigError("only attention = 'cca' with router = 'zaya' (EDA and skip class on) has a Hugging Face "
                          f"zaya layout; this model has attention = {cfg.attention!r}, router = {cfg.router!r}, "
                          f"router_eda = {cfg.router_eda}, router_skip_expert = {cfg.router_skip_expert}")
    out = dict(base or {})
    eos = out.get("eos_token_id")
    out.update(
        model_type="zaya",
        architectures=out.get("architectures", ["ZayaForCausalLM"]),
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_query_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        cca_time0=cfg.cca_depthwise_kernel,
        cca_time1=cfg.cca_grouped_kernel,
        max_position_embeddings=cfg.max_seq_len,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        moe_intermediate_size=cfg.expert_hidden_size,
        router_hidden_size=cfg.router_hidden_size,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        hidden_act="silu",
        attention_bias=False,
        lm_head_bias=False,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=eos if (eos == cfg.eos_token_id or (isinstance(eos, list) and eos and eos[0] == cfg.eos_token_id))
        else cfg.eos_token_id,
    )
    rope = dict(out.get("rope_parameters") or {})
    hybrid = dict(rope.get("hybrid") or {"rope_type": "default"})
    hybrid.update(rope_theta=cfg.rope_theta, partial_rotary_factor=cfg.rope_fraction)
    rope["hybrid"] = hybrid
    out["rope_parameters"] = rope
    if "layer_types" in out:
        out["layer_types"] = ["hybrid"] * cfg.num_layers
    if base:
        try:
            unchanged = _hf_owned(model_config_from_hf(base)) == _hf_owned(cfg)
        except (ConfigError, TypeError, ValueError):
            unchanged = False
        if unchanged:
            # Nothing config.json expresses has changed: give the imported config back exactly as it was (keys
            # left to transformers' defaults stay absent, null token ids stay null, eos lists stay lists).
            out = json.loads(json.dumps(base))
    if dtype is not None:
        name = dtype_name(dtype)
        if out.get("dtype", out.get("torch_dtype")) != name:
            out["dtype"] = name
            if "torch_dtype" in out:
                out["torch_dtype"] = name
    return out


def _hf_owned(cfg: ModelConfig) -> dict[str, Any]:
    return {k: v for k, v in to_dict(cfg).items() if k in _HF_OWNED_FIELDS}


# --------------------------------------------------------------------------------------------------- tensors
def hf_state_dict(model: ZayaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face names (tied head omitted, zaya-only balancing state dropped)."""
    out = {}
    for name, tensor in model.state_dict().items():
        hf_name = zaya_to_hf_name(name)
        if hf_name is not None:
            out[hf_name] = tensor.detach().contiguous().cpu()
    return out


def zaya_state_dict_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig,
                            source: str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            embed = tensors.get("model.embed_tokens.weight")
            if embed is not None and not torch.equal(embed, tensor):
                raise CheckpointError(f"{source}: lm_head.weight differs from model.embed_tokens.weight although "
                                      "tie_word_embeddings is true; " + DAMAGED)
            continue
        try:
            state[hf_to_zaya_name(name)] = tensor
        except KeyError:
            raise CheckpointError(f"{source}: unexpected tensor {name!r}; it has no place in the zaya layout (not a "
                                  "zaya model, or config.json does not belong to these weights)") from None
    # zaya-only router state (the balancing rule's memory) is not in this layout: build_from_state_dict starts it
    # afresh, from the imported biases.
    return state


def hf_weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a HF checkpoint directory, sharded (index json) or single. An index that does not
    parse, names a file outside the directory or a missing shard, is a ``CheckpointError``."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = _weight_map(index)
        files = sorted({directory / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} lists {f.name}, which is missing: the download or copy is "
                                      "incomplete: export it again (or download it again)")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{directory}: no model.safetensors or {INDEX_FILE} (only safetensors checkpoints are "
                          "supported; re-save with safe_serialization=True)")


def _weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) and v.endswith(".safetensors") and "/" not in v
            and "\\" not in v for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: its weight_map is not a mapping of tensor names to safetensors files of "
                              f"this directory; {DAMAGED}")
    return weight_map


def check_index(directory: Path, files: list[Path]) -> None:
    """A sharded checkpoint's shards hold exactly the tensors its index says they do (read from their headers)."""
    index = directory / INDEX_FILE
    if not index.is_file():
        return
    weight_map = _weight_map(index)
    for file in files:
        names, _ = safetensors_header(file)
        for name in names:
            if weight_map.get(name) != file.name:
                where = f"in {weight_map[name]}" if name in weight_map else "nowhere"
                raise CheckpointError(f"{file}: holds tensor {name!r}, which {index.name} says is {where}; the "
                                      f"index and the shards do not belong together: {DAMAGED}")
        missing = sorted(n for n, f in weight_map.items() if f == file.name and n not in set(names))
        if missing:
            raise CheckpointError(f"{file}: lacks tensor {missing[0]!r}, which {index.name} says it holds; "
                                  f"{DAMAGED}")


def checked_weight_files(directory: Path) -> list[Path]:
    """``hf_weight_files`` of a directory whose checksum manifest (when it has one) lists and matches every file a
    load reads, and whose index (when sharded) matches its shards' headers."""
    listed = verify_checksums(directory)
    files = hf_weight_files(directory)
    optional = (directory / EXTRAS_FILE, directory / GENERATION_CONFIG, directory / INDEX_FILE)
    check_listed(directory, listed, [directory / "config.json", *files, *(f for f in optional if f.is_file())])
    check_index(directory, files)
    return files


def hf_model_config(directory: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, config.json) of a HF zaya directory, from config.json and the side file's header alone:
    config.json owns every field it expresses, ``zaya_extras.safetensors`` supplies zaya's own options."""
    config_path = directory / "config.json"
    hf_cfg = read_json_object(config_path)
    cfg = model_config_from_hf(hf_cfg, str(config_path))
    extras_path = directory / EXTRAS_FILE
    if not extras_path.is_file():
        return cfg, hf_cfg
    _, meta = safetensors_header(extras_path)
    if "zaya_model_config" not in meta:
        return cfg, hf_cfg
    try:
        merged = loads_json(meta["zaya_model_config"])
    except ValueError as exc:
        raise CheckpointError(f"{extras_path}: its zaya_model_config is not JSON ({str(exc)[:200]}); "
                              f"{DAMAGED}") from None
    if not isinstance(merged, dict):
        raise CheckpointError(f"{extras_path}: its zaya_model_config is not a JSON object; {DAMAGED}")
    merged.update({k: v for k, v in to_dict(cfg).items() if k in _HF_OWNED_FIELDS})
    return model_config_from_dict(merged, str(extras_path)), hf_cfg


def load_hf(directory: str | Path, dtype: torch.dtype | None = None) -> ZayaForCausalLM:
    """Load a Hugging Face ``zaya`` checkpoint directory into a ZayaForCausalLM, checking its checksum manifest
    (when it has one) and its index against its shards first."""
    directory = Path(directory)
    files = checked_weight_files(directory)
    extras_path = directory / EXTRAS_FILE
    generation = directory / GENERATION_CONFIG
    cfg, hf_cfg = hf_model_config(directory)
    extras = read_safetensors([extras_path]) if extras_path.is_file() else {}
    source = str(files[0].parent / (files[0].name if len(files) == 1 else "model-*.safetensors"))
    tensors = read_safetensors(files)
    check_layer_count(cfg, tensors, source)
    check_hf_tensors(tensors, cfg, source)
    state = zaya_state_dict_from_hf(tensors, cfg, source)
    for name, tensor in extras.items():
        if name not in state and name.rsplit(".", 1)[-1] not in BALANCING_STATE:
            raise CheckpointError(f"{extras_path}: unexpected tensor {name!r}; {DAMAGED}")
        state[name] = tensor
    model = build_from_state_dict(cfg, state, source, dtype)
    model.hf_config = hf_cfg
    model.hf_generation_config = read_json_object(generation) if generation.is_file() else None
    return model


def check_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> None:
    """Fail, naming the tensor as the checkpoint names it, when one is missing or its shape contradicts the config."""
    want = {}
    for name, shape in expected_shapes(cfg).items():
        hf_name = zaya_to_hf_name(name)
        if hf_name is not None:
            want[hf_name] = shape
    missing = [k for k in want if k not in tensors]
    if missing:
        raise CheckpointError(f"{source}: tensor {missing[0]!r} is missing ({len(missing)} missing in all): "
                              "config.json does not match the weights, or they are incomplete: export them again "
                              "(or download them again)")
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)} but "
                                  f"config.json implies {shape}; the config and the weights do not belong together")


def _tensor_dtype_name(model: ZayaForCausalLM) -> torch.dtype:
    return model.embed.weight.dtype


def save_hf(model: ZayaForCausalLM, directory: str | Path, overwrite: bool = False,
            max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write ``model`` in the Hugging Face zaya layout (sharded above ``max_shard_bytes``), atomically, with its
    checksum manifest."""
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        write_hf(model, tmp, max_shard_bytes)
        write_checksums(tmp)
    return Path(directory)


def write_hf(model: ZayaForCausalLM, directory: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """The files of the Hugging Face layout, written into the existing (empty, temporary) ``directory``; not atomic
    by itself: ``save_hf`` and ``zaya.checkpoint.export`` call it inside ``atomic_directory``."""
    config = hf_config_from_model_config(model.config, getattr(model, "hf_config", None), _tensor_dtype_name(model))
    tensors = hf_state_dict(model)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_safetensors(shards[0], directory / "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_safetensors(shard, directory / fname)
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = getattr(model, "hf_generation_config", None)
    if generation is not None:
        (directory / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    extras = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()
              if zaya_to_hf_name(k) is None}
    save_safetensors(extras, directory / EXTRAS_FILE,
                     metadata={"format": "pt", "zaya_model_config": json.dumps(to_dict(model.config))})
