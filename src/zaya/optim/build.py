"""Building the optimizers: which parameter goes to Muon and which to AdamW.

ZAYA1's split: Muon for the hidden weight matrices, the stacked 3-D expert weights included (each expert's matrix
orthogonalised on its own); AdamW for the embedding (tied to the head), convolutions, norms, biases, residual
scales and temperatures. The router's bias-balancing state is not a parameter: it has its own update
(``zaya.model.update_balancing_biases``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zaya.core.device import to_dtype
from zaya.core.hardware import compute_dtype
from zaya.config import OptimConfig


@dataclass
class ParamSplit:
    muon: list[tuple[str, nn.Parameter]]
    adamw_decay: list[tuple[str, nn.Parameter]]
    adamw_no_decay: list[tuple[str, nn.Parameter]]
    muon_shards: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    """Expert shards under expert parallelism (different on every rank of an ep group): a Muon of their own, whose
    work splits over the ranks that hold the same shards (``shard_group``), never over the others."""


def is_muon_matrix(name: str, param: torch.Tensor, embedding_ids: set[int]) -> bool:
    """2-D hidden matrices and stacked [E, out, in] expert weights; never embeddings or convolutions."""
    if id(param) in embedding_ids:
        return False
    if param.ndim == 2:
        return True
    return param.ndim == 3 and ".experts." in f".{name}"


def split_parameters(model: nn.Module, use_muon: bool = True) -> ParamSplit:
    """Partition trainable parameters (named, in model order) into the three optimizer groups."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    split = ParamSplit([], [], [])
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if use_muon and is_muon_matrix(name, p, embedding_ids):
            split.muon.append((name, p))
        elif p.ndim >= 2 and id(p) not in embedding_ids:
            split.adamw_decay.append((name, p))
        else:
            split.adamw_no_decay.append((name, p))
    return split


def build_optimizers(params: ParamSplit, cfg: OptimConfig, replica_group: Any = None,
                     shard_group: Any = None) -> list[torch.optim.Optimizer]:
    """[Muon, Muon of the expert shards, AdamW] (each omitted when it has nothing to do); each group's ``lr`` is
    its peak.

    ``replica_group``: the process group over which every rank holds these same parameters (DDP's data-parallel
    group), or None (one process, ZeRO-1's per-rank subsets, FSDP). With ``optim.muon_distributed = "auto"``
    Muon splits its Newton-Schulz work over that group and shares the results; FSDP's DTensor parameters it
    splits over their mesh by itself. ``shard_group``: the replica group of the expert shards (``muon_shards``), or
    None where no other rank holds the same shards. Nothing here is collective.
    """
    from zaya.optim.muon import Muon

    optimizers: list[torch.optim.Optimizer] = []
    for muon_params, group in ((params.muon, replica_group), (params.muon_shards, shard_group)):
        if muon_params:
            optimizers.append(Muon(
                [p for _, p in muon_params], lr=cfg.muon_lr or cfg.lr, weight_decay=cfg.weight_decay,
                momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                adjust_lr_fn=cfg.muon_adjust_lr,
                ns_dtype=to_dtype(compute_dtype(cfg.muon_ns_dtype, muon_params[0][1].device)),
                ns_method=cfg.muon_ns_method, distributed=cfg.muon_distributed, replica_group=group))
    groups = []
    if params.adamw_decay:
        groups.append({"params": [p for _, p in params.adamw_decay], "weight_decay": cfg.weight_decay})
    if params.adamw_no_decay:
        groups.append({"params": [p for _, p in params.adamw_no_decay], "weight_decay": 0.0})
    if groups:
        optimizers.append(torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                            fused=_fused_adamw_supported(groups) or None))
    return optimizers


def _fused_adamw_supported(groups: list[dict[str, Any]]) -> bool:
    """Whether torch's fused AdamW takes every parameter: floating-point, on the CPU or a CUDA/ROCm GPU.

    Fused is the default where it applies, for two reasons: it keeps the step counter on the parameters' device
    (the default foreach AdamW keeps it on the host and reads it back every step), and it is the fastest (3-5x
    foreach on the dev CPU: benchmarks/results.md, "Training step"). FSDP2's DTensor parameters are supported too.
    """
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
