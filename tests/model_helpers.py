"""The one tiny-model factory of the tests: a small ZAYA1 config whose shapes a test changes through overrides, the
model built under a fixed seed (so results never depend on test order), and ``perturb``, which moves a model away
from its init so that wiring mistakes show."""

from __future__ import annotations

import torch

from zaya.config import ModelConfig
from zaya.model import ZayaForCausalLM

TINY = dict(vocab_size=97, hidden_size=48, num_layers=3, num_query_heads=4, num_kv_heads=2, head_dim=16,
            num_experts=4, top_k=1, expert_hidden_size=32, router_hidden_size=16, max_seq_len=64)

# The model variants every decoding and gradient test runs over.
MODEL_VARIANTS = [
    dict(),
    dict(top_k=2, num_experts=5),
    dict(attention="gqa", router="linear"),
    dict(attention="mha", num_kv_heads=4, router_eda=False, router_skip_expert=False),
    dict(residual_fp32=False, tie_embeddings=False),
]


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def tiny_model(seed: int = 0, **overrides) -> ZayaForCausalLM:
    """``tiny_config(**overrides)``'s model, initialised after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return ZayaForCausalLM(tiny_config(**overrides))


@torch.no_grad()
def perturb(module: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> None:
    """Move every parameter and float buffer away from its init so that wiring mistakes show."""
    g = torch.Generator().manual_seed(seed)
    for name, p in list(module.named_parameters()) + list(module.named_buffers()):
        if not p.is_floating_point() or name.endswith("inv_freq") or "balance_" in name:
            continue
        noise = torch.randn(p.shape, generator=g) * scale
        if name.endswith(("scale", "weight")) and p.dim() == 1 or name.endswith("temperature"):
            p.copy_(1.0 + noise)
        elif name.endswith("balancing_biases"):
            p.copy_(noise * 0.3)
        else:
            p.add_(noise * p.abs().mean().clamp_min(0.02))
