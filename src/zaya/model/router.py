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
global token counts of that step, and the biases move on the device, without a collective and without reading
anything back to the host. ``model.router_balancing`` picks the rule:

* "adaptive" (zaya's default): with the relative load error r_e = E * f_e - 1, each expert's bias moves by
  -s_e * clamp(r_e, -1, 1), and its step s_e halves when r_e changes sign from the previous step and grows by 1.2x
  while it keeps it, within [router_balance_step_min, router_balance_step_max] (the step-size rule of Rprop). Why:
  the biases are added to probabilities that are nearly uniform early in training, so how much load a bias change
  moves (the loop's gain) varies by orders of magnitude over a run and between layers; a fixed-size step
  overshoots wherever the gain is high and the choice flips wholesale from one expert to the next every step. A
  sign change is the mark of an overshoot whatever the gain, so halving on it settles every layer, and the
  error-scaled step leaves a balanced layer almost still. Measured in docs/model.md and benchmarks/results.md.
* "adamw": the published ports' rule, g_e = f_e - 1/E fed to an AdamW-style update with router_balance_lr (each
  step moves every bias by about the learning rate, whatever the error): for continue-training released
  checkpoints exactly as they were trained.
* "none": the biases stay as they are (for a router balanced by an auxiliary loss instead).
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
    probs: torch.Tensor
    """[..., classes] the router's fp32 probabilities (for the auxiliary loss and the routing probe)."""


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
        self._step_init = cfg.router_balance_step
        self.register_buffer("balance_step_size", torch.full((cfg.num_experts,), cfg.router_balance_step))
        self.register_buffer("balance_last_error", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.reset_balancing()

    @torch.no_grad()
    def reset_balancing(self) -> None:
        self.balancing_biases.zero_()
        if self.num_classes > self.num_experts:
            self.balancing_biases[self.num_experts:] = self._skip_bias_init
        self.balance_exp_avg.zero_()
        self.balance_exp_avg_sq.zero_()
        self.balance_step.zero_()
        self.balance_step_size.fill_(self._step_init)
        self.balance_last_error.zero_()

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
        return Routing(experts=experts, weights=weights, latent=latent, probs=probs)

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
        return Routing(experts=experts, weights=weights, latent=None, probs=probs)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.proj.weight, std=self._std)
        self.reset_balancing()


def build_router(cfg: ModelConfig, layer_index: int) -> nn.Module:
    if cfg.router == "zaya":
        return ZayaRouter(cfg, use_eda=cfg.router_eda and layer_index > 0)
    return LinearRouter(cfg)


BALANCING_STATE = ("balance_exp_avg", "balance_exp_avg_sq", "balance_step", "balance_step_size",
                   "balance_last_error")
"""The routers' balancing-rule state: zaya's own (the Hugging Face layout holds only the biases)."""


def initial_balancing_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The values of ``BALANCING_STATE`` in a freshly built router (what an import from another layout starts from)."""
    fresh = _BalancedTopK(cfg, cfg.num_router_classes)
    return {name: getattr(fresh, name) for name in BALANCING_STATE}


def routers_of(model: nn.Module) -> list[nn.Module]:
    """The model's routers (either kind) in layer order."""
    return [m for m in model.modules() if isinstance(m, _BalancedTopK)]


STEP_GROWTH = 1.2
"""Adaptive balancing: an expert's step grows by this factor while its load error keeps its sign (Rprop's value)."""
STEP_SHRINK = 0.5
"""Adaptive balancing: an expert's step shrinks by this factor when its load error changes sign."""


@torch.no_grad()
def update_balancing_biases(model: nn.Module, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """One balancing step of every router's biases by the rule ``model.router_balancing``; call once per optimizer
    step.

    ``tokens_per_expert`` [num_moe_layers, classes] holds the step's GLOBAL counts: summed over micro-batches and,
    under data parallelism, over ranks by the caller (the trainer reduces them once, for its metrics too), so f_e
    is the fraction of the global batch. This function runs no collective and reads nothing back to the host; a
    layer whose experts got no tokens is left as it is (``torch.where``: neither its biases nor its state move).
    f_e is taken over the real experts (skip tokens excluded); the skip class's bias is never changed.

    Returns the per-layer load imbalance max_e f_e * E (1.0 = balanced) as a float32 tensor [num_moe_layers] on the
    biases' device, NaN for a layer with no routed tokens.
    """
    routers = routers_of(model)
    if tokens_per_expert.shape[0] != len(routers):
        raise ValueError(f"tokens_per_expert has {tokens_per_expert.shape[0]} rows but the model has "
                         f"{len(routers)} routers")
    cfg = model.config
    rule = {"adaptive": _adaptive_step, "adamw": _adamw_step, "none": None}[cfg.router_balancing]  # validated
    counts = tokens_per_expert.detach().to(device=routers[0].balancing_biases.device, dtype=torch.float64)
    imbalance = []
    for router, layer_counts in zip(routers, counts):
        e = router.num_experts
        real = layer_counts[:e]
        total = real.sum()
        routed = total > 0
        fraction = real / total  # NaN where nothing was routed; every use below is masked by ``routed``
        imbalance.append(fraction.max() * e)
        if rule is not None:
            rule(router, fraction, routed, cfg)
    return torch.stack(imbalance).float()


def _adaptive_step(router: "_BalancedTopK", fraction: torch.Tensor, routed: torch.Tensor, cfg: ModelConfig) -> None:
    """zaya's rule (module docstring): an error-scaled step whose size halves on a sign change of the error."""
    error = (fraction * router.num_experts - 1.0).float()
    agreement = error * router.balance_last_error
    factor = torch.where(agreement < 0, STEP_SHRINK, torch.where(agreement > 0, STEP_GROWTH, 1.0))
    step_size = (router.balance_step_size * factor).clamp_(cfg.router_balance_step_min, cfg.router_balance_step_max)
    biases = router.balancing_biases[:router.num_experts]
    biases.copy_(torch.where(routed, biases - step_size * error.clamp(-1.0, 1.0), biases))
    router.balance_step_size.copy_(torch.where(routed, step_size, router.balance_step_size))
    router.balance_last_error.copy_(torch.where(routed, error, router.balance_last_error))


def _adamw_step(router: "_BalancedTopK", fraction: torch.Tensor, routed: torch.Tensor, cfg: ModelConfig) -> None:
    """The published ports' rule: g_e = f_e - 1/E as the gradient of an AdamW-style step,
    b_e <- b_e - lr * m_hat / (sqrt(v_hat) + eps), with the model config's ``router_balance_*``."""
    beta1, beta2 = cfg.router_balance_betas
    g = (fraction - 1.0 / router.num_experts).float()
    step = router.balance_step + 1
    exp_avg = router.balance_exp_avg.mul(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq = router.balance_exp_avg_sq.mul(beta2).addcmul_(g, g, value=1 - beta2)
    # The bias corrections in float64 from the fp32 step counter, then rounded to fp32: the values the old
    # host-side ``1 - beta ** float(step)`` gave (a Python float divisor is applied in the tensor's dtype).
    step64 = step.double()
    m_hat = exp_avg / (1 - torch.pow(beta1, step64)).float()
    v_hat = exp_avg_sq / (1 - torch.pow(beta2, step64)).float()
    biases = router.balancing_biases[:router.num_experts]
    new_biases = biases - cfg.router_balance_lr * m_hat / (v_hat.sqrt() + cfg.router_balance_eps)
    biases.copy_(torch.where(routed, new_biases, biases))
    router.balance_exp_avg.copy_(torch.where(routed, exp_avg, router.balance_exp_avg))
    router.balance_exp_avg_sq.copy_(torch.where(routed, exp_avg_sq, router.balance_exp_avg_sq))
    router.balance_step.copy_(torch.where(routed, step, router.balance_step))
