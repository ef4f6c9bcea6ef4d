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

**The sequence seam.** What an attention layer needs from outside its own tokens goes through a ``SequenceSeam``:
the global index of each local token (RoPE and document masks use it), the CCA boundary (the raw q/k rows and the
delayed value just before the local tokens) and the attention over keys that may live elsewhere. ``LocalSequence``,
the default, has the whole sequence in the call. Context parallelism (``zaya.distributed.context_parallel``) installs one
that exchanges the boundary and the keys with the other ranks; this package never imports the distributed one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from zaya.config import ModelConfig
from zaya.model.layers import apply_rotary


class _GradientInWeightStrides(torch.autograd.Function):
    """Identity whose backward lays the gradient out with the weight's own strides.

    A channels-last convolution hands its weight a channels-last gradient; after the height-1 ``unsqueeze`` that
    is a gradient laid out unlike the 3-D weight (even a size-1 dimension's stride differs). AccumulateGrad would
    re-lay it out, but DDP's reducer reads the raw gradient, compares strides exactly, warns "Grad strides do not
    match bucket view strides" and copies it every step. Copying the small [C, C/g, K] weight gradient here, only
    when its strides differ, is the copy the reducer would otherwise make. Under ``torch.compile`` the copy is
    made always: the strides seen while tracing need not be the compiled backward's (in a compiled block the
    depthwise weight's raw gradient came out [K, 1, 1]-strided past the test), and inductor fuses the copy."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        ctx.stride = weight.stride()
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if grad.stride() == ctx.stride and not torch.compiler.is_compiling():
            return grad
        return torch.empty_strided(grad.shape, ctx.stride, dtype=grad.dtype, device=grad.device).copy_(grad)


@dataclass
class AttentionCache:
    """Decode state of one attention layer: KV buffers preallocated to ``capacity`` positions, or ``pages``."""

    keys: torch.Tensor | None
    """[B, kv_heads, capacity, head_dim], post-norm, post-RoPE keys (None when ``pages`` holds them)."""
    values: torch.Tensor | None
    """[B, kv_heads, capacity, head_dim] (None when ``pages`` holds them)."""
    conv_state: torch.Tensor | None = None
    """CCA: [B, q+k channels, conv reach] raw q/k projections of the last positions (zeros before the start)."""
    value_state: torch.Tensor | None = None
    """CCA: [B, kv_heads*head_dim/2] delayed value projection of the last token (zeros before the start)."""
    shard: KeyShard | None = None
    """Set when this process holds only a part of the sequence's cached keys (tree-attention decoding,
    ``zaya.serve.tree``): the shard appends and attends in place of the local cache path."""
    pages: KeyPages | None = None
    """Set when the keys and values live in fixed-size blocks shared by many sequences (``zaya.model.slots``)."""


class KeyShard(Protocol):
    """Attention over a decode cache whose keys are spread over several processes.

    ``attend`` gets the new tokens' post-RoPE queries [B, Hq, T, D] and keys/values [B, Hkv, T, D], this layer's
    cache and the position the model's decode state would write them at; it stores what this process keeps and
    returns the attention output [B, Hq, T, D] over every process's keys, the same on every process."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: AttentionCache,
               cache_start: int) -> torch.Tensor: ...


