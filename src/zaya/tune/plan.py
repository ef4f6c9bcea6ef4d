"""``zaya plan``: what a config needs on a cluster before it is launched.

For a config, a GPU count and the hardware's memory, speed, network and storage, per stage of the data schedule
and for each parallel mode (ddp, zero1, fsdp), with and without activation checkpointing and context parallelism:

* **Memory per GPU**, in parts. Persistent (between steps): fp32 master weights (4 bytes per parameter), fp32
  gradients (4: DDP's and ZeRO-1's gradient buckets stay allocated; FSDP2's sharded gradients and a single GPU's are
  dropped after each step and made again in the backward), optimizer state (Muon's momentum, 4 bytes per matrix
  parameter; AdamW's two moments, 8 bytes per other parameter). ZeRO-1 holds the state of the parameters a rank owns
  (zaya's size-balanced owners: the largest rank's share is used), FSDP2 a 1/N shard of all three (N = every rank:
  gradients are reduced over dp x cp). Per micro-batch: the activation memory of the forward and backward, *traced*
  from the model's own code on fake tensors (``zaya.tune.activation_trace``: saved activations, autocast's weight
  copies, the loss and backward temporaries, by phase), plus FSDP2's gathered weights (the root module's and two
  blocks', or every block's without resharding after the forward) and one block's unsharded gradients and
  reduce-scatter buffers, plus, under
  context parallelism with all-gathered K/V, the gathered remote K/V of every layer. Optimizer step: the persistent
  memory plus Muon's Newton-Schulz work on the largest matrix and ZeRO-1's parameter broadcast buffer.
  The peak is the larger of the micro-batch's and the optimizer step's.
* **The largest micro-batch that fits** in ``gpu_memory x (1 - headroom)`` (the headroom is for the CUDA/HIP context,
  allocator fragmentation and NCCL/RCCL buffers, none of which a tensor count sees).
* **Throughput and time**: tokens/s = GPUs x peak FLOP/s x MFU / training FLOPs per token (6 N_active plus attention
  at the stage's context, ``zaya.model.info``); activation checkpointing recomputes the forward (4/3 of the FLOPs).
  MFU is assumed (``--mfu``) or the median ``mfu`` of a run's metrics.jsonl (``--mfu runs/x/metrics.jsonl``).
* **Communication per step**: bytes each GPU sends for the mode's collectives, and their time at ``--net-gbps``
  (against the step's compute time: overlapped, they must stay below it).
* **Expert parallelism** (the config's ``train.expert_parallel``, ddp and zero1 rows): a GPU holds 1/ep of the
  experts' weights and gradients (and of their Muon state under ddp), and sends the all-to-all's tokens
  (``all_to_all_bytes_per_step``; counted with the mode's NIC bytes unless the ep group sits inside a node of a
  multi-node job, where it crosses the node's fabric instead; not overlapped with compute in zaya).
* **The expert-parallel degree to use** (``expert_parallel_plan``, per stage): for every degree that divides both
  ``model.num_experts`` and the GPU count, the peak memory per GPU at the stage's micro-batch (under
  ``train.parallel`` ddp or zero1, the config's activation checkpointing and the stage's context parallelism; under
  fsdp degree 1 alone: FSDP2 already shards the experts over every rank, so a degree saves no memory there) and
  the all-to-all's time per step: its bytes
  (``all_to_all_bytes_per_step``) priced from the measured all-to-all curve of the hardware profile
  (``--hardware-profile``, or the visible GPU's profile, where ``zaya tune comm`` wrote one: bus bandwidth at the
  message size one layer's exchange sends), else at ``--net-gbps``; the row says which. **The rule**: the smallest
  degree whose peak fits the memory budget with its all-to-all at most ``ALL_TO_ALL_SHARE_BOUND`` (25 %) of the
  step's compute time (the all-to-all share only grows with the degree, as (ep - 1) / ep of the routed rows leave
  a rank, and it is not overlapped, so a larger degree than memory needs only slows the step; the smallest also
  keeps the group inside a node where one fits). None fits: no recommendation, and the reason says what failed.
* **Checkpoints and data**: checkpoint size (weights and optimizer state) and its write time at ``--storage-gbps``;
  the read bandwidth the data loader needs at the planned tokens/s (2 bytes per token for vocabularies up to 65,536,
  else 4).

Validated against measured peaks of real CPU runs (benchmarks/planner_validation.py, docs/tuning.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zaya.config import PARALLEL_MODES, Config, load_config
from zaya.core.errors import ConfigError
from zaya.core.hardware import compute_dtype
from zaya.core.metrics_file import parse_records
from zaya.core.units import format_count, format_duration
from zaya.tune import report as skeleton
from zaya.tune.comm import expert_all_to_all, price_all_to_all

MODES = PARALLEL_MODES
GIB = 2 ** 30
MAX_MICRO_BATCH = 4096
ALL_TO_ALL_SHARE_BOUND = 0.25
"""The recommended expert-parallel degree's all-to-all takes at most this share of the step's compute time."""


@dataclass(frozen=True)
class Sizes:
    """Parameter counts of a model config that the memory model needs (from a meta-device model)."""

    total: int
    muon: int
    adamw: int
    largest_matrix: int
    """Elements of the largest single Muon matrix (one expert of a stack)."""
    largest_stack: int
    """Elements of the largest same-shape group a GPU orthogonalises in one batched call (at most 2^27)."""
    block: int
    """Parameters of one transformer block."""
    root: int
    """Parameters outside the blocks (embedding / tied head, final norm)."""
    buffers_bytes: int
    owned_max: int
    """Under ZeRO-1 over the planned ranks: elements of the rank owning the most."""
    owned_muon: int
    owned_adamw: int
    experts: int = 0
    """Elements of the stacked expert weights (what expert parallelism splits)."""


@functools.lru_cache(maxsize=32)
def _model_sizes(model_key: str, ranks: int) -> Sizes:
    from zaya.config import model_config_from_dict
    from zaya.distributed.parallel import assign_owners
    from zaya.model import ZayaForCausalLM
    from zaya.model.info import parameter_count
    from zaya.optim.build import split_parameters
    from zaya.optim.newton_schulz import BATCH_ELEMENTS

    cfg = model_config_from_dict(json.loads(model_key))
    with torch.device("meta"):
        model = ZayaForCausalLM(cfg)
    split = split_parameters(model)
    muon = [p for _, p in split.muon]
    adamw = [p for _, p in split.adamw_decay + split.adamw_no_decay]
    params = muon + adamw
    block = parameter_count(model.blocks[0])
    total = parameter_count(params)
    owner = assign_owners(params, ranks)
    muon_ids = {id(p) for p in muon}
    load = [[0, 0] for _ in range(ranks)]
    for p in params:
        load[owner[id(p)]][0 if id(p) in muon_ids else 1] += p.numel()
    heaviest = max(range(ranks), key=lambda r: 4 * load[r][0] + 8 * load[r][1])
    shapes: dict[tuple[int, int], int] = {}
    for p in muon:
        m, n = p.shape[-2:]
        shapes[m, n] = shapes.get((m, n), 0) + (p.shape[0] if p.ndim == 3 else 1)
    stack = max((min(count, max(1, BATCH_ELEMENTS // (m * n))) * m * n for (m, n), count in shapes.items()),
                default=0)
    return Sizes(total=total, muon=parameter_count(muon), adamw=parameter_count(adamw),
                 largest_matrix=max((m * n for m, n in shapes), default=0), largest_stack=stack, block=block,
                 root=total - cfg.num_layers * block,
                 buffers_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
                 owned_max=max(sum(x) for x in load), owned_muon=load[heaviest][0], owned_adamw=load[heaviest][1],
                 experts=parameter_count([p for p in muon if p.ndim == 3]))


def model_sizes(config: Config, ranks: int) -> Sizes:
    from zaya.config import to_dict

    return _model_sizes(json.dumps(to_dict(config.model), sort_keys=True), ranks)


@functools.lru_cache(maxsize=64)
def _activations(model_key: str, seq_len: int, dtype: str, ac: bool, param_dtype: str):
    from zaya.config import model_config_from_dict
    from zaya.tune.activation_trace import activation_model

    return activation_model(model_config_from_dict(json.loads(model_key)), seq_len, dtype=dtype,
                            activation_checkpointing=ac, param_dtype=param_dtype)


def persistent_bytes(sizes: Sizes, mode: str, ranks: int, ep: int = 1) -> dict[str, int]:
    """Bytes per GPU between steps: master weights, gradients, optimizer state, buffers. ``ep``: the expert-parallel
    degree (ddp and zero1): a rank holds 1/ep of the experts' weights and gradients, and under ddp of their Muon
    state (ZeRO-1's owners already split the state over every rank)."""
    if mode == "fsdp":
        shard = lambda n: math.ceil(n / ranks)  # noqa: E731
        # The sharded gradients are dropped after each step (zero_grad(set_to_none)) and made again in the backward.
        return {"weights": 4 * shard(sizes.total), "gradients": 0,
                "optimizer": 4 * shard(sizes.muon) + 8 * shard(sizes.adamw), "buffers": sizes.buffers_bytes}
    away = sizes.experts - sizes.experts // ep  # expert elements held by the other ranks of the ep group
    optimizer = 4 * (sizes.muon - away) + 8 * sizes.adamw
    if mode == "zero1":
        optimizer = 4 * sizes.owned_muon + 8 * sizes.owned_adamw
    return {"weights": 4 * (sizes.total - away), "gradients": 4 * (sizes.total - away), "optimizer": optimizer,
            "buffers": sizes.buffers_bytes}


def memory_plan(config: Config, *, gpus: int, parallel: str, micro_batch: int, seq_len: int, cp: int = 1,
                activation_checkpointing: bool = False, reshard_after_forward: bool | None = None,
                device_type: str = "cuda", budget_bytes: float | None = None, ep: int = 1) -> dict[str, Any]:
    """Bytes per GPU for one stage shape (see the module docstring); keys: the parts (``weights``, ``gradients``,
    ``optimizer`` state, ``buffers``, ``activations``), ``persistent``, ``forward_backward``, ``optimizer_step``,
    ``peak``, ``per_sequence`` (the peak's growth per extra sequence) and, given ``budget_bytes``,
    ``max_micro_batch`` (0: not even one sequence fits).

    Gradients are reduced, and ZeRO-1 / FSDP2 shard, over every rank (dp x cp: each holds different tokens), so the
    shard count is ``gpus``. One GPU runs without a wrapper: its gradients are made in the backward and dropped after
    the step, so they count in the blocks' backward and the optimizer step, not between steps."""
    if parallel not in MODES:
        raise ConfigError(f"--parallel {parallel!r}: must be one of {', '.join(MODES)}")
    if gpus % cp:
        raise ConfigError(f"--gpus {gpus} is not a multiple of context parallel {cp}")
    from zaya.config import to_dict
    from zaya.core.hardware import load_profile

    mc, dtype = config.model, compute_dtype(config.train.dtype, device_type)
    dp = gpus // cp
    sizes = model_sizes(config, gpus)
    compute_bytes = 2 if dtype == "bfloat16" else 4
    fsdp = parallel == "fsdp" and gpus > 1
    single = gpus == 1
    if reshard_after_forward is None:
        reshard_after_forward = load_profile(torch.device("cpu")).fsdp_reshard_after_forward
    key = json.dumps(to_dict(mc), sort_keys=True)
    rank_seq = seq_len // cp
    acts = _activations(key, rank_seq, dtype, activation_checkpointing,
                        "bfloat16" if fsdp and dtype == "bfloat16" else "float32")
    layers = mc.num_layers

    def micro(batch: int) -> dict[str, int]:
        tokens = batch * rank_seq
        phases = acts.phase_peaks(layers, tokens)
        extra = {"forward_peak": 0, "head_peak": 0, "blocks_peak": 0}
        if fsdp:
            # Gathered weights in the compute dtype: the root's (embedding, head, final norm) stay from its forward
            # to the end of the backward; blocks are gathered one ahead (two at a time), or all stay gathered
            # without resharding after the forward.
            blocks = lambda n: compute_bytes * sizes.block * (n if reshard_after_forward else layers)  # noqa: E731
            root = compute_bytes * sizes.root
            # The root's gradients wait for the end of the backward; one block's unsharded gradients, their fp32
            # copy for the reduce-scatter under bf16, and its output shard.
            block_grads = (compute_bytes * sizes.block + (4 * sizes.block if compute_bytes != 4 else 0)
                           + 4 * math.ceil(sizes.block / gpus))
            extra = {"forward_peak": root + blocks(2), "head_peak": 2 * root + blocks(1),
                     "blocks_peak": 2 * root + blocks(2) + block_grads}
        if cp > 1 and config.train.context_parallel_method == "allgather":
            # Every layer keeps the gathered K and V of the other ranks' chunks for its backward.
            remote_kv = layers * batch * (seq_len - rank_seq) * 2 * mc.num_kv_heads * mc.head_dim * compute_bytes
            extra = {k: v + remote_kv for k, v in extra.items()}
        if single:  # every gradient exists by the end of the backward
            extra["blocks_peak"] += 4 * sizes.total
        total = {k: phases[k] + extra[k] for k in phases}
        return {"activations": acts.saved_bytes(layers, tokens), "micro_batch_peak": max(total.values())}

    persistent = persistent_bytes(sizes, parallel if gpus > 1 else "ddp", gpus, ep if gpus > 1 else 1)
    if single:
        persistent["gradients"] = 0
    fixed = sum(persistent.values())
    m1, m2 = micro(micro_batch), micro(micro_batch + 1)
    forward_backward = fixed + m1["micro_batch_peak"]
    # Optimizer step (a coarser model than the micro-batch's; it is rarely the peak): Newton-Schulz iterates of the
    # largest matrix (about five copies in its dtype; GPUs batch same-shape matrices, CPUs run big ones singly);
    # with DDP, distributed Muon's exchange of the updates a rank computed (4 bytes per matrix parameter / ranks);
    # with ZeRO-1, two of the flat buffers the owners broadcast their parameters in.
    ns_bytes = 2 if compute_dtype(config.optim.muon_ns_dtype, device_type) == "bfloat16" else 4
    optimizer_work = 5 * ns_bytes * (sizes.largest_stack if device_type == "cuda" else sizes.largest_matrix)
    if single:
        optimizer_work += 4 * sizes.total  # the gradients
    if parallel == "ddp" and gpus > 1 and config.optim.muon_distributed != "local":
        optimizer_work += 4 * math.ceil(sizes.muon / gpus)
    if parallel == "zero1" and gpus > 1:
        optimizer_work += 2 * 4 * sizes.owned_max
    if fsdp:
        # The sharded gradients (alive until the step ends) and distributed Muon's all-to-all of whole matrices to
        # their owners and back (send and receive buffers, each about a 1/ranks share of the matrices).
        optimizer_work += 4 * math.ceil(sizes.total / gpus) + 2 * 4 * math.ceil(sizes.muon / gpus)
    optimizer = fixed + optimizer_work
    out: dict[str, Any] = {"parallel": parallel, "gpus": gpus, "dp": dp, "cp": cp, "ep": ep,
                           "micro_batch": micro_batch,
                           "seq_len": seq_len, "activation_checkpointing": activation_checkpointing, **persistent,
                           "activations": m1["activations"], "persistent": fixed,
                           "forward_backward": forward_backward, "optimizer_step": optimizer,
                           "peak": max(forward_backward, optimizer),
                           "per_sequence": m2["micro_batch_peak"] - m1["micro_batch_peak"]}
    if budget_bytes is not None:
        out["max_micro_batch"] = 0
        if optimizer <= budget_bytes:
            # The peak grows with the micro-batch (monotone): gallop up while it fits, then bisect.
            lo, stride, failed = 0, 1, False
            while stride:
                if lo + stride <= MAX_MICRO_BATCH and fixed + micro(lo + stride)["micro_batch_peak"] <= budget_bytes:
                    lo += stride
                    stride = stride // 2 if failed else stride * 2
                else:
                    failed, stride = True, stride // 2
            out["max_micro_batch"] = lo
    return out


# --- time, communication, checkpoints, data -------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """What ``zaya plan`` is told about the cluster."""

    gpus: int
    gpu_memory_gib: float
    """Memory of one GPU in GiB (what torch.cuda.get_device_properties reports: 192 GB MI300X ~ 192 GiB)."""
    tflops: float
    """Dense bf16 peak of one GPU in TFLOP/s (datasheet: MI300X 1307, H100/H200 989)."""
    net_gbps: float | None = None
    """Network bandwidth per GPU in Gbit/s (ZAYA1: one 400 Gbit/s Pollara NIC per GPU); None: not planned."""
    storage_gbps: float | None = None
    """Aggregate storage bandwidth in Gbit/s (checkpoint writes, data reads); None: not planned."""
    gpus_per_node: int = 8
    headroom: float = 0.10
    """Share of each GPU's memory kept free (runtime context, allocator fragmentation, collective buffers)."""
    mfu: float = 0.35
    """Model FLOPs utilisation assumed (or measured) without activation checkpointing."""
    all_to_all_busbw: dict[int, list[tuple[int, float]]] | None = None
    """The measured all-to-all curves, (bytes, bus GB/s) per rank count (``profile_all_to_all``); None: not measured."""
    profile: str = ""
    """The hardware profile the curves came from."""

    @property
    def budget_bytes(self) -> float:
        return self.gpu_memory_gib * GIB * (1 - self.headroom)


@dataclass(frozen=True)
class StageShape:
    name: str
    seq_len: int
    micro_batch: int
    cp: int
    tokens: int
    tokens_note: str
    global_batch_tokens: int


def stage_shapes(config: Config, gpus: int, last_stage_tokens: int | None = None) -> list[StageShape]:
    """The data schedule's stages with their token budgets and global batch (at the stage's start)."""
    from zaya.train.schedule import global_batch_tokens, stages_of

    tc = config.train
    out: list[StageShape] = []
    seen = 0
    stages = stages_of(config)
    for i, stage in enumerate(stages):
        cp = config.stage_context_parallel(stage.name) if config.stages else tc.context_parallel
        default = tc.global_batch_tokens or stage.micro_batch_size * stage.seq_len * (gpus // max(cp, 1))
        batch = global_batch_tokens(seen, default, tc.batch_ramp)
        tokens, note = stage.tokens, ""
        if not tokens:
            if last_stage_tokens is not None:
                tokens, note = last_stage_tokens, "--last-stage-tokens"
            else:
                steps_before = sum(math.ceil(s.tokens / max(1, o.global_batch_tokens)) for s, o in zip(stages, out))
                tokens, note = max(0, tc.max_steps - steps_before) * batch, "until train.max_steps"
        out.append(StageShape(stage.name, stage.seq_len, stage.micro_batch_size, cp, tokens, note, batch))
        seen += tokens
    return out


def train_flops_per_token(config: Config, seq_len: int) -> float:
    """Forward + backward model FLOPs per token at a causal context of ``seq_len`` (average seq_len / 2 keys)."""
    from zaya.model.info import forward_flops_per_token

    return 3 * sum(forward_flops_per_token(config.model, round(seq_len / 2)).values())


def comm_bytes_per_step(sizes: Sizes, mode: str, ranks: int, compute_bytes: int, reshard: bool,
                        gpus_per_node: int) -> dict[str, float]:
    """Bytes each GPU's NIC sends per optimizer step for the data-parallel collectives.

    Bandwidth-optimal hierarchical algorithms (what NCCL/RCCL reach on rail-connected nodes): inside a node the
    GPUs reduce-scatter (or gather) over the node's fabric, and each GPU exchanges its 1/gpus_per_node share with
    its peers on the other nodes, so a NIC carries (nodes - 1) / nodes of that share per pass (an all-reduce is two
    passes). Inside one node nothing crosses a NIC: the figure is then the fabric's traffic per GPU.
    """
    if ranks <= 1:
        return {}
    if ranks > gpus_per_node:
        nodes = ranks / gpus_per_node
        share = (nodes - 1) / nodes / gpus_per_node
    else:
        share = (ranks - 1) / ranks
    grads = 4 * sizes.total
    if mode == "ddp":
        return {"all_reduce_gradients": 2 * share * grads}
    if mode == "zero1":
        return {"all_reduce_gradients": 2 * share * grads, "broadcast_parameters": share * 4 * sizes.total}
    gathers = 2 if reshard else 1
    return {"all_gather_parameters": gathers * share * compute_bytes * sizes.total,
            "reduce_scatter_gradients": share * grads}


def all_to_all_bytes_per_step(config: Config, tokens_per_gpu: float, ep: int, compute_bytes: int) -> float:
    """Bytes each GPU sends per step in expert parallelism's all-to-all (``zaya.tune.comm.expert_all_to_all``): every
    MoE layer sends the (ep - 1) / ep of its routed assignments (tokens x top_k rows of hidden_size) whose experts
    live elsewhere, and gets their results back, in the forward and again (their gradients) in the backward: four
    exchanges (activation checkpointing's recomputed forward adds two more, not counted). A group inside one node
    sends this over the node's fabric, not a NIC."""
    mc = config.model
    return expert_all_to_all(mc.num_layers, mc.top_k, mc.hidden_size, tokens_per_gpu, 1, compute_bytes, ep)["bytes"]


def profile_all_to_all(profile: Any) -> dict[int, list[tuple[int, float]]] | None:
    """The all-to-all curves ``zaya tune comm`` wrote into a hardware profile's ``comm`` (None when it wrote none);
    a malformed one is a ConfigError naming the file."""
    raw = profile.comm.get("all_to_all_busbw_gbps")
    if not raw:
        return None
    try:
        curves = {int(n): sorted((int(size), float(bw)) for size, bw in points) for n, points in raw.items()}
    except (AttributeError, TypeError, ValueError):
        curves = {}
    if not curves or any(not points or min(bw for _, bw in points) <= 0 for points in curves.values()):
        raise ConfigError(f"{profile.path}: comm.all_to_all_busbw_gbps must map rank counts to [bytes, GB/s] "
                          "pairs with positive bandwidths; rerun `zaya tune comm` to rewrite it")
    return curves


def _all_to_all_seconds(hw: Hardware, ep: int, exchange: dict[str, float], in_node: bool) -> tuple[float | None, str]:
    """A step's all-to-all time at degree ``ep`` and what priced it: the measured curve (inside a node, or across
    nodes where exactly ``ep`` ranks were measured), else the link bandwidth ``--net-gbps``."""
    if ep == 1:
        return 0.0, "no all-to-all"
    curves = hw.all_to_all_busbw
    if curves and (in_node or ep in curves):
        per, note = price_all_to_all(curves, ep, exchange["message_bytes"])
        return exchange["exchanges"] * per, f"measured all-to-all, {hw.profile}: {note}"
    if hw.net_gbps:
        return exchange["bytes"] / (hw.net_gbps * 1e9 / 8), (
            f"link bandwidth --net-gbps {hw.net_gbps:g}" + ("; no measured all-to-all curve, and a node's fabric is "
                                                            "faster: an upper bound" if in_node else ""))
    return None, "not priced: no measured all-to-all curve (zaya tune comm) and no --net-gbps"


def expert_parallel_plan(config: Config, hw: Hardware, st: StageShape, step_seconds: float,
                         reshard: bool) -> dict[str, Any]:
    """Memory and all-to-all time per GPU at every candidate expert-parallel degree of one stage, and the degree
    the module docstring's rule recommends (``recommended``, None when none qualifies, ``reason`` either way)."""
    tc, mc = config.train, config.model
    mode, ac = tc.parallel, tc.activation_checkpointing
    compute_bytes = 2 if compute_dtype(tc.dtype, "cuda") == "bfloat16" else 4
    micro_tokens = st.micro_batch * st.seq_len // st.cp
    micro_batches = st.global_batch_tokens / hw.gpus / micro_tokens
    rows = []
    top = 1 if mode == "fsdp" else hw.gpus  # FSDP2 shards the experts over every rank already: no degree saves memory
    for ep in (d for d in range(1, top + 1) if mc.num_experts % d == 0 and hw.gpus % d == 0):
        m = memory_plan(config, gpus=hw.gpus, parallel=mode, micro_batch=st.micro_batch, seq_len=st.seq_len,
                        cp=st.cp, activation_checkpointing=ac, reshard_after_forward=reshard,
                        budget_bytes=hw.budget_bytes, ep=ep)
        exchange = expert_all_to_all(mc.num_layers, mc.top_k, mc.hidden_size, micro_tokens, micro_batches,
                                     compute_bytes, ep)
        in_node = ep <= hw.gpus_per_node
        seconds, source = _all_to_all_seconds(hw, ep, exchange, in_node)
        rows.append({"ep": ep, "in_node": in_node, "peak": m["peak"], "fits": m["peak"] <= hw.budget_bytes,
                     "max_micro_batch": m["max_micro_batch"], "all_to_all_bytes": exchange["bytes"],
                     "all_to_all_message_bytes": exchange["message_bytes"], "all_to_all_seconds": seconds,
                     "share_of_step": None if seconds is None else seconds / step_seconds, "priced_from": source})
    where = f"{mode}, activation checkpointing {'on' if ac else 'off'}, cp {st.cp}, micro-batch {st.micro_batch}"
    bound = ALL_TO_ALL_SHARE_BOUND
    pick = next((r for r in rows if r["fits"] and (r["share_of_step"] is None or r["share_of_step"] <= bound)), None)
    if pick is not None:
        reason = f"the smallest degree whose peak ({_gib(pick['peak'])} GiB) fits the budget ({where})"
        if pick["ep"] > 1:
            reason += (f" with its all-to-all at most {bound:.0%} of the step" if pick["share_of_step"] is not None
                       else "; its all-to-all is not priced (give --net-gbps or a profile from zaya tune comm)")
    else:
        fitting = [r for r in rows if r["fits"]]
        reason = (f"no degree dividing {mc.num_experts} experts and {hw.gpus} GPUs fits the budget ({where}; the "
                  f"largest, {rows[-1]['ep']}, peaks at {_gib(rows[-1]['peak'])} GiB): use more GPUs, activation "
                  "checkpointing or a smaller micro-batch") if not fitting else (
                  f"degree {fitting[0]['ep']} fits ({where}) but its all-to-all takes "
                  f"{fitting[0]['share_of_step']:.0%} of the step, over the {bound:.0%} bound: a faster fabric, a "
                  "larger micro-batch per exchange or more memory per GPU (degree 1) would serve better")
    if mode == "fsdp":
        reason += ("; under fsdp degree 1 alone is planned: FSDP2 already shards the experts over every rank, so a "
                   "degree saves no memory (it trades their per-block gathers for the all-to-all, not priced here)")
    return {"parallel": mode, "activation_checkpointing": ac, "cp": st.cp, "share_bound": bound, "degrees": rows,
            "recommended": pick["ep"] if pick else None, "reason": reason}


def checkpoint_bytes(sizes: Sizes) -> dict[str, int]:
    """A training checkpoint: fp32 weights and the optimizer state (the loader, RNG and progress are kilobytes)."""
    return {"weights": 4 * sizes.total, "optimizer": 4 * sizes.muon + 8 * sizes.adamw}


def plan(config: Config, hw: Hardware, *, modes: tuple[str, ...] = MODES, ac_options: tuple[bool, ...] = (False, True),
         cp_options: tuple[int, ...] | None = None, last_stage_tokens: int | None = None) -> dict[str, Any]:
    """The whole plan as a JSON-ready dict (``zaya plan --json`` prints it)."""
    from zaya.core.hardware import load_profile

    if hw.gpus < 1:
        raise ConfigError(f"--gpus {hw.gpus}: must be at least 1")
    for name in ("gpu_memory_gib", "tflops"):
        if getattr(hw, name) <= 0:
            raise ConfigError(f"--{name.replace('_gib', '').replace('_', '-')} {getattr(hw, name)}: must be > 0")
    if not 0 < hw.mfu <= 1:
        raise ConfigError(f"--mfu {hw.mfu}: must be a fraction in (0, 1]")
    if not 0 <= hw.headroom < 1:
        raise ConfigError(f"--headroom {hw.headroom}: must be in [0, 1)")
    tc = config.train
    ep = tc.expert_parallel
    if hw.gpus % ep:
        raise ConfigError(f"--gpus {hw.gpus} is not a multiple of train.expert_parallel = {ep}: plan a multiple of "
                          f"{ep} GPUs, or pass --set train.expert_parallel=N with N dividing {hw.gpus}")
    reshard = load_profile(torch.device("cpu")).fsdp_reshard_after_forward
    train_dtype = compute_dtype(tc.dtype, "cuda")  # the GPUs planned for
    compute_bytes = 2 if train_dtype == "bfloat16" else 4
    bits = lambda gbps: gbps * 1e9 / 8  # noqa: E731 - Gbit/s -> bytes/s
    stages = []
    total_seconds = 0.0
    for st in stage_shapes(config, hw.gpus, last_stage_tokens):
        cps = sorted(set(cp_options or (1, st.cp)))
        fpt = train_flops_per_token(config, st.seq_len)
        rows = []
        for cp in cps:
            if hw.gpus % cp or st.seq_len % (2 * cp if cp > 1 else 1):
                continue
            for mode in modes:
                for ac in ac_options:
                    m = memory_plan(config, gpus=hw.gpus, parallel=mode, micro_batch=st.micro_batch,
                                    seq_len=st.seq_len, cp=cp, activation_checkpointing=ac,
                                    reshard_after_forward=reshard, budget_bytes=hw.budget_bytes,
                                    ep=ep if mode != "fsdp" else 1)
                    m["fits"] = m["peak"] <= hw.budget_bytes
                    rows.append(m)
        tokens_per_s = hw.gpus * hw.tflops * 1e12 * hw.mfu / fpt
        seconds = st.tokens / tokens_per_s
        total_seconds += seconds
        step_seconds = st.global_batch_tokens / tokens_per_s
        comm = {}
        sizes = model_sizes(config, hw.gpus)
        for mode in modes:
            parts = comm_bytes_per_step(sizes, mode, hw.gpus, compute_bytes, reshard, hw.gpus_per_node)
            tokens = {}
            if ep > 1 and mode != "fsdp" and hw.gpus > 1:
                tokens["all_to_all_tokens"] = all_to_all_bytes_per_step(
                    config, st.global_batch_tokens / hw.gpus, ep, compute_bytes)
                # An ep group inside a node of a multi-node job sends it over the node's fabric: not a NIC's bytes.
                tokens["all_to_all_over_nic"] = ep > hw.gpus_per_node or hw.gpus <= hw.gpus_per_node
                if tokens["all_to_all_over_nic"]:
                    parts["all_to_all_tokens"] = tokens["all_to_all_tokens"]
            total = sum(parts.values())
            comm[mode] = {"bytes_per_gpu": total, **{k: v for k, v in parts.items()}, **tokens,
                          "seconds": total / bits(hw.net_gbps) if hw.net_gbps else None,
                          "share_of_step": total / bits(hw.net_gbps) / step_seconds if hw.net_gbps else None}
        stages.append({"name": st.name, "seq_len": st.seq_len, "micro_batch": st.micro_batch, "cp": st.cp,
                       "tokens": st.tokens, "tokens_note": st.tokens_note,
                       "global_batch_tokens": st.global_batch_tokens, "train_flops_per_token": fpt,
                       "tokens_per_s": tokens_per_s, "tokens_per_s_with_checkpointing": tokens_per_s * 3 / 4,
                       "seconds": seconds, "step_seconds": step_seconds, "memory": rows, "communication": comm,
                       "expert_parallel": expert_parallel_plan(config, hw, st, step_seconds, reshard)})
    sizes = model_sizes(config, hw.gpus)
    ck = checkpoint_bytes(sizes)
    ck_total = sum(ck.values())
    first = stages[0]
    data_bytes = 2 if config.model.vocab_size <= 65536 else 4
    data_rate = max(s["tokens_per_s"] for s in stages) * data_bytes
    storage = bits(hw.storage_gbps) if hw.storage_gbps else None
    every = config.checkpoint.every
    out = {"config_model": {"params_total": sizes.total, "params_muon": sizes.muon, "params_adamw": sizes.adamw},
           "hardware": {"gpus": hw.gpus, "gpu_memory_gib": hw.gpu_memory_gib, "tflops": hw.tflops,
                        "net_gbps": hw.net_gbps, "storage_gbps": hw.storage_gbps, "gpus_per_node": hw.gpus_per_node,
                        "headroom": hw.headroom, "mfu": hw.mfu, "budget_bytes": hw.budget_bytes,
                        "dtype": train_dtype, "fsdp_reshard_after_forward": reshard,
                        "all_to_all_profile": hw.profile if hw.all_to_all_busbw else None},
           "stages": stages, "total_tokens": sum(s["tokens"] for s in stages), "total_seconds": total_seconds,
           "checkpoint": {**ck, "bytes": ck_total, "write_seconds": ck_total / storage if storage else None,
                          "every_steps": every,
                          "share_of_interval": (ck_total / storage / (every * first["step_seconds"])
                                                if storage and every else None),
                          "exported_bf16_bytes": 2 * sizes.total},
           "data": {"bytes_per_token": data_bytes, "read_bytes_per_s": data_rate,
                    "share_of_storage": data_rate / storage if storage else None}}
    return out


def mfu_from_metrics(path: Path) -> float:
    """The median ``mfu`` of a run's metrics.jsonl train records (skipping the first, which includes warm-up)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--mfu {path}: cannot read it ({exc.strerror or exc})") from exc
    values = [float(record["mfu"]) for _, _, record in parse_records(data, path)
              if isinstance(record.get("mfu"), (int, float)) and record["mfu"] > 0]
    if len(values) < 2:
        raise ConfigError(f"--mfu {path}: no train records with an mfu value (need a metrics.jsonl of a zaya run, "
                          "or give a number such as --mfu 0.35)")
    return statistics.median(values[1:])


# --- the command ---------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FILE", help="TOML config, e.g. configs/zaya1-base.toml")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs in the job (world size)")
    p.add_argument("--gpu-memory", type=float, required=True, metavar="GIB",
                   help="memory of one GPU in GiB (MI300X 192, H100 80, H200 141)")
    p.add_argument("--tflops", type=float, required=True, metavar="X",
                   help="dense bf16 peak of one GPU in TFLOP/s (MI300X 1307, H100/H200 989)")
    p.add_argument("--net-gbps", type=float, metavar="Y", help="network bandwidth per GPU in Gbit/s (ZAYA1: 400)")
    p.add_argument("--storage-gbps", type=float, metavar="Z",
                   help="aggregate storage bandwidth in Gbit/s (checkpoint writes and data reads)")
    p.add_argument("--parallel", choices=MODES, action="append",
                   help="plan only this data-parallel mode (repeatable; default: ddp, zero1 and fsdp)")
    p.add_argument("--activation-checkpointing", choices=("off", "on", "both"), default="both",
                   help="memory without and/or with activation checkpointing (default both)")
    p.add_argument("--context-parallel", metavar="CP[,CP...]",
                   help="context-parallel sizes to plan (default: 1 and each stage's own)")
    p.add_argument("--mfu", default="0.35", metavar="FRACTION|METRICS",
                   help="model FLOPs utilisation: a fraction (default 0.35), or a run's metrics.jsonl to take its "
                        "median measured MFU from")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs per node (default 8)")
    p.add_argument("--headroom", type=float, default=0.10, metavar="FRACTION",
                   help="share of GPU memory kept free for the runtime, fragmentation and collective buffers "
                        "(default 0.10)")
    p.add_argument("--last-stage-tokens", type=float, metavar="N",
                   help="tokens of a last stage with tokens = 0 (default: until train.max_steps)")
    p.add_argument("--hardware-profile", metavar="FILE",
                   help="a hardware profile whose all-to-all curve (written by zaya tune comm) prices the expert "
                        "all-to-all (default: the visible GPU's profile, if it has one; else --net-gbps)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _mfu(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return mfu_from_metrics(Path(text))


def _cp_list(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"--context-parallel {text!r}: give sizes like 1,2") from None
    if not values or min(values) < 1:
        raise ConfigError(f"--context-parallel {text!r}: sizes must be >= 1")
    return values


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}" if abs(n) < 10 * GIB else f"{n / GIB:.1f}"


def report(result: dict[str, Any], config_path: str) -> str:
    hw, model = result["hardware"], result["config_model"]
    lines = [f"zaya plan: {config_path} on {hw['gpus']:,} GPUs ({hw['gpu_memory_gib']:g} GiB, {hw['tflops']:g} "
             f"TFLOP/s, MFU {hw['mfu']:.0%}), {hw['dtype']}; {format_count(model['params_total'])} parameters (Muon "
             f"{format_count(model['params_muon'])}, AdamW {format_count(model['params_adamw'])})",
             f"memory budget per GPU {_gib(hw['budget_bytes'])} GiB ({hw['headroom']:.0%} headroom); fsdp "
             f"reshard_after_forward {hw['fsdp_reshard_after_forward']}"]
    for st in result["stages"]:
        lines += ["", f"stage {st['name']}: {format_count(st['tokens'])} tokens"
                      f"{' (' + st['tokens_note'] + ')' if st['tokens_note'] else ''}, seq {st['seq_len']:,}, "
                      f"micro-batch {st['micro_batch']}, global batch {format_count(st['global_batch_tokens'])} tokens",
                  "  memory per GPU, GiB    weights  grads  optim  activ  fwd+bwd  optim-step   peak  fits  "
                  "max micro-batch"]
        for m in st["memory"]:
            ep = f" ep{m['ep']}" if m.get("ep", 1) > 1 else ""
            label = f"{m['parallel']:5s} cp{m['cp']}{ep} ac {'on ' if m['activation_checkpointing'] else 'off'}"
            lines.append(f"  {label:20s} {_gib(m['weights']):>8s} {_gib(m['gradients']):>6s} "
                         f"{_gib(m['optimizer']):>6s} {_gib(m['activations']):>6s} {_gib(m['forward_backward']):>8s} "
                         f"{_gib(m['optimizer_step']):>11s} {_gib(m['peak']):>6s}  "
                         f"{'yes' if m['fits'] else 'NO ':4s} {m['max_micro_batch']:>5d}")
        lines.append(f"  throughput {st['tokens_per_s']:,.0f} tokens/s ({st['tokens_per_s_with_checkpointing']:,.0f} "
                     f"with activation checkpointing): {format_duration(st['seconds'])}; a step "
                     f"{format_duration(st['step_seconds'])}")
        comm = []
        for mode, c in st["communication"].items():
            if c["seconds"] is not None:
                comm.append(f"{mode} {c['bytes_per_gpu'] / 1e9:.1f} GB ({format_duration(c['seconds'])}, "
                            f"{c['share_of_step']:.0%} of the step)")
            else:
                comm.append(f"{mode} {c['bytes_per_gpu'] / 1e9:.1f} GB")
            if "all_to_all_tokens" in c:
                where = "included" if c["all_to_all_over_nic"] else "over the node's fabric, not included"
                comm[-1] += f" (expert all-to-all {c['all_to_all_tokens'] / 1e9:.1f} GB, {where})"
        if comm:
            lines.append("  sent per GPU per step: " + "; ".join(comm))
        ep = st["expert_parallel"]
        ac = "on" if ep["activation_checkpointing"] else "off"
        lines += [f"  expert parallel ({ep['parallel']} cp{ep['cp']} ac {ac}, micro-batch {st['micro_batch']}):",
                  "    degree  peak GiB  fits  max micro-batch  all-to-all GB       time  share  priced from"]
        for r in ep["degrees"]:
            timed = r["ep"] > 1 and r["all_to_all_seconds"] is not None
            lines.append(f"    {r['ep']:>6d} {_gib(r['peak']):>9s}  {'yes' if r['fits'] else 'NO ':4s} "
                         f"{r['max_micro_batch']:>15d} {r['all_to_all_bytes'] / 1e9:>14.2f} "
                         f"{format_duration(r['all_to_all_seconds']) if timed else '-':>10s} "
                         f"{format(r['share_of_step'], '.0%') if timed else '-':>6s}"
                         + (f"  {r['priced_from']}" if r["ep"] > 1 else ""))
        lines.append(f"  recommended train.expert_parallel = {ep['recommended']}: {ep['reason']}"
                     if ep["recommended"] else f"  no expert-parallel degree recommended: {ep['reason']}")
    ck, data = result["checkpoint"], result["data"]
    line = (f"checkpoint: {ck['bytes'] / 1e9:.1f} GB (weights {ck['weights'] / 1e9:.1f}, optimizer "
            f"{ck['optimizer'] / 1e9:.1f}); exported bf16 weights {ck['exported_bf16_bytes'] / 1e9:.1f} GB")
    if ck["write_seconds"] is not None:
        line += f"; written in {format_duration(ck['write_seconds'])}"
        if ck["share_of_interval"] is not None:
            line += f" ({ck['share_of_interval']:.1%} of the {ck['every_steps']}-step interval if not overlapped)"
    lines += ["", line, f"data: {data['bytes_per_token']} bytes/token, {data['read_bytes_per_s'] / 1e6:.1f} MB/s of "
                        "reads" + (f" ({data['share_of_storage']:.2%} of the storage bandwidth)"
                                   if data["share_of_storage"] is not None else ""),
              f"total: {format_count(result['total_tokens'])} tokens in {format_duration(result['total_seconds'])}"]
    return "\n".join(lines)


def _comm_profile(path: str | None) -> Any:
    """``--hardware-profile``'s file, else the visible GPU's profile, else None."""
    from zaya.core.hardware import load_profile, read_profile

    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"--hardware-profile {path}: no such file (zaya tune comm writes one under "
                              "~/.cache/zaya/hardware/)")
        return read_profile(path)
    return load_profile(torch.device("cuda")) if torch.cuda.is_available() else None


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.set or [])
    profile = _comm_profile(args.hardware_profile)
    curves = profile_all_to_all(profile) if profile is not None else None
    hw = Hardware(gpus=args.gpus, gpu_memory_gib=args.gpu_memory, tflops=args.tflops, net_gbps=args.net_gbps,
                  storage_gbps=args.storage_gbps, gpus_per_node=args.gpus_per_node, headroom=args.headroom,
                  mfu=_mfu(args.mfu), all_to_all_busbw=curves, profile=profile.path if curves else "")
    ac = {"off": (False,), "on": (True,), "both": (False, True)}[args.activation_checkpointing]
    result = plan(config, hw, modes=tuple(args.parallel or MODES), ac_options=ac,
                  cp_options=_cp_list(args.context_parallel),
                  last_stage_tokens=None if args.last_stage_tokens is None else int(args.last_stage_tokens))
    return skeleton.emit(result, args.json, lambda r: report(r, args.config))
