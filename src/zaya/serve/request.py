"""One generation request as the engine sees it, and what it hands back: tokens, log-probabilities, finish reason.

Requests hold token ids only; text (stop strings) goes through ``zaya.serve.text``. Everything here is plain host
data, so the HTTP layer can read a request's progress from another thread without touching tensors.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

import torch

from zaya.serve.sampling import SamplingParams

_ids = itertools.count()


@dataclass
class TokenLogprob:
    """The log-probability of one token under the model (raw logits, before temperature or penalties), and the
    ``top`` most likely alternatives at that position as (token, log-probability), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class TokenConstraint(Protocol):
    """What a request may sample next (structured output, ``zaya.serve.structured``). The engine calls ``mask``
    on the request's processed logits before it samples, and ``accept`` with every token it takes (eos included);
    an exception from either fails that request alone."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [1, V] with every token the constraint forbids now set to -inf."""

    def accept(self, token: int) -> None:
        """Advance past ``token`` (one ``mask`` allowed)."""


@dataclass
class Request:
    """prompt: token ids (at least one); max_tokens: new tokens at most (0 = score the prompt only);
    stop: strings that end the output (excluded from it; needs the engine's ``decode``); eos_token_id: ends the
    output (excluded) unless ``ignore_eos``; logprobs: None, or how many alternatives to report per output token
    (0 = just the chosen token's); prompt_logprobs: also report every prompt token's log-probability (the first
    has none)."""

    prompt: list[int]
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    eos_token_id: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False
    constraint: TokenConstraint | None = None
    """Restricts the tokens sampled (structured output); such a request is never speculated."""
    id: int = field(default_factory=lambda: next(_ids))

    # ---- progress, written by the engine ----
    output: list[int] = field(default_factory=list)
    """Generated token ids (a stop string's tokens and the eos are not included)."""
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_token_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    text: str = ""
    """With stop strings: the output text, cut before the stop."""
    finish_reason: str | None = None
    """None while running; "stop" (eos or a stop string), "length" (max_tokens or the slot's capacity), "abort"
    (a client went away, or the server stopped) or "error" (then ``error`` says what failed)."""
    error: str | None = None
    """Why the request failed (finish reason "error"): it alone failed, the engine's other requests go on."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