class KeyPages(Protocol):
    """Keys and values of a batch of sequences kept in blocks of a shared pool (paged memory) rather than in
    per-sequence buffers: the cached forward hands each layer's new entries here and attends over what comes back.

    ``write_read`` stores the new post-RoPE keys/values [B, Hkv, T, D] at positions ``[start, start + T)`` and
    returns every cached position's [B, Hkv, start + T, D]. ``save_state`` sees the CCA layer's convolution input
    with its history (``window`` [B, C, reach + T], the positions ``start - reach .. start + T - 1``) and delayed
    values (``delayed`` [B, T, W]), so the state at a block's end can be kept with the block (prefix caching)."""

    def write_read(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def save_state(self, window: torch.Tensor, delayed: torch.Tensor, start: int) -> None: ...


def _scaled_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        causal: bool) -> torch.Tensor:
    """Softmax attention with GQA broadcasting; ``q`` [B,Hq,T,D], ``k``/``v`` [B,Hkv,S,D].

    SDPA's native GQA (``enable_gqa``, torch >= 2.5) on every device: the same result as repeating k/v per query
    group, without the copies and their backward sums (SDPA picks a kernel that takes it; flash attention does)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])


class SequenceSeam:
    """How one forward pass's tokens sit in the full sequence, and how attention reaches the rest of it.

    ``LocalSequence`` is the whole sequence in one call; context parallelism subclasses it. An implementation must
    be exact: the model's output on its tokens equals the full-sequence model's on the same tokens."""

    def global_index(self, t: int, device: torch.device) -> torch.Tensor:
        """[T] int64: each local token's index in the full sequence (default RoPE positions; document masks)."""
        raise NotImplementedError

    def boundary(self, packed: torch.Tensor, delayed: torch.Tensor,
                 reach: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The CCA history of this call's tokens, from its ``packed`` [B, C, T] raw [q; k] rows and ``delayed``
        [B, T, W] value projections: the ``reach`` raw rows before each local run of tokens and the delayed value
        of the token before it, zeros at the sequence start. Its layout is the seam's own (``convolve`` and
        ``shift_values`` consume it): ``LocalSequence``'s is [B, C, reach] and [B, 1, W]."""
        raise NotImplementedError

    def convolve(self, conv, packed: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """The causal convolutions over ``packed`` [B, C, T] given its ``history``; [B, C, T].

        The history and tokens are joined along time in token-major memory ([B, T, C], handed to ``conv`` as a
        [B, C, T] view): ``packed`` is a slice of the projection, already token-major, so the join is a row copy,
        and the convolutions run channels-last with no transposing copies (see ``Attention._convolutions``)."""
        return conv(torch.cat((history.mT, packed.mT), dim=1).mT)

    def shift_values(self, delayed: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Each token's previous token's delayed value projection, [B, T, W]."""
        return torch.cat((first, delayed[:, :-1]), dim=1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               documents: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of the local queries [B, Hq, T, D] over every key they may see; ``k``/``v`` are the
        local keys [B, Hkv, T, D]. ``documents`` [B, T] (or None): the global index of each token's document start;
        a query sees only keys of its own document."""
        raise NotImplementedError


class LocalSequence(SequenceSeam):
    """Every token of the sequence is in this call (one process, or data parallelism)."""

    def global_index(self, t: int, device: torch.device) -> torch.Tensor:
        return torch.arange(t, device=device)

    def boundary(self, packed, delayed, reach):
        return packed.new_zeros(packed.shape[0], packed.shape[1], reach), delayed.new_zeros(
            delayed.shape[0], 1, delayed.shape[-1])

    def attend(self, q, k, v, documents):
        if documents is None:
            return _scaled_dot_product(q, k, v, None, causal=True)
        return _scaled_dot_product(q, k, v, document_mask(documents, documents, causal=True), causal=False)


LOCAL_SEQUENCE = LocalSequence()


def document_mask(q_documents: torch.Tensor, k_documents: torch.Tensor, causal: bool) -> torch.Tensor:
    """[B, 1, Tq, Tk] bool: a query may see a key of its own document (and, if ``causal``, only an earlier one:
    for queries and keys that are the same local run of tokens)."""
    mask = q_documents[:, None, :, None] == k_documents[:, None, None, :]
    if causal:
        tq, tk = q_documents.shape[1], k_documents.shape[1]
        mask = mask & torch.ones(tq, tk, dtype=torch.bool, device=mask.device).tril()
    return mask


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
        self.seam: SequenceSeam = LOCAL_SEQUENCE

    # ----------------------------------------------------------------------------------------------- projections
    def _cca_qkv(self, x: torch.Tensor, cache: AttentionCache | None,
                 cache_start: int = 0) -> tuple[torch.Tensor, ...]:
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
            first = cache.value_state.to(v_delayed.dtype)[:, None]
        else:
            history, first = self.seam.boundary(packed, v_delayed, self.conv_reach)
        mixed = self.seam.convolve(self._convolutions, packed, history)
        mixed_q, mixed_k = mixed.transpose(1, 2).split((qw, kw), dim=-1)
        q = mixed_q.view(b, t, hq, hd) + q_mean
        k = mixed_k.view(b, t, hk, hd) + k_mean
        v = cca_value(v_current, self.seam.shift_values(v_delayed, first), hk, hd)
        if cache is not None:
            # In place (after the reads above: history and first may alias the state): the cache's tensors may be
            # views into a serving engine's slot buffers (zaya.model.slots).
            window = torch.cat((history, packed), dim=-1)
            if cache.pages is not None:
                cache.pages.save_state(window, v_delayed, cache_start)
            cache.conv_state.copy_(window[..., -self.conv_reach:])
            cache.value_state.copy_(v_delayed[:, -1])

        # QK-norm to length sqrt(d); the per-KV-head temperature scales the keys. Under CUDA autocast the norm runs in
        # fp32 and so would the products; cast back to the compute dtype q and k had, so that RoPE, the cache and
        # SDPA (flash attention) see bf16 (a no-op on CPU, whose autocast keeps the norm in bf16).
        eps = torch.finfo(q.dtype).eps
        scale = hd**0.5
        dtype = q.dtype
        q = (q * (scale / q.norm(dim=-1, keepdim=True).clamp_min(eps))).to(dtype)
        k = (k * (scale / k.norm(dim=-1, keepdim=True).clamp_min(eps)) * self.temperature.to(dtype)[:, None]).to(dtype)
        return q, k, v

    def _convolutions(self, packed: torch.Tensor) -> torch.Tensor:
        """Both causal convolutions over [B, C, reach + T] (history first); [B, C, T], token-major in memory.

        Run as 2-D convolutions over a height-1 image in channels-last memory, which is the token-major [B, T, C]
        layout the projections produce and the heads consume: oneDNN (and cuDNN) take it as it is, where a
        channels-first ``Conv1d`` would transpose its input, output and gradients (3x faster forward + backward
        at ZAYA1's width, 4k tokens, CPU bf16; bit-identical results)."""
        x = packed.unsqueeze(2).contiguous(memory_format=torch.channels_last)  # [B, C, 1, T]; no copy if token-major
        for conv in (self.conv_depthwise, self.conv_grouped):
            x = F.conv2d(x, _GradientInWeightStrides.apply(conv.weight).unsqueeze(2), conv.bias, groups=conv.groups)
        return x.squeeze(2)

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
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend over ``x`` [B, T, D].

        token_mask: [B, T] bool, False at padding (zeroed before the CCA projections), or None.
        attn_mask: [B, 1, T, S] bool (True = may attend), or None for plain causal attention over ``x`` (with no
            cache) or over everything cached (single-token decode).
        cache: decode state; this call's keys/values are written at ``cache_start`` and attention covers
            ``[0, cache_start + T)``.
        documents: [B, T] global index of each token's document start, or None: attention stays inside a
            document (no cache, no attn_mask).
        """
        if token_mask is not None and self.kind == "cca":
            x = x * token_mask[..., None].to(x.dtype)
        if self.kind == "cca":
            q, k, v = self._cca_qkv(x, cache, cache_start)
        else:
            q, k, v = self._plain_qkv(x)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if cache is not None and cache.shard is not None:
            if attn_mask is not None:
                raise ValueError("a sharded decode cache (tree decoding) takes one token per step, without padding or "
                                 "an attention mask")
            out = cache.shard.attend(q, k, v, cache, cache_start)
            return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        causal = cache is None
        if cache is not None and cache.pages is not None:
            k, v = cache.pages.write_read(k, v, cache_start)
            k, v = k.to(q.dtype), v.to(q.dtype)
        elif cache is not None:
            end = cache_start + x.shape[1]
            cache.keys[:, :, cache_start:end] = k.to(cache.keys.dtype)
            cache.values[:, :, cache_start:end] = v.to(cache.values.dtype)
            k = cache.keys[:, :, :end].to(q.dtype)
            v = cache.values[:, :, :end].to(q.dtype)
        if cache is not None and attn_mask is None and x.shape[1] > 1:
            raise ValueError("multi-token forward with a cache needs an explicit attn_mask")
        if cache is None and attn_mask is None:
            out = self.seam.attend(q, k, v, documents)
        else:
            if self.seam is not LOCAL_SEQUENCE:
                raise ValueError("a decode cache or a padding mask needs the local sequence seam (context "
                                 "parallelism covers training forwards without padding)")
            if documents is not None:
                raise ValueError("document masks need a forward without a decode cache or padding mask")
            out = _scaled_dot_product(q, k, v, attn_mask, causal)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> AttentionCache:
        """Empty decode state for ``batch`` sequences of up to ``capacity`` tokens."""
        shape = (batch, self.num_kv_heads, capacity, self.head_dim)
        return AttentionCache(keys=torch.zeros(shape, dtype=dtype, device=device),
                              values=torch.zeros(shape, dtype=dtype, device=device),
                              **self.new_cca_state(batch, dtype, device))

    def new_cca_state(self, batch: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """The CCA layer's running decode state for ``batch`` sequences (``conv_state``, ``value_state``: zeros,
        nothing before the start); {} for plain attention."""
        if self.kind != "cca":
            return {}
        return {"conv_state": torch.zeros(batch, self.conv_depthwise.in_channels, self.conv_reach, dtype=dtype,
                                          device=device),
                "value_state": torch.zeros(batch, self.v_previous_proj.out_features, dtype=dtype, device=device)}

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
