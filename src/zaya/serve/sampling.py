"""Choosing the next token: the sampling options, their checks, ``sample_next`` and the fixed-batch sampling loop.

One implementation for every decoder: the serving engine (``zaya.serve.engine``), ``model.generate`` (which runs on
that engine) and tree-parallel decoding (``zaya.serve.tree``, through ``decode_tokens``) all sample here, so
a seed gives the same tokens whichever of them runs it. ``zaya.model.zaya`` re-exports these names.

This module is below the model in the package layering (it imports no model code), so the model can use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

EOS_CHECK_EVERY = 16
"""``generate`` asks whether every row has emitted eos (a host read) once per this many decoded tokens."""

MIN_TEMPERATURE = 1e-5
"""A temperature below this is greedy: dividing logits by a tinier one (1e-45, a subnormal) overflows fp32 to inf,
and the softmax of inf is NaN. Sampling at 1e-5 already picks the argmax unless two logits tie within ~1e-4."""

_FP32_MAX = torch.finfo(torch.float32).max

SEED_RANGE = (0, 2**63)
"""Seeds are in [0, 2**63): what ``torch.Generator.manual_seed`` takes on every backend, as a signed 64-bit int."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 = greedy; top_k None/0 = off; top_p None/1 = off;
    repetition_penalty 1 = off (CTRL's rule: a logit of a token already in the prompt or output is divided by the
    penalty when positive and multiplied by it when negative); presence_penalty / frequency_penalty 0 = off
    (OpenAI's rule, on the output only: ``apply_output_penalties``); seed None = a fresh, unseeded generator, else an
    int in ``SEED_RANGE``. A temperature below ``MIN_TEMPERATURE`` is greedy. Every value is checked here (a
    ValueError), so the engine never meets one that cannot be sampled."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_sampling(0, self.temperature, self.top_p)
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 0):
            raise ValueError(f"top_k must be an int >= 0 (0 or None disables it), not {self.top_k!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, not {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, not {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"seed must be an int in [0, 2**63), not {self.seed!r}")

    @property
    def penalises_output(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        """The argmax of the raw logits: no temperature and no penalty."""
        return (self.temperature < MIN_TEMPERATURE and self.repetition_penalty == 1.0
                and not self.penalises_output)


def check_sampling(max_new_tokens: int, temperature: float, top_p: float | None) -> None:
    """Raise ValueError for sampling options ``generate`` (and the distributed decoders) cannot honour."""
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, not {temperature!r}")
    if top_p is not None and not 0 < top_p <= 1:  # NaN fails this too
        raise ValueError(f"top_p must be in (0, 1], not {top_p!r}")


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row of ``logits`` [B, V] (greedy below ``MIN_TEMPERATURE``)."""
    if temperature < MIN_TEMPERATURE:
        return logits.float().argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int | None,
                   top_p: float | None) -> torch.Tensor:
    """The distribution ``sample_next`` draws from, [B, V], for a temperature of at least ``MIN_TEMPERATURE``
    (below it the choice is the argmax): temperature, then top-k, then top-p. Speculative decoding
    (``zaya.serve.speculative``) accepts draft tokens under it."""
    logits = logits.float()
    # Logits that overflow fp32 (a large one over a small temperature or penalty) were the largest: keep them the
    # largest, finite, so that the softmax sees no inf - inf.
    logits = (logits / temperature).clamp(max=_FP32_MAX)
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p; the most likely one always stays (a top_p
        # below fp32's smallest number rounds to 0, which the first token's 0 would otherwise "reach").
        drop = probs.cumsum(-1) - probs >= top_p
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits.softmax(-1)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``logits`` [B, V] with CTRL's repetition penalty applied where ``seen`` [B, V] (bool) is set."""
    if penalty == 1.0:
        return logits
    logits = logits.float()
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty).clamp(-_FP32_MAX, _FP32_MAX)
    return torch.where(seen, penalised, logits)


def apply_output_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: float,
                           frequency: float) -> torch.Tensor:
    """``logits`` [B, V] with OpenAI's penalties: ``logit - frequency * count - presence * (count > 0)``, where
    ``counts`` [B, V] is how often each token is in the output so far (not the prompt). Applied after the repetition
    penalty, as vLLM does; a negative penalty favours repeats."""
    if presence == 0 and frequency == 0:
        return logits
    counts = counts.to(torch.float32)
    penalty = frequency * counts + presence * (counts > 0).to(torch.float32)
    return (logits.float() - penalty).clamp(-_FP32_MAX, _FP32_MAX)


def decode_tokens(prompt: torch.Tensor, logits: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor],
                  max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None, eos_token_id: int | None = None,
                  share: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The fixed-batch sampling loop: ``model.generate`` (on the engine's slot decoder) and a decoder whose cache
    lives elsewhere (``zaya.serve.tree``) sample through it, so both give the same tokens.

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
