"""Routers: the ZAYA1 router and a plain linear top-k baseline, plus the bias-balancing update.

ZAYA1 router, per MoE layer (see docs/model.md):

1. r = W_down h + b (hidden -> router latent).
2. Exponential depth averaging (EDA): r = r + gamma * r_prev, r_prev being the previous MoE layer's r (after its
   own EDA, before its norm); off on the first MoE layer.
3. p = softmax(MLP(RMSNorm(r))) in fp32, MLP = Linear+GELU, Linear+GELU, Linear(no bias) to E (+1 skip) classes.
4. Choice: top-k of p.detach() + b_bal. The balancing bias only steers the choice; the mixing weight is the
   unbiased probability of the chosen class (not renormalised).
5. Skip class (optional, as in the released checkpoints): a token routed to class E gets a zero MoE output and no
   expert compute. This follows the Hugging Face ``transformers`` port, which zeroes it; other ports pass the
   token through scaled by p. The paper does not describe it.

Balancing (no auxiliary loss): after each optimizer step the trainer calls ``update_balancing_biases`` with the
global token counts of that step; g_e = f_e - 1/E is treated as the gradient of b_bal and fed to an AdamW-style
update, on the device, without a collective and without reading anything back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zaya.config import ModelConfig
from zaya.model.layers import RMSNorm


@dataclass
class Routing:
    """A router's decision for N tokens."""

    experts: torch.Tensor
    """[N, k] chosen class per slot (values == num_experts mean "skip")."""
    weights: torch.Tensor
    """[N, k] mixing weights (unbiased router probabilities; 0 for skip)."""
    latent: torch.Tensor | None
    """ZAYA router latent after EDA, handed to the next MoE layer; None for the linear router."""


