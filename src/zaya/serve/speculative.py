"""Prompt-lookup speculative decoding: draft tokens taken from the request's own context, no draft model.

``propose`` finds the longest suffix of the context (prompt + output, up to ``max_ngram`` tokens) that also occurs
earlier in it, and proposes the tokens that followed its latest earlier occurrence with a full draft after it (else
its first). The engine
(``zaya.serve.engine``) feeds the pending token and the draft in one forward and keeps the longest prefix of the
draft the request's own sampling would have produced:

- greedy (temperature below ``MIN_TEMPERATURE``): a draft token is kept when it is the argmax of the processed
  logits at its position, so the output is the one decoding without speculation gives;
- sampling: ``verify_draft`` keeps draft token t with probability p(t) under the processed distribution, else
  draws from p with t removed (renormalised). For a deterministic draft this is the standard speculative rule, and
  every emitted token has exactly the distribution p (P(t) = p(t); P(x) = (1 - p(t)) p(x) / (1 - p(t)) = p(x)).

A rejected token's KV entry needs no rollback (attention reaches only a row's own position, and the next token
overwrites it), but the CCA layers' convolution and value-shift state have advanced past it: ``CcaSnapshot`` keeps
that state from before the verify forward, so the engine can restore it and feed the kept tokens again.
"""

from __future__ import annotations

import torch


def propose(context: list[int], max_ngram: int, k: int) -> list[int]:
    """Up to ``k`` draft tokens: those after an earlier occurrence of the longest suffix of ``context`` of
    ``max_ngram`` tokens or fewer (at least one): the latest one followed by ``k`` tokens, else the first (a suffix
    that recurs only at the end, as in a run of one token, has fewer after it); [] when no suffix recurs."""
    if k < 1 or len(context) < 2:
        return []
    ids = torch.tensor(context)
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        windows = ids[:-1].unfold(0, n, 1)  # every n-gram that has a token after it
        hits = (windows == ids[-n:]).all(dim=1).nonzero()[:, 0] + n  # where the tokens after each one start
        if hits.numel():
            full = hits[hits + k <= len(context)]
            start = int(full[-1]) if full.numel() else int(hits[0])
            return context[start:start + k]
    return []


def verify_draft(probs: torch.Tensor, draft: int, generator: torch.Generator | None) -> tuple[int, bool]:
    """The token to emit where ``draft`` was proposed and the request samples from ``probs`` [V], and whether it is
    the draft (see the module docstring: the token's distribution is ``probs``)."""
    u = torch.rand((), generator=generator, device=probs.device)
    if bool(u < probs[draft]):
        return draft, True
    rest = probs.clone()
    rest[draft] = 0
    return int(torch.multinomial(rest, 1, generator=generator)), False


class CcaSnapshot:
    """A copy of one slot's CCA convolution and value-shift state in every layer of a ``SlotDecoder``."""

    def __init__(self, decoder, slot: int) -> None:
        self.slot = slot
        self.saved = [(c.conv_state[slot].clone(), c.value_state[slot].clone())
                      for c in decoder.caches if c.conv_state is not None]
        self.caches = [c for c in decoder.caches if c.conv_state is not None]

    def restore(self) -> None:
        for cache, (conv, value) in zip(self.caches, self.saved):
            cache.conv_state[self.slot].copy_(conv)
            cache.value_state[self.slot].copy_(value)
