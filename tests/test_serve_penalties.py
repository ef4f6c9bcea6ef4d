"""Presence and frequency penalties (OpenAI's rule, on the output only) in the engine's sampling path: the function
against a loop over fixed logits, and the engine's greedy tokens against a step-by-step reference over the model's
full forward, alone and combined with the repetition penalty."""

from __future__ import annotations

import pytest
import torch

from serve_helpers import served_model
from zaya.serve.engine import Engine
from zaya.serve.request import Request
from zaya.serve.sampling import SamplingParams, apply_output_penalties, apply_repetition_penalty


def test_output_penalties_match_openais_rule_on_fixed_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, generator=g) * 4
    counts = torch.randint(0, 4, (3, 11), generator=g)
    presence, frequency = 0.7, -1.3
    want = logits.clone()
    for b in range(3):
        for v in range(11):
            c = int(counts[b, v])
            want[b, v] -= frequency * c + (presence if c > 0 else 0.0)
    assert torch.allclose(apply_output_penalties(logits, counts, presence, frequency), want, atol=1e-6)
    assert apply_output_penalties(logits, counts, 0.0, 0.0) is logits
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=float("nan"))


def _reference_greedy(model, prompt: list[int], n: int, presence: float, frequency: float,
                      repetition: float = 1.0) -> list[int]:
    """Greedy decoding by the full forward each step: repetition penalty over prompt and output, then OpenAI's
    penalties over the output's counts."""
    ids, out = list(prompt), []
    vocab = model.config.vocab_size
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()[None]
        seen = torch.zeros(1, vocab, dtype=torch.bool)
        seen[0, ids] = True
        logits = apply_repetition_penalty(logits, seen, repetition)
        counts = torch.zeros(1, vocab)
        for t in out:
            counts[0, t] += 1
        logits = logits - frequency * counts - presence * (counts > 0).float()
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
    return out


def test_engine_applies_penalties_per_request_and_zero_changes_nothing():
    model = served_model(vocab_size=512, max_seq_len=64)
    engine = Engine(model, num_slots=4, capacity=64)
    prompt, n = [5, 9, 5, 9, 5], 24

    def request(**penalties) -> Request:
        return Request(prompt=prompt, max_tokens=n, sampling=SamplingParams(temperature=0, **penalties))

    plain, zero, freq, both = engine.run([request(), request(presence_penalty=0.0, frequency_penalty=0.0),
                                         request(frequency_penalty=2.0),
                                         request(presence_penalty=1.5, frequency_penalty=-0.5,
                                                 repetition_penalty=1.3)])
    assert len(set(plain.output)) < n // 2, "the tiny model's greedy output should repeat"
    assert zero.output == plain.output
    assert freq.output != plain.output and len(set(freq.output)) > len(set(plain.output))
    assert freq.output == _reference_greedy(model, prompt, n, 0.0, 2.0)
    assert both.output == _reference_greedy(model, prompt, n, 1.5, -0.5, repetition=1.3)