class _BalancedTopK(nn.Module):
    """Shared part of both routers: balancing biases (a buffer, not a parameter) and their AdamW-style state."""

    def __init__(self, cfg: ModelConfig, num_classes: int) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.num_classes = num_classes
        self.top_k = cfg.top_k
        self._skip_bias_init = cfg.router_skip_bias_init
        self.register_buffer("balancing_biases", torch.zeros(num_classes, dtype=torch.float32))
        self.register_buffer("balance_exp_avg", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.register_buffer("balance_exp_avg_sq", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.register_buffer("balance_step", torch.zeros((), dtype=torch.float32))
        self.reset_balancing()

    @torch.no_grad()
    def reset_balancing(self) -> None:
        self.balancing_biases.zero_()
        if self.num_classes > self.num_experts:
            self.balancing_biases[self.num_experts:] = self._skip_bias_init
        self.balance_exp_avg.zero_()
        self.balance_exp_avg_sq.zero_()
        self.balance_step.zero_()

    def choose(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of probabilities plus balancing biases; returns (classes, unbiased weights), skip weight 0."""
        biased = probs.detach().float() + self.balancing_biases
        _, experts = torch.topk(biased, self.top_k, dim=-1)
        weights = probs.gather(-1, experts)
        if self.num_classes > self.num_experts:
            weights = weights.masked_fill(experts >= self.num_experts, 0.0)
        return experts, weights


class ZayaRouter(_BalancedTopK):
    """The ZAYA1 router: down-projection, EDA, RMSNorm + 3-layer MLP, fp32 softmax, biased top-k."""

    def __init__(self, cfg: ModelConfig, use_eda: bool) -> None:
        super().__init__(cfg, cfg.num_router_classes)
        r = cfg.router_hidden_size
        self.down_proj = nn.Linear(cfg.hidden_size, r, bias=True)
        self.use_eda = use_eda
        if use_eda:
            self.eda_scale = nn.Parameter(torch.ones(r))
        self.norm = RMSNorm(r, eps=cfg.norm_eps)
        self.fc1 = nn.Linear(r, r, bias=True)
        self.fc2 = nn.Linear(r, r, bias=True)
        self.out_proj = nn.Linear(r, self.num_classes, bias=False)
        self._std = cfg.init_std

    def forward(self, h: torch.Tensor, prev_latent: torch.Tensor | None) -> Routing:
        latent = self.down_proj(h)
        if self.use_eda and prev_latent is not None:
            latent = latent + prev_latent * self.eda_scale
        z = F.gelu(self.fc1(self.norm(latent)))
        z = F.gelu(self.fc2(z))
        logits = self.out_proj(z)
        probs = torch.softmax(logits.float(), dim=-1)
        experts, weights = self.choose(probs)
        return Routing(experts=experts, weights=weights, latent=latent)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for lin in (self.down_proj, self.fc1, self.fc2, self.out_proj):
            nn.init.normal_(lin.weight, std=self._std)
            if lin.bias is not None:
                lin.bias.zero_()
        if self.use_eda:
            self.eda_scale.fill_(1.0)
        self.norm.weight.fill_(1.0)
        self.reset_balancing()


class LinearRouter(_BalancedTopK):
    """Baseline: one linear layer to E logits, fp32 softmax, biased top-k. No EDA, no skip class."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, cfg.num_experts)
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self._std = cfg.init_std

    def forward(self, h: torch.Tensor, prev_latent: torch.Tensor | None) -> Routing:
        probs = torch.softmax(self.proj(h).float(), dim=-1)
        experts, weights = self.choose(probs)
        return Routing(experts=experts, weights=weights, latent=None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.proj.weight, std=self._std)
        self.reset_balancing()


def build_router(cfg: ModelConfig, layer_index: int) -> nn.Module:
    if cfg.router == "zaya":
        return ZayaRouter(cfg, use_eda=cfg.router_eda and layer_index > 0)
    return LinearRouter(cfg)


@torch.no_grad()
def update_balancing_biases(
    model: nn.Module,
    tokens_per_expert: torch.Tensor,
    lr: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """One AdamW-style step of every router's balancing biases; call once per optimizer step.

    ``tokens_per_expert`` [num_moe_layers, classes] holds the step's GLOBAL counts: summed over micro-batches and,
    under data parallelism, over ranks by the caller (the trainer reduces them once, for its metrics too), so f_e
    is the fraction of the global batch. This function runs no collective and reads nothing back to the host: the
    Adam bias corrections are computed from the step counter on the device, and a layer whose experts got no
    tokens is left as it is (``torch.where``; neither its biases, its moments nor its step move).

    f_e is taken over the real experts (skip tokens excluded), g_e = f_e - 1/E, and
    b_e <- b_e - lr * m_hat / (sqrt(v_hat) + eps). The skip class's bias is left as it is. lr/betas/eps default to
    the model config's ``router_balance_*``. Returns the per-layer load imbalance max_e f_e * E (1.0 = balanced) as
    a float32 tensor [num_moe_layers] on the biases' device, NaN for a layer with no routed tokens.
    """
    routers = [m for m in model.modules() if isinstance(m, _BalancedTopK)]
    if tokens_per_expert.shape[0] != len(routers):
        raise ValueError(f"tokens_per_expert has {tokens_per_expert.shape[0]} rows but the model has "
                         f"{len(routers)} routers")
    counts = tokens_per_expert.detach().to(device=routers[0].balancing_biases.device, dtype=torch.float64)
    cfg = getattr(model, "config", None)
    lr = lr if lr is not None else cfg.router_balance_lr
    beta1, beta2 = betas if betas is not None else cfg.router_balance_betas
    eps = eps if eps is not None else cfg.router_balance_eps
    imbalance = []
    for router, layer_counts in zip(routers, counts):
        e = router.num_experts
        real = layer_counts[:e]
        total = real.sum()
        routed = total > 0
        f = real / total  # NaN where nothing was routed; every use below is masked by ``routed``
        imbalance.append(f.max() * e)
        g = (f - 1.0 / e).float()
        step = router.balance_step + 1
        exp_avg = router.balance_exp_avg.mul(beta1).add_(g, alpha=1 - beta1)
        exp_avg_sq = router.balance_exp_avg_sq.mul(beta2).addcmul_(g, g, value=1 - beta2)
        # The bias corrections in float64 from the fp32 step counter, then rounded to fp32: the values the old
        # host-side ``1 - beta ** float(step)`` gave (a Python float divisor is applied in the tensor's dtype).
        step64 = step.double()
        m_hat = exp_avg / (1 - torch.pow(beta1, step64)).float()
        v_hat = exp_avg_sq / (1 - torch.pow(beta2, step64)).float()
        biases = router.balancing_biases[:e]
        new_biases = biases - lr * m_hat / (v_hat.sqrt() + eps)
        biases.copy_(torch.where(routed, new_biases, biases))
        router.balance_exp_avg.copy_(torch.where(routed, exp_avg, router.balance_exp_avg))
        router.balance_exp_avg_sq.copy_(torch.where(routed, exp_avg_sq, router.balance_exp_avg_sq))
        router.balance_step.copy_(torch.where(routed, step, router.balance_step))
    return torch.stack(imbalance).float()
