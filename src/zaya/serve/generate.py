"""``generate(model, input_ids, max_new_tokens, ...)``: sample a batch's continuations on the serving engine.

One implementation of decoding for the library call, ``zaya generate``, the trainer's samples, ``zaya eval`` and
``zaya serve``: the batch's rows become requests on an ``Engine`` with one slot each, so they share its slot decoder
and its sampling. The model package never imports this one; it only provides the forward pass and decode state.
"""

from __future__ import annotations

import torch

from zaya.model.zaya import ZayaForCausalLM
from zaya.serve.engine import Engine
from zaya.serve.sampling import check_sampling


@torch.no_grad()
def generate(
    model: ZayaForCausalLM,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """Sample ``max_new_tokens`` after ``input_ids`` [B, T] (left-pad a ragged batch and pass its mask).

    temperature 0 means greedy. top_k keeps the k most likely tokens, top_p the smallest set whose probability
    reaches p. A fixed ``seed`` makes sampling reproducible. Sequences that emit ``eos_token_id`` keep emitting it;
    decoding stops early once every row has (checked every ``EOS_CHECK_EVERY`` tokens). The prompt's ids are checked
    against the vocabulary (``model.check_input_ids``). Returns [B, T + max_new_tokens].
    """
    check_sampling(max_new_tokens, temperature, top_p)
    if max_new_tokens == 0:
        return input_ids
    model.check_input_ids(input_ids)
    b, t = input_ids.shape
    engine = Engine(model, num_slots=b, capacity=t + max_new_tokens)
    return engine.generate_batch(input_ids, max_new_tokens, temperature, top_k, top_p, seed, attention_mask,
                                 eos_token_id)
