"""Typed configuration: the single source of truth for every option.

Configs are TOML files with one table per dataclass (``[model]``, ``[train]``). Every field has a default and a
doc line (the string literal after it). Unknown keys are errors that name the file,
the table and the closest valid key; shape rules are checked when the config is built, so a bad file fails at load
time, not deep inside a forward pass.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from zaya.core.errors import ConfigError
from zaya.core.fsutil import atomic_write_text

__all__ = ["AegisConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "ModelConfig", "OptimConfig",
           "StageConfig", "TrainConfig", "config_differences", "load_config", "resumable"]


INT_LIMIT = 2**31
"""The exclusive upper bound of an int field that declares no range of its own: every count, size and step of a
config stays below it (a dimension, a batch or a step count past it cannot be allocated or run; numpy and torch
refused 10**30 with a traceback)."""
TOKEN_LIMIT = 2**53
"""The exclusive upper bound of a token count (a stage's budget, a batch ramp's point): far beyond any corpus, and
every count below it is exact as a float."""
SEED_LIMIT = 2**32
"""The exclusive upper bound of a seed (numpy's global seed, set from train.seed, takes 32 bits)."""


def resumable(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field that may change when a run is resumed: it drives how the run is carried out (how long,
    where, how often it logs or saves, on which devices and with which parallelism), not what it computes.
    ``config_differences`` ignores such fields when it decides whether a run directory belongs to a config."""
    return field(default=default, default_factory=default_factory, metadata={"resumable": True})


def ranged(default: int, lo: int = 0, hi: int | str = INT_LIMIT, *, resumable: bool = False) -> Any:
    """An int field whose values lie in [lo, hi): ``hi`` is a number, or the name of an earlier int field of the
    same table (token ids lie below ``vocab_size``). An int field declared without it lies in [0, INT_LIMIT).
    Checked (``_check_ranges``) wherever a config is read: TOML, ``--set``, a checkpoint's or export's config."""
    return field(default=default, metadata={"range": (lo, hi), "resumable": resumable})


ParallelMode = Literal["ddp", "zero1", "fsdp"]
"""How parameters, gradients and optimizer state spread over data-parallel ranks (train.parallel)."""
PARALLEL_MODES: tuple[str, ...] = get_args(ParallelMode)


def check_choices(config: Any, table: str) -> None:
    """The one rule of choice fields: a field declared as ``Literal[...]`` holds one of its choices, else a
    ConfigError naming ``table.key``, the value and every choice (run by each table's ``__post_init__``, so a config
    built in Python is checked as one read from TOML)."""
    hints = get_type_hints(type(config))
    for f in fields(config):
        choices = get_args(hints[f.name]) if get_origin(hints[f.name]) is Literal else ()
        value = getattr(config, f.name)
        if choices and not (isinstance(value, str) and value in choices):
            listed = ", ".join(f'"{c}"' for c in choices[:-1]) + f' or "{choices[-1]}"'
            raise ConfigError(f"{table}.{f.name} = {value!r}: must be {listed}")


@dataclass
class ModelConfig:
    """Shape and behaviour of a ZAYA1-style MoE decoder. Defaults are the published ZAYA1-base shape."""

    vocab_size: int = ranged(262272, 1)
    """Token vocabulary size (ZAYA1: the 262,272-entry Gemma3 tokenizer, a multiple of 64)."""
    hidden_size: int = ranged(2048, 1)
    """Width of the residual stream."""
    num_layers: int = ranged(40, 1, 2**12)
    """Number of decoder layers; each is one attention block followed by one MoE block."""
    attention: Literal["cca", "gqa", "mha"] = "cca"
    """Attention kind: "cca" (compressed convolutional GQA, as in ZAYA1), "gqa" or "mha" (plain baselines)."""
    num_query_heads: int = ranged(8, 1)
    """Query heads."""
    num_kv_heads: int = ranged(2, 1)
    """Key/value heads; must divide num_query_heads (equal to it for "mha")."""
    head_dim: int = ranged(128, 1)
    """Channels per head (a multiple of 64 keeps GEMMs efficient)."""
    cca_depthwise_kernel: int = ranged(2, 1)
    """CCA: kernel size of the depthwise causal convolution over time (ZAYA1: 2)."""
    cca_grouped_kernel: int = ranged(2, 1)
    """CCA: kernel size of the per-head grouped causal convolution (ZAYA1: 2)."""
    qk_temperature_init: float = 1.0
    """CCA: initial per-KV-head key temperature. The HF port initialises 0 (uniform attention at step 0); 1 gives
    the usual QK-norm logit range, so training from scratch starts with useful attention."""
    rope_theta: float = 10000.0
    """RoPE base (ZAYA1: 10,000 at 4k context, 1,000,000 after the 32k extension)."""
    rope_fraction: float = 0.5
    """Fraction of each head's channels that RoPE rotates (rotate-half style on the leading channels)."""
    max_seq_len: int = ranged(4096, 1)
    """Longest sequence the model is trained on; used for FLOP estimates and default decode buffers."""
    num_experts: int = ranged(16, 1)
    """Experts per MoE layer."""
    top_k: int = ranged(1, 1)
    """Experts chosen per token (ZAYA1: 1). Mixing weights are the unnormalised router probabilities."""
    expert_hidden_size: int = ranged(2048, 1)
    """SwiGLU hidden width of each expert (gate and up are each this wide)."""
    router: Literal["zaya", "linear"] = "zaya"
    """Router kind: "zaya" (down-projection, EDA, RMSNorm + 3-layer MLP) or "linear" (plain top-k baseline)."""
    router_hidden_size: int = ranged(256, 1)
    """ZAYA router latent width."""
    router_eda: bool = True
    """ZAYA router: exponential depth averaging of the router latent across MoE layers."""
    router_skip_expert: bool = True
    """ZAYA router: an extra (E+1)-th "skip" class; a token routed there gets a zero MoE output."""
    router_skip_bias_init: float = -1.0
    """Initial balancing bias of the skip class (released checkpoints: -1). It is not updated by balancing."""
    router_balancing: Literal["adaptive", "adamw", "none"] = "adaptive"
    """How the balancing biases follow the load (docs/model.md): "adaptive" (zaya's controller: a per-expert step
    scaled by the relative load error, halved when that error changes sign, grown while it keeps it), "adamw" (the
    published ports' AdamW-style update, for continue-training of released checkpoints) or "none" (biases fixed)."""
    router_balance_step: float = 1e-3
    """Adaptive balancing: each expert's first step (probability units), and the step a reset starts from."""
    router_balance_step_max: float = 5e-2
    """Adaptive balancing: the largest step an expert's bias takes in one optimizer step."""
    router_balance_step_min: float = 1e-6
    """Adaptive balancing: the smallest step, so that a settled controller can still follow a drifting router."""
    router_aux_loss_coef: float = 0.0
    """Weight of a conventional (Switch-style) load-balancing loss E * sum_e f_e * P_e added to the training loss
    (0 = off; the ablation's baseline, usually with router_balancing = "none"). Not in ZAYA1."""
    router_balance_lr: float = 1e-3
    """router_balancing = "adamw": step size of the AdamW-style update (unpublished; the ports' guess)."""
    router_balance_betas: tuple[float, float] = (0.9, 0.999)
    """router_balancing = "adamw": moment decay rates of the update."""
    router_balance_eps: float = 1e-8
    """router_balancing = "adamw": denominator epsilon of the update."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    residual_fp32: bool = True
    """Keep the residual stream in fp32 even when weights are bf16 (as ZAYA1 does)."""
    tie_embeddings: bool = True
    """Share the input embedding with the LM head (ZAYA1: tied)."""
    init_std: float = 0.02
    """Standard deviation of the normal init of weight matrices; output projections use init_std/sqrt(2*layers)."""
    moe_impl: Literal["auto", "grouped_mm", "loop"] = "auto"
    """Expert matmul path: "grouped_mm" (one grouped GEMM), "loop" (per-expert contiguous slices) or "auto"."""
    pad_token_id: int = ranged(0, 0, "vocab_size")
    """Padding token id, written to Hugging Face config.json on export."""
    bos_token_id: int = ranged(2, 0, "vocab_size")
    """Beginning-of-sequence token id (export metadata)."""
    eos_token_id: int = ranged(106, 0, "vocab_size")
    """End-of-sequence token id (export metadata; generation can stop on it)."""

    def __post_init__(self) -> None:
        if isinstance(self.router_balance_betas, list):
            self.router_balance_betas = tuple(self.router_balance_betas)
        self.validate()

    def validate(self) -> None:
        """Check shape rules; raise ConfigError naming the key and the rule broken."""
        check_choices(self, "model")

        def need(ok: bool, key: str, rule: str) -> None:
            if not ok:
                raise ConfigError(f"model.{key} = {getattr(self, key)!r}: {rule}")

        for key in ("vocab_size", "hidden_size", "num_layers", "num_query_heads", "num_kv_heads", "head_dim",
                    "num_experts", "top_k", "expert_hidden_size", "router_hidden_size", "max_seq_len",
                    "cca_depthwise_kernel", "cca_grouped_kernel"):
            need(getattr(self, key) >= 1, key, "must be a positive integer")
        need(self.num_query_heads % self.num_kv_heads == 0, "num_query_heads",
             f"must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.attention == "mha":
            need(self.num_kv_heads == self.num_query_heads, "num_kv_heads",
                 f'must equal num_query_heads ({self.num_query_heads}) when attention = "mha"')
        # CCA splits the num_kv_heads * head_dim value channels (not the heads) in two, as transformers does: any
        # KV head count works, and the even head_dim that RoPE needs makes the channel count even.
        need(self.head_dim % 2 == 0, "head_dim", "must be even for RoPE")
        need(0.0 <= self.rope_fraction <= 1.0, "rope_fraction", "must be within [0, 1]")
        rotary = self.rotary_dim
        need(rotary % 2 == 0 and abs(self.head_dim * self.rope_fraction - rotary) < 1e-9, "rope_fraction",
             f"head_dim * rope_fraction = {self.head_dim * self.rope_fraction:g} must be an even whole number")
        need(self.rope_theta > 0, "rope_theta", "must be positive")
        need(self.top_k <= self.num_experts, "top_k", f"must not exceed num_experts ({self.num_experts})")
        need(self.norm_eps > 0, "norm_eps", "must be positive")
        need(self.init_std > 0, "init_std", "must be positive")
        need(0 < self.router_balance_step_min <= self.router_balance_step <= self.router_balance_step_max,
             "router_balance_step", "needs 0 < router_balance_step_min <= router_balance_step <= "
             f"router_balance_step_max (min {self.router_balance_step_min}, max {self.router_balance_step_max})")
        need(self.router_aux_loss_coef >= 0, "router_aux_loss_coef", "must be >= 0")
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
class OptimConfig:
    """Muon for hidden matrices (2-D and stacked expert weights), AdamW for everything else, and the LR schedule."""

    lr: float = 6e-4
    """Peak learning rate of the AdamW groups (ZAYA1: 6e-4), and of Muon unless muon_lr is set."""
    min_lr: float = 2e-4
    """Learning rate at the end of the decay (ZAYA1's cosine: 6e-4 -> 2e-4)."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """"cosine" (warmup, then cosine to min_lr at max_steps), "wsd" (warmup-stable-decay) or "constant"."""
    warmup_steps: int = 100
    """Linear warmup from lr/warmup_steps to lr."""
    decay_fraction: float = 0.2
    """wsd: share of the schedule's steps spent in the final linear decay to min_lr."""
    schedule_steps: int = 0
    """Length of the LR schedule in steps; 0 = train.max_steps. Set it to stop early (--max-steps) and resume
    later on the same schedule."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (AdamW's and Muon's); norms, biases, scales, embeddings get none."""
    muon: bool = True
    """Use Muon for the hidden matrices; false puts every parameter in AdamW."""
    muon_lr: float = 0.0
    """Muon's peak learning rate; 0 = lr (with muon_adjust_lr = "match_rms_adamw" the update RMS matches AdamW's)."""
    muon_momentum: float = 0.95
    """Muon momentum."""
    muon_nesterov: bool = True
    """Nesterov momentum in Muon."""
    muon_ns_steps: int = ranged(5, 0, 100)
    """Newton-Schulz iterations (ZAYA1: 5)."""
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Dtype of Muon's Newton-Schulz iteration: "bfloat16" (fast on GPUs; the usual choice), "float32", or "auto"
    (bfloat16 where the device multiplies it in hardware, as train.dtype's "auto")."""
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon's per-matrix LR scaling: "match_rms_adamw" (0.2 sqrt(max(m, n))) or "original" (sqrt(max(1, m/n)))."""
    muon_ns_method: Literal["auto", "standard", "gram", "reference"] = "auto"
    """Muon's Newton-Schulz: "auto" (the cheaper of Gram-space and standard per shape), "standard", "gram" or
    "reference" (torch.optim.Muon's exact operations)."""
    muon_distributed: Literal["auto", "local"] = "auto"
    """Muon across ranks: "auto" (ddp: each matrix orthogonalised by one rank of the data-parallel group, results
    broadcast; fsdp: each 2-D matrix by one rank of the mesh, experts where their shard lives; zero1 and one
    process: locally, each rank already steps only its own parameters) or "local" (no splitting: every rank
    orthogonalises every matrix it steps, all-gathering fsdp shards; for comparison)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""

    def __post_init__(self) -> None:
        check_choices(self, "optim")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim.lr = {self.lr}, optim.min_lr = {self.min_lr}: need 0 <= min_lr <= lr, lr > 0")
        # The optimizers' own rules (torch's AdamW, Muon's momentum), checked here so they fail at load naming the key.
        for key, value in (("betas", self.betas[0]), ("betas", self.betas[1]), ("muon_momentum", self.muon_momentum)):
            if not 0 <= value < 1:
                raise ConfigError(f"optim.{key} = {getattr(self, key)!r}: must be in [0, 1)")
        for key, zero in (("eps", ""), ("weight_decay", ""), ("muon_lr", " (0 = optim.lr)"),
                          ("grad_clip", " (0 = no clipping)")):
            if getattr(self, key) < 0:
                raise ConfigError(f"optim.{key} = {getattr(self, key)!r}: must be >= 0{zero}")
        if self.warmup_steps < 0 or self.schedule_steps < 0 or not 0 <= self.decay_fraction <= 1:
            raise ConfigError("optim.warmup_steps and optim.schedule_steps must be >= 0, optim.decay_fraction in "
                              "[0, 1]")


@dataclass
class TrainConfig:
    """The training run: batch geometry, parallelism, precision, checkpoints, logging."""

    max_steps: int = ranged(300, 1, resumable=True)
    """Optimizer steps; the run ends with a final checkpoint."""
    micro_batch_size: int = ranged(16, 1, resumable=True)
    """Sequences per rank per forward/backward (stages may override)."""
    seq_len: int = ranged(128, 1)
    """Tokens per sequence when no [[stages]] are given."""
    global_batch_tokens: int = 0
    """Tokens per optimizer step over all ranks; 0 = one micro-batch per rank (no accumulation)."""
    batch_ramp: list[tuple[int, int]] = field(default_factory=list)
    """[[tokens_seen, global_batch_tokens], ...]: the global batch from each point on (realised by accumulation)."""
    parallel: ParallelMode = resumable("ddp")
    """Data parallelism across ranks: "ddp", "zero1" (DDP with the optimizer state sharded) or "fsdp" (FSDP2)."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype under autocast: "bfloat16", "float32", or "auto": bfloat16 on a device that multiplies it in
    hardware (GPUs; CPUs with AVX-512 BF16, AMX or Arm BF16), else float32 (an AVX2 CPU emulates bf16 matmuls, 17x
    slower). Master weights and optimizer state stay fp32."""
    seed: int = ranged(0, 0, SEED_LIMIT)
    """Seed for weight init (data order is data.seed)."""
    log_every: int = ranged(10, 1, resumable=True)
    """Progress line every this many steps (metrics.jsonl gets every step)."""
    eval_every: int = resumable(100)
    """Validation loss every this many steps (and at the end); 0 = only at the end."""
    timeout_s: float = resumable(1800.0)
    """Collective timeout during training (long, so short network stalls don't kill a job)."""
    startup_timeout_s: float = resumable(300.0)
    """Collective timeout while the process group starts."""
    peak_flops: float = resumable(0.0)
    """Peak FLOP/s of one device for MFU; 0 = measure a bf16 matmul at start-up (CPU) or look it up (GPU)."""
    on_nan: Literal["stop", "skip"] = resumable("stop")
    """Non-finite loss or gradient: "stop" (name the step and the last good checkpoint) or "skip" the batch."""
    max_skipped_steps: int = resumable(10)
    """With on_nan = "skip": stop after this many consecutive skipped steps."""
    sample_prompt: str = resumable("ROMEO:\n")
    """Prompt of the sample generated at the end of the run ("" to skip)."""
    sample_tokens: int = resumable(200)
    """Tokens of that sample."""
    router_probe: bool = resumable(True)
    """Route one fixed validation sequence every step to log each layer's router flip rate and token entropy
    (src/zaya/train/routing_probe.py; one extra forward pass of seq_len tokens per step)."""
    tensorboard: bool = resumable(False)
    """Also write TensorBoard event files to <run_dir>/tensorboard (needs the tensorboard package)."""
    run_dir: str = resumable("runs/tiny")
    """Where config.toml, metrics.jsonl, checkpoints/, plots/ and logs go. Every rank reads and writes it: on
    several nodes it must be on a filesystem they all mount (checked at start-up)."""
    device: str = resumable("auto")
    """Device of each rank: "auto" (its GPU when torch sees one, else the CPU), "cpu", "cuda" or "cuda:N"."""
    context_parallel: int = ranged(1, 1, resumable=True)
    """Context-parallel ranks per sequence (cp): consecutive ranks split every sequence in the zigzag layout and
    attend across the split (docs/long-context.md); data parallelism runs over world / cp. Every stage's seq_len must
    be a multiple of 2 x cp. Checkpoints resume at any other cp."""
    context_parallel_method: Literal["allgather", "ring"] = resumable("allgather")
    """How cp ranks attend across the split: "allgather" (gather every KV head, the default: CCA's K/V are small)
    or "ring" (K/V blocks passed around the ring; memory for two blocks, not the whole sequence's K/V)."""
    expert_parallel: int = ranged(1, 1, resumable=True)
    """Expert-parallel ranks (ep): consecutive groups of this many ranks split every MoE layer's experts, each rank
    holding num_experts / ep of them, and send each token to its experts' rank and back (all-to-all; docs/training.md,
    "Expert parallelism"). Must divide the world size and model.num_experts."""
    activation_checkpointing: bool = resumable(False)
    """Recompute each block's activations in the backward instead of keeping them (long sequences: about one
    extra forward of compute for activation memory of one block plus the block inputs)."""
    compile: Literal["auto", "on", "off"] = resumable("auto")
    """Compile each decoder block with torch.compile (forward and backward; docs/training.md, "Compiled blocks"):
    "auto" = on for GPUs, off on the CPU (whose first compile takes minutes); a failed compile falls back to eager
    with a warning."""
    init_from: str = ""
    """Start from the weights of this checkpoint ("" = random init): a Hugging Face zaya directory, a zaya export,
    a run directory or one training checkpoint. Its model config and tokenizer come with it; optimizer, step and data
    start fresh. A run directory with checkpoints of its own resumes from them instead (docs/training.md)."""

    def __post_init__(self) -> None:
        check_choices(self, "train")
        for key in ("max_steps", "micro_batch_size", "seq_len", "log_every", "context_parallel", "expert_parallel"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key} = {getattr(self, key)!r}: must be a positive integer")
        for key in ("eval_every", "global_batch_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key} = {getattr(self, key)!r}: must be >= 0")
        for key in ("timeout_s", "startup_timeout_s"):  # a collective's timeout: a timedelta (at most ~2.7e6 years)
            if not 0 < getattr(self, key) <= MAX_TIMEOUT_S:
                raise ConfigError(f"train.{key} = {getattr(self, key)!r}: must be in (0, {MAX_TIMEOUT_S:g}] seconds")
        if not isinstance(self.device, str) or not self.device.strip():
            raise ConfigError(f'train.device = {self.device!r}: must be "auto", "cpu", "cuda" or "cuda:N"')
        points = [t for t, _ in self.batch_ramp]
        if points != sorted(points) or not all(0 <= t < TOKEN_LIMIT and 0 < b < INT_LIMIT for t, b in self.batch_ramp):
            raise ConfigError(f"train.batch_ramp = {self.batch_ramp}: tokens_seen must increase within [0, "
                              f"{_bound(TOKEN_LIMIT)}) and batches lie in [1, {_bound(INT_LIMIT)})")


@dataclass
class CheckpointConfig:
    """Training checkpoints ([checkpoint]): when, how (sync/async), what is kept, how loads are verified."""

    every: int = resumable(100)
    """Checkpoint every this many steps (and at the end, and on SIGTERM/SIGINT); 0 = only those."""
    keep: int = ranged(3, 1, resumable=True)
    """Newest complete checkpoints kept in <run_dir>/checkpoints."""
    keep_every: int = resumable(0)
    """Also keep, permanently, every checkpoint whose step is a multiple of this; 0 = none."""
    async_save: bool = resumable(True)
    """Periodic saves copy the state to host memory and write it in the background while training goes on (the
    final and on-signal saves always complete before the process exits)."""
    when_busy: Literal["wait", "skip"] = resumable("wait")
    """A save falls due while the previous one is still writing: "wait" for it, or "skip" the new one."""
    checksum: Literal["crc32", "sha256"] = resumable("crc32")
    """Checksum of every file in the COMMIT marker: "crc32" (fast; guards against torn writes and bit rot) or
    "sha256" (cryptographic; about half the speed)."""
    verify: Literal["checksum", "size"] = resumable("checksum")
    """Checks before a checkpoint is loaded: "checksum" (every file's size and checksum) or "size" (sizes only)."""
    ram_tier: bool = resumable(True)
    """Keep the newest checkpoint in host shared memory too (each rank its own part), so a restart after a crash
    at the same world size and parallel mode loads from RAM; disk otherwise."""
    ram_verify: bool = resumable(False)
    """Recheck every RAM-tier copy's crc32 before a restart uses it (reads it all: about 0.4 s per GiB per core).
    Off by default: the copy lives in memory and is published atomically after its disk checkpoint; a copy that
    cannot be read still falls back to disk."""
    ram_dir: str = resumable("")
    """Directory of the RAM tier; "" = /dev/shm/zaya-<uid> (per node and user). Must be a RAM-backed filesystem to
    help, and this user's alone: one that is another user's, a link, or writable by others is refused (with a
    warning; restarts then load from disk)."""
    on_error: Literal["continue", "stop"] = resumable("continue")
    """A periodic save that fails (e.g. a full disk): "continue" training (the previous checkpoint stays the newest;
    a warning names the error) or "stop" the run (exit 5). A failed closing save (the final one, the one on a
    signal, the one before a context-parallel relaunch) always stops the run with exit 5: nothing trains after it."""

    def __post_init__(self) -> None:
        check_choices(self, "checkpoint")
        if self.keep < 1:
            raise ConfigError(f"checkpoint.keep = {self.keep!r}: must be a positive integer")
        for key in ("every", "keep_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"checkpoint.{key} = {getattr(self, key)!r}: must be >= 0")


@dataclass
class AegisConfig:
    """Aegis, the supervisor of ``zaya run`` ([aegis]): how long silence may last before a rank counts as hung,
    what each detector's finding leads to (the policy table: restart, rewind, exclude, backoff, alert, give_up),
    and when repeated faults end the run with a diagnosis. docs/operations.md describes every rule."""

    poll_s: float = resumable(1.0)
    """Seconds between two looks at the heartbeats, logs and system metrics (detection is at most this late)."""
    heartbeat_timeout_s: float = resumable(300.0)
    """A rank in phase "train" whose heartbeat is older than this is hung (one step should never take as long)."""
    startup_timeout_s: float = resumable(900.0)
    """The same for phase "startup" (imports, data, model build, checkpoint load) and a rank not yet heard from."""
    stopped_timeout_s: float = resumable(5.0)
    """A rank whose process is stopped (state T: SIGSTOP/SIGTSTP; it never resumes by itself) this long is hung,
    whatever its heartbeat's age. Raise it to pause a supervised job by hand; a silent rank waits for the timeouts."""
    checkpoint_timeout_s: float = resumable(1800.0)
    """The same for phase "checkpoint" (a blocking save can take minutes on a large model)."""
    eval_timeout_s: float = resumable(900.0)
    """The same for phase "eval" (a validation pass)."""
    max_repeats: int = resumable(3)
    """Give up (with a diagnosis and the fault's exit code) when the same fault is seen more than this many times."""
    backoff_s: float = resumable(10.0)
    """First wait before relaunching after a transient network fault; doubled on every repeat."""
    backoff_max_s: float = resumable(300.0)
    """Longest wait of the exponential backoff."""
    graceful_stop_s: float = resumable(60.0)
    """A live job that must stop (to exclude a device, rewind) gets SIGTERM, so it checkpoints; SIGKILL after this."""
    nic_flaps: int = resumable(2)
    """NIC link-down lines within nic_window_s that make a finding (a single flap usually heals by itself)."""
    nic_window_s: float = resumable(300.0)
    """The window of nic_flaps."""
    spike_window: int = ranged(128, 1, resumable=True)
    """Steps of the rolling loss statistics the spike rule compares against."""
    spike_sigma: float = resumable(6.0)
    """A loss above mean + spike_sigma x std of the window is a spike."""
    spike_min_steps: int = resumable(16)
    """Steps of history the spike rule needs before it judges."""
    straggler_factor: float = resumable(2.0)
    """A rank whose busy (CPU) time per step is above this many times the others' median is a straggler."""
    straggler_beats: int = resumable(3)
    """Consecutive heartbeats a rank must be an outlier before it is called a straggler."""
    min_free_mb: float = resumable(1024.0)
    """Free space under the run directory below which the disk counts as full (and a relaunch waits for space)."""
    rewind_steps: int = resumable(0)
    """rewind: resume from the newest checkpoint at least this many steps before the bad step."""
    skip_steps: int = resumable(1)
    """rewind: skip the batches of this many steps, starting with the bad one."""
    lr_cut: float = resumable(1.0)
    """rewind: multiply the learning rate by this for lr_cut_steps steps after the bad step (1.0 = no cut)."""
    lr_cut_steps: int = resumable(0)
    """rewind: how many steps the LR cut lasts."""
    spares: int = resumable(0)
    """Spare devices (slots) on this node beyond --nproc-per-node; exclude puts a spare in a bad device's place."""
    min_nproc: int = ranged(1, 1, resumable=True)
    """exclude never shrinks a node below this many ranks (it gives up instead)."""
    warm_standby: bool = resumable(True)
    """Once the job trains, start the next attempt's torchrun ahead of time (its ranks import, then wait, touching
    no device), so that a restart skips the launch and the imports (about 3 s on a CPU node). Single-node jobs only
    (a multi-node job relaunches cold); costs the host memory of the idle processes (about 0.3 GB per rank)."""
    kernel_log: bool = resumable(True)
    """Watch the kernel log (/dev/kmsg) for Xid/ECC/RAS and link lines where it is readable; skipped otherwise."""
    watch_logs: list[str] = resumable(default_factory=list)
    """More log files to watch with the same rules (e.g. a syslog copy, a BMC log)."""
    on_rank_exit: str = resumable("restart")
    """Action when a rank exits with an error of no more specific kind (70 internal, a signal, 5 checkpoint)."""
    on_hang: str = resumable("restart")
    """Action when a rank's heartbeat is older than its phase's timeout."""
    on_collective: str = resumable("backoff")
    """Action on a collective timeout or lost peer (NCCL/RCCL/gloo messages, exit code 6)."""
    on_gpu_error: str = resumable("exclude")
    """Action on an uncorrectable ECC / Xid / amdgpu RAS event."""
    on_nic: str = resumable("backoff")
    """Action on repeated NIC link flaps."""
    on_oom: str = resumable("restart")
    """Action on an out-of-memory error."""
    on_nonfinite: str = resumable("rewind")
    """Action on a non-finite loss or gradient norm (exit code 4)."""
    on_loss_spike: str = resumable("rewind")
    """Action on a loss spike."""
    on_straggler: str = resumable("alert")
    """Action on a straggler rank ("exclude" takes it out of the job)."""
    on_disk_full: str = resumable("restart")
    """Action on a full disk or a file-size limit hit (the relaunch first waits for min_free_mb)."""

    def __post_init__(self) -> None:
        actions = ("restart", "rewind", "exclude", "backoff", "alert", "give_up")
        for f in fields(self):
            if f.name.startswith("on_") and getattr(self, f.name) not in actions:
                raise ConfigError(f"aegis.{f.name} = {getattr(self, f.name)!r}: must be one of "
                                  + ", ".join(f'"{a}"' for a in actions))
        for key in ("poll_s", "heartbeat_timeout_s", "startup_timeout_s", "stopped_timeout_s",
                    "checkpoint_timeout_s", "eval_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"aegis.{key} = {getattr(self, key)!r}: must be > 0 (seconds)")
        for key in ("max_repeats", "rewind_steps", "skip_steps", "lr_cut_steps", "spares", "nic_flaps",
                    "spike_min_steps", "straggler_beats"):
            if getattr(self, key) < 0:
                raise ConfigError(f"aegis.{key} = {getattr(self, key)!r}: must be >= 0")
        if self.min_nproc < 1 or not 0 < self.lr_cut <= 1:
            raise ConfigError("aegis.min_nproc must be >= 1 and aegis.lr_cut in (0, 1]")


@dataclass
class StageConfig:
    """One phase of training ([[stages]]), as in ZAYA1's 4k web -> 4k code/math -> 32k long-context recipe."""

    name: str = "main"
    """Shown in logs and metrics."""
    tokens: int = ranged(0, 0, TOKEN_LIMIT)
    """Global token budget of the stage; 0 = until max_steps (only the last stage)."""
    seq_len: int = 0
    """Sequence length; 0 = train.seq_len."""
    micro_batch_size: int = 0
    """Sequences per rank per micro-batch; 0 = train.micro_batch_size."""
    rope_theta: float = 0.0
    """RoPE base during the stage; 0 = model.rope_theta (ZAYA1 raised it for the 32k phase)."""
    context_parallel: int = 0
    """Context-parallel ranks during the stage; 0 = train.context_parallel. A stage whose size differs from the
    running one ends the run with a checkpoint and exit code 75 and names the size to relaunch with
    (``--set train.context_parallel=N``): the mesh is fixed for the life of the process group."""
    weights: dict[str, float] = field(default_factory=dict)
    """Mixture weights by data.datasets name; empty = data.weights."""

    def __post_init__(self) -> None:
        for key in ("tokens", "seq_len", "micro_batch_size"):
            if getattr(self, key) < 0:
                raise ConfigError(f"stage {self.name!r}: {key} must be >= 0")
        if self.rope_theta < 0:
            raise ConfigError(f"stage {self.name!r}: rope_theta must be >= 0")


@dataclass
class DataConfig:
    """Where the training tokens come from: prepared datasets (``zaya data prepare``) and how to read them."""

    datasets: dict[str, str] = field(default_factory=lambda: {"shakespeare": "builtin:shakespeare"})
    """Name -> prepared dataset directory, or "builtin:shakespeare" (prepared on first use and cached)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Mixture weights by dataset name (empty: equal weights)."""
    seed: int = ranged(0, 0, SEED_LIMIT)
    """Seed of the shuffle (a keyed permutation per dataset and epoch)."""
    document_positions: bool = False
    """Give the model position ids that restart at every document start."""
    document_mask: bool = False
    """Also keep attention inside each packed document (needs document_positions; with or without context
    parallelism). Off: a token attends to the earlier documents of its sequence too. Chat data (datasets with loss
    masks) needs both on."""
    prefetch: int = resumable(4)
    """Batches computed ahead by the loader's background thread (0: none)."""
    val_batches: int = ranged(8, 1)
    """Validation batches (per rank) at each evaluation."""
    builtin_vocab_size: int = ranged(4096, 320)
    """Vocabulary of the BPE trained for a builtin corpus (a multiple of 64)."""
    cache_dir: str = resumable("")
    """Where builtin corpora are prepared ("" = $ZAYA_CACHE_DIR, else ~/.cache/zaya)."""
    node_local: bool = resumable(False)
    """false: rank 0 resolves (and prepares) every dataset and all ranks read those directories, which on several
    nodes must be on a shared filesystem; true: the first rank of every node resolves them itself (node-local
    disks or caches), and all nodes must end up with identical datasets (their manifests are compared)."""

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
        if self.document_mask and not self.document_positions:
            raise ConfigError("data.document_mask = true needs data.document_positions = true (the document starts "
                              "come from the restarting positions)")
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
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    stages: list[StageConfig] = field(default_factory=list)
    aegis: AegisConfig = field(default_factory=AegisConfig)

    def __post_init__(self) -> None:
        for i, stage in enumerate(self.stages):
            if stage.tokens == 0 and i != len(self.stages) - 1:
                raise ConfigError(f"stage {stage.name!r} has tokens = 0 (unlimited) but is not the last stage")
            unknown = sorted(set(stage.weights) - set(self.data.datasets))
            if unknown:
                raise ConfigError(f"stage {stage.name!r}: weights name {unknown}, not in data.datasets "
                                  f"({', '.join(sorted(self.data.datasets))})")
            seq_len = stage.seq_len or self.train.seq_len
            if stage.context_parallel < 0:
                raise ConfigError(f"stage {stage.name!r}: context_parallel = {stage.context_parallel}: must be >= 0")
            self._check_context_parallel(seq_len, f"stage {stage.name!r}: seq_len",
                                         stage.context_parallel or self.train.context_parallel)
            if seq_len > self.model.max_seq_len:
                raise ConfigError(f"stage {stage.name!r}: seq_len {seq_len} > model.max_seq_len "
                                  f"{self.model.max_seq_len}")
        if not self.stages and self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(f"train.seq_len = {self.train.seq_len} > model.max_seq_len = {self.model.max_seq_len}")
        if not self.stages:
            self._check_context_parallel(self.train.seq_len, "train.seq_len", self.train.context_parallel)
        ep = self.train.expert_parallel
        if ep > 1 and self.model.num_experts % ep:
            fits = [n for n in range(1, self.model.num_experts + 1) if self.model.num_experts % n == 0]
            raise ConfigError(f"train.expert_parallel = {ep} does not divide model.num_experts = "
                              f"{self.model.num_experts}: pass --set train.expert_parallel=N with N one of {fits}")

    def stage_context_parallel(self, name: str) -> int:
        """The context-parallel size the stage called ``name`` runs with."""
        own = {s.name: s.context_parallel for s in self.stages}.get(name, 0)
        return own or self.train.context_parallel

    def _check_context_parallel(self, seq_len: int, what: str, cp: int) -> None:
        problem = zigzag_length_problem(seq_len, cp)
        if problem:
            raise ConfigError(f"{what} = {seq_len} {problem}, or change the context_parallel size")


def zigzag_length_problem(seq_len: int, cp: int) -> str:
    """Why ``seq_len`` tokens cannot be laid out zigzag over ``cp`` context-parallel ranks, with the nearest length
    that can; "" when they can. The layout cuts a sequence into 2 x cp chunks, each at least 2 tokens long (CCA's
    convolution reach across a chunk boundary)."""
    chunks = 2 * cp
    if cp <= 1 or (seq_len % chunks == 0 and seq_len // chunks >= 2):
        return ""
    shortest = 2 * chunks
    below = seq_len // chunks * chunks
    nearest = max(shortest, below if seq_len - below <= below + chunks - seq_len else below + chunks)
    return (f"cannot be split over context_parallel = {cp} ranks: the zigzag layout needs a multiple of 2 x {cp} = "
            f"{chunks} with at least 2 tokens per chunk (at least {shortest}); use e.g. {nearest}")


def _nearest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" Did you mean {match[0]!r}?" if match else f" Valid keys: {', '.join(sorted(valid))}."


_MOVED_KEYS = {"train.checkpoint_every": "checkpoint.every", "train.keep_checkpoints": "checkpoint.keep"}
"""Keys of older configs that now live elsewhere, so their error says where."""


def _build(cls: type, table: dict[str, Any], where: str) -> Any:
    """Construct dataclass ``cls`` from a TOML table, rejecting unknown keys and wrong types."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {type(table).__name__}")
    hints = get_type_hints(cls)
    valid = [f.name for f in fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        moved = _MOVED_KEYS.get(f"{where.rsplit('[', 1)[-1].strip('[]')}.{key}")
        if moved:
            raise ConfigError(f"{where}: {key!r} has moved: write it as {moved} (in the [{moved.split('.')[0]}] "
                              "table)")
        if key not in valid:
            raise ConfigError(f"{where}: unknown key {key!r}.{_nearest(key, valid)}")
        try:
            kwargs[key] = _check_type(value, hints[key], f"{where}.{key}")
        except _NonFinite as err:
            raise ConfigError(f"{err}: must be a finite number within float32's range (+-3.4e38; nan and inf are "
                              f"not values a run can use); write a finite one{_default_of(cls, key)}") from None
    _check_ranges(cls, kwargs, where)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(f"{where.rsplit('[', 1)[0]}: {err}") from None


MAX_TIMEOUT_S = 1e12
"""The longest timeout a config may set (about 31,700 years: beyond any run, within what a timedelta holds)."""
FLOAT_LIMIT = 3.4028234663852886e38
"""The largest float32: every config float reaches a float32 tensor, a timer or a rate, where a larger one overflows."""


def _default_of(cls: type, key: str) -> str:
    """" (the default is X)" for a field of ``cls`` that has a plain default, "" otherwise."""
    default = next(f.default for f in fields(cls) if f.name == key)
    return f" (the default is {default!r})" if default is not dataclasses.MISSING else ""


def _bound(n: int) -> str:
    return f"2**{n.bit_length() - 1}" if n >= 2**20 and n & (n - 1) == 0 else str(n)


def _check_ranges(cls: type, values: dict[str, Any], where: str) -> None:
    """The one rule of int fields: each of ``values`` (a table's keys, already of the right type) lies in its
    field's declared range [lo, hi) (``ranged``; [0, INT_LIMIT) when none is declared), a bound naming another field
    taken from ``values`` or that field's default. A value outside is a ConfigError naming the key, the value, the
    range and the default (an id or size past it ended in a traceback where a tensor was made from it)."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        if hints[f.name] is not int or f.name not in values:
            continue
        lo, hi = f.metadata.get("range", (0, INT_LIMIT))
        if isinstance(hi, str):  # another field, checked before this one (fields are in order)
            limit = values.get(hi, getattr(cls, hi))
            shown = f"{hi} = {limit}"
        else:
            limit, shown = hi, _bound(hi)
        if not lo <= values[f.name] < limit:
            raise ConfigError(f"{where}.{f.name} = {values[f.name]!r}: must be an integer in [{lo}, {shown}); write "
                              f"one in that range{_default_of(cls, f.name)}")


class _NonFinite(ConfigError):
    """A float value that is nan or +-inf (TOML has both; ``--set optim.lr=nan`` parses as one): every float
    field refuses it, since no rate, timeout or coefficient of a run is meaningful as one."""


def _check_type(value: Any, hint: Any, where: str) -> Any:
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT_LIMIT):
        raise _NonFinite(f"{where} = {value!r}")
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
        if not isinstance(value, (list, tuple)) or len(value) != len(hint.__args__):
            raise ConfigError(f"{where} = {value!r}: expected a list of {len(hint.__args__)}")
        return tuple(_check_type(v, h, f"{where}[{i}]") for i, (v, h) in enumerate(zip(value, hint.__args__)))
    if getattr(hint, "__origin__", None) is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} = {value!r}: expected a list")
        (item,) = hint.__args__
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Build a Config from nested dicts (TOML tables), with errors that name ``source``."""
    tables = {f.name: f.type for f in fields(Config)}
    for key in data:
        if key not in tables:
            raise ConfigError(f"{source}: unknown table [{key}].{_nearest(key, list(tables))}")
    model = _build(ModelConfig, data.get("model", {}), f"{source} [model]")
    data_config = _build(DataConfig, data.get("data", {}), f"{source} [data]")
    optim = _build(OptimConfig, data.get("optim", {}), f"{source} [optim]")
    train = _build(TrainConfig, data.get("train", {}), f"{source} [train]")
    checkpoint = _build(CheckpointConfig, data.get("checkpoint", {}), f"{source} [checkpoint]")
    stages_raw = data.get("stages", [])
    if not isinstance(stages_raw, list):
        raise ConfigError(f"{source}: [[stages]] must be an array of tables")
    stages = [_build(StageConfig, t, f"{source} [[stages]][{i}]") for i, t in enumerate(stages_raw)]
    aegis = _build(AegisConfig, data.get("aegis", {}), f"{source} [aegis]")
    try:
        return Config(model=model, data=data_config, optim=optim, train=train, checkpoint=checkpoint,
                      stages=stages, aegis=aegis)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set table.key=value`` overrides to raw config tables; values are TOML (bare words are strings).

    ``train.lr=1e-3``, ``data.datasets.web="data/web"``, ``stages.1.seq_len=32768`` (a stage by index).
    """
    data = tomllib.loads(_dump_toml(data)) if data else {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected table.key=value, e.g. --set train.max_steps=100")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()  # a bare word: a string
        except RecursionError:
            raise ConfigError(f"--set {key.strip()}=...: a value nested too deep to read") from None
        parts = key.strip().split(".")
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"--set {item!r}: {'.'.join(parts[:i])} has {len(node)} entries; "
                                      f"{part!r} is not an index of one")
                node = node[int(part)]
            else:
                node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"--set {item!r}: {'.'.join(parts[:i + 1])} is a value, not a table")
        if isinstance(node, list):
            raise ConfigError(f"--set {item!r}: cannot replace a whole list entry; set one of its keys")
        node[parts[-1]] = value
    return data


def _dump_toml(data: dict[str, Any]) -> str:
    import tomli_w

    return tomli_w.dumps(data)


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a TOML config file, apply ``--set`` overrides. Missing tables and keys take their defaults."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (presets live in configs/*.toml)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise ConfigError(f"{path}: arrays or tables nested too deep to read (a config nests a few levels); "
                          "write a flatter file") from None
    except (UnicodeDecodeError, OSError) as err:
        raise ConfigError(f"{path}: cannot be read as UTF-8 text ({err})") from None
    source = str(path)
    if overrides:
        data = apply_overrides(data, overrides)
        source = f"{path} with --set {' '.join(overrides)}"
    return config_from_dict(data, source)


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


def config_differences(old: Config, new: Config) -> list[str]:
    """Keys (``table.key``) whose values differ between two configs, leaving out the fields declared
    ``resumable`` (those may change when a run is resumed). Stages compare whole (``stages``)."""
    out: list[str] = []
    for table in fields(Config):
        a, b = getattr(old, table.name), getattr(new, table.name)
        if not dataclasses.is_dataclass(a):
            if to_dict(Config(stages=a))["stages"] != to_dict(Config(stages=b))["stages"]:
                out.append(table.name)
            continue
        for f in fields(a):
            if f.metadata.get("resumable"):
                continue
            x, y = getattr(a, f.name), getattr(b, f.name)
            if (list(x) if isinstance(x, tuple) else x) != (list(y) if isinstance(y, tuple) else y):
                out.append(f"{table.name}.{f.name}")
    return out


def dump_config(config: Config, path: str | Path) -> Path:
    """Write ``config`` as TOML (every key, defaults included) so a run records exactly what it used."""
    import tomli_w

    path = Path(path)
    atomic_write_text(path, tomli_w.dumps(to_dict(config)))
    return path
