"""Choosing the next token: the sampling options, their checks, ``sample_next`` and the fixed-batch sampling loop.

One implementation for every decoder: the serving engine (``zaya.serve.engine``), ``model.generate`` (which runs on
that engine) and tree-parallel decoding (``zaya.dist.tree_decoding``, through ``decode_tokens``) all sample here, so
a seed gives the same tokens whichever of them runs it. ``zaya.model.zaya`` re-exports these names.

This module is below the model in the package layering (it imports no model code), so the model can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

EOS_CHECK_EVERY = 16
"""``generate`` asks whether every row has emitted eos (a host read) once per this many decoded tokens."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 = greedy; top_k None/0 = off; top_p None/1 = off;
    repetition_penalty 1 = off (CTRL's rule: a logit of a token already in the prompt or output is divided by the
    penalty when positive and multiplied by it when negative); seed None = a fresh, unseeded generator."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_sampling(0, self.temperature, self.top_p)
        if self.top_k is not None and self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 or None disables it)")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and self.repetition_penalty == 1.0


def check_sampling(max_new_tokens: int, temperature: float, top_p: float | None) -> None:
    """Raise ValueError for sampling options ``generate`` (and the distributed decoders) cannot honour."""
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError("top_p must be in (0, 1]")


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row of ``logits`` [B, V]."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p (the most likely one always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``logits`` [B, V] with CTRL's repetition penalty applied where ``seen`` [B, V] (bool) is set."""
    if penalty == 1.0:
        return logits
    logits = logits.float()
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def decode_tokens(prompt: torch.Tensor, logits: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor],
                  max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None, eos_token_id: int | None = None,
                  share: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The fixed-batch sampling loop: ``model.generate`` (on the engine's slot decoder) and a decoder whose cache
    lives elsewhere (``zaya.dist.tree_decoding``) sample through it, so both give the same tokens.

    prompt: [B, T]; logits: [B, V] the next-token logits after it; ``step(token [B])`` feeds one token per row and
    returns the next logits. ``share(token)``, if given, returns the token every process is to use (a broadcast:
    processes that decode together must feed the same tokens). The rows share one generator (seeded by ``seed``).
    Reads nothing back to the host except, with an eos, whether every row has finished, once per
    ``EOS_CHECK_EVERY`` tokens (finished rows keep emitting eos; a result cut short is padded with eos).
    Returns [B, T + max_new_tokens]."""
    b, t = prompt.shape
    generator = None
    if seed is not None:
        generator = torch.Generator(device=prompt.device).manual_seed(seed)
    done = torch.zeros(b, dtype=torch.bool, device=prompt.device)
    new_tokens = []
    for i in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, top_p, generator)
        if share is not None:
            token = share(token)
        if eos_token_id is not None:
            token = torch.where(done, torch.full_like(token, eos_token_id), token)
            done |= token == eos_token_id
        new_tokens.append(token)
        if i + 1 == max_new_tokens:
            break
        if eos_token_id is not None and (i + 1) % EOS_CHECK_EVERY == 0 and bool(done.all()):
            break
        logits = step(token)
    out = torch.cat([prompt, torch.stack(new_tokens, dim=1).to(prompt.dtype)], dim=1)
    if out.shape[1] < t + max_new_tokens:
        pad = torch.full((b, t + max_new_tokens - out.shape[1]), eos_token_id, dtype=out.dtype, device=out.device)
        out = torch.cat([out, pad], dim=1)
    return out
