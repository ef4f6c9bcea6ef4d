"""Attention: CCA / CCGQA as in ZAYA1, plus plain GQA and MHA baselines for ablations.

CCA (Compressed Convolutional Attention, arXiv 2510.04476) as ZAYA1 uses it, per layer:

1. q = W_q h, k = W_k h (no bias); the value comes from two half-width projections, one of the current token and
   one of the previous token (the "value shift"): v = [W_v1 h_t ; W_v2 h_{t-1}], a split of the value CHANNELS
   (``cca_value``): the first num_kv_heads*head_dim/2 channels, in head-major order, see the current token and the
   rest the previous one. With an even number of KV heads that is the first half of the heads against the second;
   with an odd number the middle head takes its first head_dim/2 channels from the current token and the rest from
   the previous one. This is what ``transformers``' ``ZayaCCAProjection`` does, so any KV head count works.
2. q-k mean: qm_q = (q + repeat(k)) / 2 per query head, qm_k = mean of qm_q over each GQA group.
3. Two causal convolutions over the packed [q; k] channels: a depthwise one along time, then a grouped one (one
   group per head) mixing channels within a head across time. q = conv_q + qm_q, k = conv_k + qm_k.
4. QK-norm to length sqrt(head_dim), keys times a learned per-KV-head temperature; partial RoPE; causal softmax
   attention with scale 1/sqrt(head_dim) through ``F.scaled_dot_product_attention``; output projection.

Padding tokens are zeroed before the projections so that they reach neither the convolutions nor the value shift.
For decoding, ``AttentionCache`` holds the KV cache plus the convolution state (the last raw q/k positions) and the
previous token's delayed value projection, so step-by-step decoding reproduces the full forward pass exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zaya.config import ModelConfig
from zaya.model.layers import apply_rotary


@dataclass
class AttentionCache:
    """Decode state of one attention layer. KV buffers are preallocated to ``capacity`` positions."""

    keys: torch.Tensor
    """[B, kv_heads, capacity, head_dim], post-norm, post-RoPE keys."""
    values: torch.Tensor
    """[B, kv_heads, capacity, head_dim]."""
    conv_state: torch.Tensor | None = None
    """CCA: [B, q+k channels, conv reach] raw q/k projections of the last positions (zeros before the start)."""
    value_state: torch.Tensor | None = None
    """CCA: [B, kv_heads*head_dim/2] delayed value projection of the last token (zeros before the start)."""


def _scaled_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        causal: bool) -> torch.Tensor:
    """Softmax attention with GQA broadcasting; ``q`` [B,Hq,T,D], ``k``/``v`` [B,Hkv,S,D].

    SDPA's native GQA (``enable_gqa``, torch >= 2.5) on every device: the same result as repeating k/v per query
    group, without the copies and their backward sums (SDPA picks a kernel that takes it; flash attention does)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])


