"""Prompt-lookup speculation: greedy output identical to decoding without it (drafts kept and rejected, penalties,
eos, stop strings, max_tokens, log-probabilities), the acceptance rule's distribution, and the n-gram proposer."""

from __future__ import annotations

import functools

import torch

from model_helpers import tiny_model
from zaya.serve.engine import Engine
from zaya.serve.request import Request
from zaya.serve.sampling import SamplingParams
from zaya.serve.speculative import propose, verify_draft

GREEDY = SamplingParams(temperature=0)


@functools.cache
def _model():
    """A tiny model pushed far from its init (weights + N(0, 0.5)), so that its greedy output varies and drafts are
    both kept and rejected (nearer its init it repeats one token and every draft is kept)."""
    model = tiny_model(2, vocab_size=64, max_seq_len=256, eos_token_id=2, hidden_size=64, num_layers=2,
                       expert_hidden_size=64).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(request_args: list[dict], speculative: int, decode=None) -> tuple[list[Request], Engine]:
    engine = Engine(_model(), num_slots=2, capacity=256, decode=decode, speculative_ngram=speculative,
                    speculative_tokens=4)
    return engine.run([Request(**args) for args in request_args]), engine


def _same(request_args: list[dict], decode=None) -> tuple[int, int]:
    """Run the requests one at a time with and without speculation, assert the same results; returns the draft
    tokens verified and kept in all."""
    drafted = accepted = 0
    for args in request_args:
        (off,), _ = _run([args], 0, decode)
        (on,), engine = _run([args], 3, decode)
        assert on.output == off.output and on.finish_reason == off.finish_reason and on.text == off.text
        assert [t.token for t in on.output_logprobs] == [t.token for t in off.output_logprobs]
        for a, b in zip(on.output_logprobs, off.output_logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]
        drafted, accepted = drafted + engine.drafted, accepted + engine.accepted
    return drafted, accepted


def test_greedy_output_is_identical_with_drafts_kept_and_rejected():
    prompts = [_prompt(12, 1), _prompt(12, 2) * 3, _prompt(30, 3), [5, 6, 7, 8] * 6]
    drafted, accepted = _same([dict(prompt=p, max_tokens=60, sampling=GREEDY, logprobs=2) for p in prompts])
    assert 0 < accepted < drafted  # both paths ran: kept drafts and rolled-back rejections


def test_penalties_eos_stop_and_max_tokens_are_honoured():
    greedy_penalised = SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                                      frequency_penalty=0.2)
    (plain,), _ = _run([dict(prompt=_prompt(12, 2), max_tokens=40, sampling=GREEDY)], 0)
    eos = plain.output[25]  # a token the output reaches after some speculative steps
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731 - token ids as text, for stop strings
    cases = [dict(prompt=_prompt(12, 2), max_tokens=40, sampling=greedy_penalised),
             dict(prompt=_prompt(12, 2), max_tokens=40, sampling=GREEDY, eos_token_id=eos),
             dict(prompt=_prompt(12, 2), max_tokens=40, sampling=GREEDY, stop=(f" {plain.output[20]} ",)),
             dict(prompt=_prompt(12, 2), max_tokens=7, sampling=GREEDY)]
    _same(cases, decode)
    results, _ = _run(cases, 3, decode)
    assert [r.finish_reason for r in results] == ["length", "stop", "stop", "length"]
    assert eos not in results[1].output and len(results[3].output) == 7


def test_sampled_requests_run_to_their_length():
    args = dict(prompt=_prompt(12, 2) * 2, max_tokens=30, sampling=SamplingParams(temperature=0.8, top_k=10, seed=1))
    (r,), engine = _run([args], 3)
    assert r.finish_reason == "length" and len(r.output) == 30 and engine.drafted > 0


def test_acceptance_rule_gives_the_target_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    n = 5000
    g = torch.Generator().manual_seed(0)
    for draft in (0, 3, 4):  # a likely draft, an unlikely one and one the distribution excludes
        counts = torch.zeros(5)
        for _ in range(n):
            token, kept = verify_draft(probs, draft, g)
            assert kept == (token == draft)
            counts[token] += 1
        expected = probs[:4] * n
        chi2 = float(((counts[:4] - expected) ** 2 / expected).sum())
        assert counts[4] == 0 and chi2 < 18.5  # 3 degrees of freedom: P(chi2 > 18.5) < 0.0004


def test_propose_takes_the_longest_recurring_suffix():
    assert propose([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 3, 2) == [9, 2]  # the 3-gram [1, 2, 3] beats the later [2, 3]
    assert propose([4, 2, 3, 5, 6, 9, 2, 3], 3, 4) == [5, 6, 9, 2]
    assert propose([7, 7, 7, 7], 2, 3) == [7, 7]  # no occurrence has 3 tokens after it: the first one
    assert propose([1, 2, 3], 3, 4) == [] and propose([5], 3, 4) == []


def test_zaya_serve_refuses_bad_speculation_flags(capsys):
    from zaya.cli import main

    for flags, message in ((["--speculative-ngram", "-1"], "--speculative-ngram must be >= 0 (0: off), not -1"),
                           (["--speculative-tokens", "0"], "--speculative-tokens must be >= 1")):
        assert main(["serve", "--checkpoint", "unused", *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_metrics_export_the_draft_and_kept_counts():
    from prometheus_client.parser import text_string_to_metric_families

    from zaya.serve.metrics import ServeMetrics

    (_,), engine = _run([dict(prompt=[5, 6, 7, 8] * 6, max_tokens=30, sampling=GREEDY)], 3)
    samples = {s.name: s.value for family in text_string_to_metric_families(
        ServeMetrics(engine).exposition().decode()) for s in family.samples}
    assert samples["zaya_spec_decode_draft_tokens_total"] == engine.drafted > 0
    assert samples["zaya_spec_decode_accepted_tokens_total"] == engine.accepted > 0
