"""Sizes and costs of a model config, computed on the meta device (no weights allocated): ``zaya info``."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from zaya.config import ModelConfig
from zaya.model.zaya import ZayaForCausalLM

BF16_BYTES = 2


def parameter_count(parameters: nn.Module | Iterable[torch.Tensor]) -> int:
    """How many numbers a module (or a list of tensors) holds, each parameter once (a tied one once)."""
    return sum(p.numel() for p in (parameters.parameters() if isinstance(parameters, nn.Module) else parameters))


def forward_flops_per_token(cfg: ModelConfig, context: int) -> dict[str, int]:
    """Forward-pass matmul FLOPs (2 per multiply-add) per token, by part.

    ``context`` is the number of keys a token attends to on average (for causal training at sequence length S,
    about S/2). Elementwise work (norms, activations, softmax, RoPE) is not counted; the CCA convolutions are,
    since the grouped one is a small matmul.
    """
    d, hq, hk, hd = cfg.hidden_size, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    projections = d * hq * hd + 2 * d * hk * hd + hq * hd * d  # q, k, v (both CCA halves together), o
    conv = 0
    if cfg.attention == "cca":
        channels = (hq + hk) * hd
        conv = channels * cfg.cca_depthwise_kernel + channels * (channels // (hq + hk)) * cfg.cca_grouped_kernel
    if cfg.router == "zaya":
        r = cfg.router_hidden_size
        router = d * r + 2 * r * r + r * cfg.num_router_classes
    else:
        router = d * cfg.num_experts
    experts = cfg.top_k * 3 * d * cfg.expert_hidden_size
    per_layer = {
        "attention_projections": 2 * projections,
        "cca_convolutions": 2 * conv,
        "attention_scores": 2 * 2 * hq * hd * context,
        "router": 2 * router,
        "experts": 2 * experts,
    }
    out = {k: v * cfg.num_layers for k, v in per_layer.items()}
    out["lm_head"] = 2 * d * cfg.vocab_size
    return out


def model_info(cfg: ModelConfig) -> dict[str, Any]:
    """Parameter counts, KV-cache size and FLOPs for ``cfg``.

    params_total counts every parameter once (a tied embedding once); params_active is what one token touches:
    everything except the experts it was not routed to (top_k of num_experts are used in each layer).
    """
    with torch.device("meta"):
        model = ZayaForCausalLM(cfg)
    total = parameter_count(model)
    embedding = model.embed.weight.numel()
    lm_head = 0 if model.lm_head is None else model.lm_head.weight.numel()
    per_expert = 3 * cfg.hidden_size * cfg.expert_hidden_size
    unchosen = (cfg.num_experts - cfg.top_k) * per_expert * cfg.num_layers
    active = total - unchosen
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * BF16_BYTES
    fixed_state = 0
    if cfg.attention == "cca":
        channels = (cfg.num_query_heads + cfg.num_kv_heads) * cfg.head_dim
        reach = cfg.cca_depthwise_kernel - 1 + cfg.cca_grouped_kernel - 1
        fixed_state = cfg.num_layers * (channels * reach + cfg.num_kv_heads * cfg.head_dim // 2) * BF16_BYTES
    context = cfg.max_seq_len / 2
    flops = forward_flops_per_token(cfg, context=round(context))
    return {
        "params_total": total,
        "params_embedding": embedding,
        "params_lm_head": lm_head,
        "params_non_embedding": total - embedding - lm_head,
        "params_active": active,
        "params_active_non_embedding": active - embedding - lm_head,
        "params_per_expert": per_expert,
        "kv_cache_bytes_per_token": kv_per_token,
        "decode_fixed_state_bytes_per_sequence": fixed_state,
        "flops_per_token": sum(flops.values()),
        "flops_per_token_breakdown": flops,
        "flops_context_tokens": round(context),
        "train_flops_per_token": 3 * sum(flops.values()),
    }
