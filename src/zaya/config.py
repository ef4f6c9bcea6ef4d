"""Typed configuration: the single source of truth for every option.

Configs are TOML files with one table per dataclass (``[model]``, ``[train]``). Every field has a default and a
doc line (the string literal after it). Unknown keys are errors that name the file,
the table and the closest valid key; shape rules are checked when the config is built, so a bad file fails at load
time, not deep inside a forward pass.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints


class ConfigError(ValueError):
    """A configuration file or value that breaks a rule; the message says which key and how to fix it."""


@dataclass
class ModelConfig:
    """Shape and behaviour of a ZAYA1-style MoE decoder. Defaults are the published ZAYA1-base shape."""

    vocab_size: int = 262272
    """Token vocabulary size (ZAYA1: the 262,272-entry Gemma3 tokenizer, a multiple of 64)."""
    hidden_size: int = 2048
    """Width of the residual stream."""
    num_layers: int = 40
    """Number of decoder layers; each is one attention block followed by one MoE block."""
    attention: str = "cca"
    """Attention kind: "cca" (compressed convolutional GQA, as in ZAYA1), "gqa" or "mha" (plain baselines)."""
    num_query_heads: int = 8
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads; must divide num_query_heads (equal to it for "mha")."""
    head_dim: int = 128
    """Channels per head (a multiple of 64 keeps GEMMs efficient)."""
    cca_depthwise_kernel: int = 2
    """CCA: kernel size of the depthwise causal convolution over time (ZAYA1: 2)."""
    cca_grouped_kernel: int = 2
    """CCA: kernel size of the per-head grouped causal convolution (ZAYA1: 2)."""
    qk_temperature_init: float = 1.0
    """CCA: initial per-KV-head key temperature. The HF port initialises 0 (uniform attention at step 0); 1 gives
    the usual QK-norm logit range, so training from scratch starts with useful attention."""
    rope_theta: float = 10000.0
    """RoPE base (ZAYA1: 10,000 at 4k context, 1,000,000 after the 32k extension)."""
    rope_fraction: float = 0.5
    """Fraction of each head's channels that RoPE rotates (rotate-half style on the leading channels)."""
    max_seq_len: int = 4096
    """Longest sequence the model is trained on; used for FLOP estimates and default decode buffers."""
    num_experts: int = 16
    """Experts per MoE layer."""
    top_k: int = 1
    """Experts chosen per token (ZAYA1: 1). Mixing weights are the unnormalised router probabilities."""
    expert_hidden_size: int = 2048
    """SwiGLU hidden width of each expert (gate and up are each this wide)."""
    router: str = "zaya"
    """Router kind: "zaya" (down-projection, EDA, RMSNorm + 3-layer MLP) or "linear" (plain top-k baseline)."""
    router_hidden_size: int = 256
    """ZAYA router latent width."""
    router_eda: bool = True
    """ZAYA router: exponential depth averaging of the router latent across MoE layers."""
    router_skip_expert: bool = True
    """ZAYA router: an extra (E+1)-th "skip" class; a token routed there gets a zero MoE output."""
    router_skip_bias_init: float = -1.0
    """Initial balancing bias of the skip class (released checkpoints: -1). It is not updated by balancing."""
    router_balance_lr: float = 1e-3
    """Step size of the AdamW-style balancing-bias update (unpublished; the ports' guess)."""
    router_balance_betas: tuple[float, float] = (0.9, 0.999)
    """Moment decay rates of the balancing-bias update."""
    router_balance_eps: float = 1e-8
    """Denominator epsilon of the balancing-bias update."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    residual_fp32: bool = True
    """Keep the residual stream in fp32 even when weights are bf16 (as ZAYA1 does)."""
    tie_embeddings: bool = True
    """Share the input embedding with the LM head (ZAYA1: tied)."""
    init_std: float = 0.02
    """Standard deviation of the normal init of weight matrices; output projections use init_std/sqrt(2*layers)."""
    moe_impl: str = "auto"
    """Expert matmul path: "grouped_mm" (one grouped GEMM), "loop" (per-expert contiguous slices) or "auto"."""
    pad_token_id: int = 0
    """Padding token id, written to Hugging Face config.json on export."""
    bos_token_id: int = 2
    """Beginning-of-sequence token id (export metadata)."""
    eos_token_id: int = 106
    """End-of-sequence token id (export metadata; generation can stop on it)."""

    def __post_init__(self) -> None:
        if isinstance(self.router_balance_betas, list):
            self.router_balance_betas = tuple(self.router_balance_betas)
        self.validate()

    def validate(self) -> None:
        """Check shape rules; raise ConfigError naming the key and the rule broken."""

        def need(ok: bool, key: str, rule: str) -> None:
            if not ok:
                raise ConfigError(f"model.{key} = {getattr(self, key)!r}: {rule}")

        for key in ("vocab_size", "hidden_size", "num_layers", "num_query_heads", "num_kv_heads", "head_dim",
                    "num_experts", "top_k", "expert_hidden_size", "router_hidden_size", "max_seq_len",
                    "cca_depthwise_kernel", "cca_grouped_kernel"):
            need(getattr(self, key) >= 1, key, "must be a positive integer")
        need(self.attention in ("cca", "gqa", "mha"), "attention", 'must be one of "cca", "gqa", "mha"')
        need(self.router in ("zaya", "linear"), "router", 'must be one of "zaya", "linear"')
        need(self.moe_impl in ("auto", "grouped_mm", "loop"), "moe_impl", 'must be one of "auto", "grouped_mm", "loop"')
        need(self.num_query_heads % self.num_kv_heads == 0, "num_query_heads",
             f"must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.attention == "mha":
            need(self.num_kv_heads == self.num_query_heads, "num_kv_heads",
                 f'must equal num_query_heads ({self.num_query_heads}) when attention = "mha"')
        if self.attention == "cca":
            need(self.num_kv_heads % 2 == 0, "num_kv_heads",
                 "must be even for CCA: half of the value heads come from the current token, half from the previous")
        need(self.head_dim % 2 == 0, "head_dim", "must be even for RoPE")
        need(0.0 <= self.rope_fraction <= 1.0, "rope_fraction", "must be within [0, 1]")
        rotary = self.rotary_dim
        need(rotary % 2 == 0 and abs(self.head_dim * self.rope_fraction - rotary) < 1e-9, "rope_fraction",
             f"head_dim * rope_fraction = {self.head_dim * self.rope_fraction:g} must be an even whole number")
        need(self.rope_theta > 0, "rope_theta", "must be positive")
        need(self.top_k <= self.num_experts, "top_k", f"must not exceed num_experts ({self.num_experts})")
        need(self.norm_eps > 0, "norm_eps", "must be positive")
        need(self.init_std > 0, "init_std", "must be positive")
        need(self.router_balance_lr >= 0, "router_balance_lr", "must be >= 0")
        need(len(self.router_balance_betas) == 2 and all(0 <= b < 1 for b in self.router_balance_betas),
             "router_balance_betas", "must be two numbers in [0, 1)")
        need(0 <= self.pad_token_id < self.vocab_size, "pad_token_id", f"must be in [0, vocab_size={self.vocab_size})")

    @property
    def rotary_dim(self) -> int:
        """Channels per head that RoPE rotates."""
        return int(round(self.head_dim * self.rope_fraction))

    @property
    def num_router_classes(self) -> int:
        """Experts plus the skip class when the ZAYA router has one."""
        return self.num_experts + int(self.router == "zaya" and self.router_skip_expert)


@dataclass
class TrainConfig:
    """The walking-skeleton trainer (AdamW on the prepared datasets of [data]). Replaced by the full trainer."""

    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 16
    """Sequences per step."""
    seq_len: int = 128
    """Tokens per sequence."""
    lr: float = 3e-3
    """Peak learning rate (linear warmup, cosine decay to lr/10)."""
    warmup_steps: int = 30
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (norms, biases, scales and embeddings get none)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    dtype: str = "bfloat16"
    """Autocast compute dtype on CPU: "bfloat16" or "float32"."""
    seed: int = 0
    """Seed for weights, batches and sampling."""
    log_every: int = 25
    """Print the loss every this many steps."""
    sample_tokens: int = 200
    """Tokens to generate after training."""
    sample_prompt: str = "ROMEO:\n"
    """Prompt of the sample generated after training."""
    out_dir: str = "runs/tiny"
    """Where the final checkpoint is written."""

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "seq_len", "log_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key} = {getattr(self, key)!r}: must be a positive integer")
        if self.dtype not in ("bfloat16", "float32"):
            raise ConfigError(f'train.dtype = {self.dtype!r}: must be "bfloat16" or "float32"')


@dataclass
class DataConfig:
    """Where the training tokens come from: prepared datasets (``zaya data prepare``) and how to read them."""

    datasets: dict[str, str] = field(default_factory=lambda: {"shakespeare": "builtin:shakespeare"})
    """Name -> prepared dataset directory, or "builtin:shakespeare" (prepared on first use and cached)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Mixture weights by dataset name (empty: equal weights)."""
    seed: int = 0
    """Seed of the shuffle (a keyed permutation per dataset and epoch)."""
    document_positions: bool = False
    """Give the model position ids that restart at every document start."""
    prefetch: int = 4
    """Batches computed ahead by the loader's background thread (0: none)."""
    val_batches: int = 8
    """Validation batches (per rank) at each evaluation."""
    builtin_vocab_size: int = 4096
    """Vocabulary of the BPE trained for a builtin corpus (a multiple of 64)."""
    cache_dir: str = ""
    """Where builtin corpora are prepared ("" = $ZAYA_CACHE_DIR, else ~/.cache/zaya)."""

    def __post_init__(self) -> None:
        if not self.datasets:
            raise ConfigError("data.datasets is empty: name at least one prepared dataset directory")
        unknown = sorted(set(self.weights) - set(self.datasets))
        if unknown:
            raise ConfigError(f"data.weights names {unknown}, which are not in data.datasets "
                              f"({', '.join(sorted(self.datasets))})")
        if any(w < 0 for w in self.weights.values()) or (self.weights and sum(self.weights.values()) <= 0):
            raise ConfigError(f"data.weights = {self.weights}: weights must be >= 0 with a positive sum")
        if self.builtin_vocab_size % 64 or self.builtin_vocab_size < 320:
            raise ConfigError(f"data.builtin_vocab_size = {self.builtin_vocab_size}: must be a multiple of 64, "
                              ">= 320")
        if self.prefetch < 0 or self.val_batches < 1:
            raise ConfigError("data.prefetch must be >= 0 and data.val_batches >= 1")

    def mixture(self) -> dict[str, float]:
        """The mixture weights with the default (equal) applied."""
        return dict(self.weights) if self.weights else {name: 1.0 for name in self.datasets}