def cca_value(v_current: torch.Tensor, v_previous: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The CCA value heads [B, T, Hkv, D] from the current token's and the previous token's half-width projections
    (each [B, T, Hkv*D/2]).

    The split is over channels, not heads: the two halves are concatenated, then viewed as heads, as
    ``transformers``' ``ZayaCCAProjection`` does. For an even head count this equals giving the first half of the heads
    the current token (so checkpoints made that way load unchanged); for an odd one (1, 3, ...) the middle head
    straddles the two halves, which a split by heads could not express."""
    b, t, _ = v_current.shape
    return torch.cat((v_current, v_previous), dim=-1).view(b, t, num_kv_heads, head_dim)


class Attention(nn.Module):
    """CCA (``attention = "cca"``) or a plain GQA/MHA baseline (``"gqa"``/``"mha"``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.attention
        self.num_query_heads = cfg.num_query_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_width = cfg.num_query_heads * cfg.head_dim
        kv_width = cfg.num_kv_heads * cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, q_width, bias=False)
        self.k_proj = nn.Linear(d, kv_width, bias=False)
        if self.kind == "cca":
            self.v_current_proj = nn.Linear(d, kv_width // 2, bias=False)
            self.v_previous_proj = nn.Linear(d, kv_width // 2, bias=False)
            channels = q_width + kv_width
            self.conv_reach = (cfg.cca_depthwise_kernel - 1) + (cfg.cca_grouped_kernel - 1)
            self.conv_depthwise = nn.Conv1d(channels, channels, cfg.cca_depthwise_kernel, groups=channels)
            self.conv_grouped = nn.Conv1d(channels, channels, cfg.cca_grouped_kernel,
                                          groups=cfg.num_query_heads + cfg.num_kv_heads)
            self.temperature = nn.Parameter(torch.full((cfg.num_kv_heads,), cfg.qk_temperature_init))
            self._temperature_init = cfg.qk_temperature_init
        else:
            self.v_proj = nn.Linear(d, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, d, bias=False)

    # ----------------------------------------------------------------------------------------------- projections
    def _cca_qkv(self, x: torch.Tensor, cache: AttentionCache | None) -> tuple[torch.Tensor, ...]:
        b, t, _ = x.shape
        hq, hk, hd = self.num_query_heads, self.num_kv_heads, self.head_dim
        # One GEMM for the four projections (one cast of x under autocast, one input gradient); the q and k
        # columns come out side by side, which is the packed [q; k] layout the convolutions take.
        qw, kw = hq * hd, hk * hd
        vw = self.v_current_proj.out_features
        proj = F.linear(x, torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_current_proj.weight,
                                      self.v_previous_proj.weight)))
        # split, not slicing: its backward concatenates the pieces' gradients instead of zero-filling a full-width
        # gradient per slice.
        qk, v_current, v_delayed = proj.split((qw + kw, vw, vw), dim=-1)
        q, k = qk.split((qw, kw), dim=-1)

        # q-k mean: every query head is paired with its KV head; keys take the mean over their query group.
        # (Broadcasting k over its group gives the same sums as materialising the repeat, without the copy.)
        q_mean = (q.view(b, t, hk, hq // hk, hd) + k.view(b, t, hk, 1, hd)) * 0.5  # [B, T, Hkv, group, D]
        k_mean = q_mean.mean(dim=3)
        q_mean = q_mean.view(b, t, hq, hd)

        packed = qk.transpose(1, 2)  # [B, C, T]: q then k channels
        if cache is not None:
            history = cache.conv_state.to(packed.dtype)
        else:
            history = packed.new_zeros(b, packed.shape[1], self.conv_reach)
        packed = torch.cat((history, packed), dim=-1)
        if cache is not None:
            cache.conv_state = packed[..., packed.shape[-1] - self.conv_reach:].detach().clone()
        mixed_q, mixed_k = self.conv_grouped(self.conv_depthwise(packed)).transpose(1, 2).split((qw, kw), dim=-1)
        q = mixed_q.view(b, t, hq, hd) + q_mean
        k = mixed_k.view(b, t, hk, hd) + k_mean

        if cache is not None:
            first = cache.value_state.to(v_delayed.dtype)[:, None]
            cache.value_state = v_delayed[:, -1].detach().clone()
        else:
            first = v_delayed.new_zeros(b, 1, v_delayed.shape[-1])
        v = cca_value(v_current, torch.cat((first, v_delayed[:, :-1]), dim=1), hk, hd)

        # QK-norm to length sqrt(d); the per-KV-head temperature scales the keys. Under CUDA autocast the norm runs in
        # fp32 and so would the products; cast back to the compute dtype q and k had, so that RoPE, the cache and
        # SDPA (flash attention) see bf16 (a no-op on CPU, whose autocast keeps the norm in bf16).
        eps = torch.finfo(q.dtype).eps
        scale = hd**0.5
        dtype = q.dtype
        q = (q * (scale / q.norm(dim=-1, keepdim=True).clamp_min(eps))).to(dtype)
        k = (k * (scale / k.norm(dim=-1, keepdim=True).clamp_min(eps)) * self.temperature.to(dtype)[:, None]).to(dtype)
        return q, k, v

    def _plain_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, _ = x.shape
        qw, kw = self.num_query_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))).split(
            (qw, kw, kw), dim=-1)
        return (q.view(b, t, self.num_query_heads, self.head_dim), k.view(b, t, self.num_kv_heads, self.head_dim),
                v.view(b, t, self.num_kv_heads, self.head_dim))

    # ----------------------------------------------------------------------------------------------- forward
    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        cache: AttentionCache | None = None,
        cache_start: int = 0,
    ) -> torch.Tensor:
        """Attend over ``x`` [B, T, D].

        token_mask: [B, T] bool, False at padding (zeroed before the CCA projections), or None.
        attn_mask: [B, 1, T, S] bool (True = may attend), or None for plain causal attention over ``x`` (with no
            cache) or over everything cached (single-token decode).
        cache: decode state; this call's keys/values are written at ``cache_start`` and attention covers
            ``[0, cache_start + T)``.
        """
        if token_mask is not None and self.kind == "cca":
            x = x * token_mask[..., None].to(x.dtype)
        if self.kind == "cca":
            q, k, v = self._cca_qkv(x, cache)
        else:
            q, k, v = self._plain_qkv(x)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        causal = cache is None
        if cache is not None:
            end = cache_start + x.shape[1]
            cache.keys[:, :, cache_start:end] = k.to(cache.keys.dtype)
            cache.values[:, :, cache_start:end] = v.to(cache.values.dtype)
            k = cache.keys[:, :, :end].to(q.dtype)
            v = cache.values[:, :, :end].to(q.dtype)
            if attn_mask is None and x.shape[1] > 1:
                raise ValueError("multi-token forward with a cache needs an explicit attn_mask")
        out = _scaled_dot_product(q, k, v, attn_mask, causal)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> AttentionCache:
        """Empty decode state for ``batch`` sequences of up to ``capacity`` tokens."""
        shape = (batch, self.num_kv_heads, capacity, self.head_dim)
        cache = AttentionCache(keys=torch.zeros(shape, dtype=dtype, device=device),
                               values=torch.zeros(shape, dtype=dtype, device=device))
        if self.kind == "cca":
            channels = self.conv_depthwise.in_channels
            cache.conv_state = torch.zeros(batch, channels, self.conv_reach, dtype=dtype, device=device)
            cache.value_state = torch.zeros(batch, self.v_previous_proj.out_features, dtype=dtype, device=device)
        return cache

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        """ZAYA init: normal(std) projections, normal(out_std) output projection, default conv init."""
        for lin in (self.q_proj, self.k_proj, getattr(self, "v_proj", None), getattr(self, "v_current_proj", None),
                    getattr(self, "v_previous_proj", None)):
            if lin is not None:
                nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=out_std)
        if self.kind == "cca":
            self.conv_depthwise.reset_parameters()
            self.conv_grouped.reset_parameters()
            self.temperature.fill_(self._temperature_init)