@dataclass
class Config:
    """A whole run: model shape, data and training settings."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def _nearest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" Did you mean {match[0]!r}?" if match else f" Valid keys: {', '.join(sorted(valid))}."


def _build(cls: type, table: dict[str, Any], where: str) -> Any:
    """Construct dataclass ``cls`` from a TOML table, rejecting unknown keys and wrong types."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {type(table).__name__}")
    hints = get_type_hints(cls)
    valid = [f.name for f in fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in valid:
            raise ConfigError(f"{where}: unknown key {key!r}.{_nearest(key, valid)}")
        kwargs[key] = _check_type(value, hints[key], f"{where}.{key}")
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(f"{where.rsplit('[', 1)[0]}: {err}") from None


def _check_type(value: Any, hint: Any, where: str) -> Any:
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ConfigError(f"{where} = {value!r}: expected {hint.__name__}")
        return value
    if getattr(hint, "__origin__", None) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} = {value!r}: expected a table")
        _, value_hint = hint.__args__
        return {str(k): _check_type(v, value_hint, f"{where}.{k}") for k, v in value.items()}
    if getattr(hint, "__origin__", None) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} = {value!r}: expected a list")
        return tuple(float(v) for v in value)
    return value


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Build a Config from nested dicts (TOML tables), with errors that name ``source``."""
    tables = {f.name: f.type for f in fields(Config)}
    for key in data:
        if key not in tables:
            raise ConfigError(f"{source}: unknown table [{key}].{_nearest(key, list(tables))}")
    model = _build(ModelConfig, data.get("model", {}), f"{source} [model]")
    data_config = _build(DataConfig, data.get("data", {}), f"{source} [data]")
    train = _build(TrainConfig, data.get("train", {}), f"{source} [train]")
    return Config(model=model, data=data_config, train=train)


def load_config(path: str | Path) -> Config:
    """Read a TOML config file. Missing tables and keys take their defaults."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (presets live in configs/*.toml)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return config_from_dict(data, str(path))


def model_config_from_dict(data: dict[str, Any], source: str = "<dict>") -> ModelConfig:
    """Build a ModelConfig from a flat dict (as stored in zaya checkpoints)."""
    return _build(ModelConfig, data, source)


def to_dict(obj: Any) -> dict[str, Any]:
    """Dataclass to plain dict (tuples become lists, ready for TOML or JSON)."""
    out = dataclasses.asdict(obj)

    def fix(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, tuple):
            return list(v)
        return v

    return fix(out)


def dump_config(config: Config, path: str | Path) -> Path:
    """Write ``config`` as TOML (every key, defaults included) so a run records exactly what it used."""
    import tomli_w

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(tomli_w.dumps(to_dict(config)))
    tmp.replace(path)
    return path
