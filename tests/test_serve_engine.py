"""The serving engine: continuous batching gives what each request gets alone, chunked prefill and the batched
decode step equal the full forward, sampling options, stops, eos and log-probabilities, and generate on it."""

from __future__ import annotations

import pytest
import torch

from serve_helpers import tiny_model
from zaya.serve.engine import ContextLengthError, Engine
from zaya.serve.request import Request
from zaya.serve.sampling import SamplingParams
from zaya.serve.text import TextStream


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _requests() -> list[Request]:
    """Mixed lengths and options: greedy, seeded samplers (top-k, top-p, repetition penalty), log-probabilities."""
    specs = [(5, 9, SamplingParams(temperature=0)), (23, 4, SamplingParams(temperature=0.8, top_k=20, seed=3)),
             (2, 12, SamplingParams(temperature=1.0, top_p=0.9, seed=5)),
             (40, 7, SamplingParams(temperature=0, repetition_penalty=1.3)),
             (11, 6, SamplingParams(temperature=0.7, repetition_penalty=1.2, seed=9))]
    return [Request(prompt=_prompt(n, i), max_tokens=m, sampling=s, logprobs=2 if i % 2 else None,
                    prompt_logprobs=i == 1)
            for i, (n, m, s) in enumerate(specs)]


def test_concurrent_requests_equal_one_at_a_time():
    model = tiny_model()
    # 2 slots for 5 requests: they queue, join as others leave, and prefill in chunks of 8 between decode steps
    batched = Engine(model, num_slots=2, capacity=64, prefill_chunk=8).run(_requests())
    for got, want in zip(batched, _requests()):
        alone = Engine(model, num_slots=1, capacity=64).run([want])[0]
        assert got.output == alone.output and got.finish_reason == alone.finish_reason == "length"
        assert len(got.output) == got.max_tokens
        for a, b in zip(got.output_logprobs, alone.output_logprobs):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
        assert [a and round(a.logprob, 4) for a in got.prompt_token_logprobs] == \
            [b and round(b.logprob, 4) for b in alone.prompt_token_logprobs]


def test_greedy_output_and_logprobs_equal_the_full_forward():
    model = tiny_model()
    prompt = _prompt(13, 1)
    r = Engine(model, num_slots=3, capacity=64, prefill_chunk=5).run(
        [Request(prompt=prompt, max_tokens=10, sampling=SamplingParams(temperature=0), logprobs=3,
                 prompt_logprobs=True)])[0]
    seq = torch.tensor([prompt + r.output])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0].float(), -1)
    assert r.output == logp[len(prompt) - 1:-1].argmax(-1).tolist()
    positions = range(len(prompt) - 1, seq.shape[1] - 1)
    for lp, pos in zip(r.output_logprobs, positions):
        assert abs(lp.logprob - logp[pos, lp.token].item()) < 1e-4 and lp.top[0][0] == lp.token and len(lp.top) == 3
    assert r.prompt_token_logprobs[0] is None
    for i, lp in enumerate(r.prompt_token_logprobs[1:], start=1):
        assert lp.token == prompt[i] and abs(lp.logprob - logp[i - 1, prompt[i]].item()) < 1e-4


def test_eos_stop_strings_scoring_and_capacity():
    model = tiny_model()
    text = {i: chr(ord("a") + i % 26) for i in range(512)}
    decode = lambda ids: "".join(text[i] for i in ids)  # noqa: E731
    engine = Engine(model, num_slots=2, capacity=32, decode=decode)
    free = engine.run([Request(prompt=_prompt(6, 4), max_tokens=12, sampling=SamplingParams(temperature=0))])[0]
    eos = free.output[3]
    stopped = engine.run([Request(prompt=_prompt(6, 4), max_tokens=12, sampling=SamplingParams(temperature=0),
                                  eos_token_id=eos)])[0]
    assert stopped.finish_reason == "stop" and stopped.output == free.output[:free.output.index(eos)]
    stop = decode(free.output[5:7])
    by_text = engine.run([Request(prompt=_prompt(6, 4), max_tokens=12, sampling=SamplingParams(temperature=0),
                                  stop=(stop,))])[0]
    full = decode(free.output)
    assert by_text.finish_reason == "stop" and by_text.text == full[:full.index(stop)]
    scored = engine.run([Request(prompt=_prompt(9, 2), max_tokens=0, prompt_logprobs=True)])[0]
    assert scored.output == [] and scored.finish_reason == "length" and len(scored.prompt_token_logprobs) == 9
    with pytest.raises(ContextLengthError, match="context is 32"):
        engine.submit(Request(prompt=_prompt(30, 0), max_tokens=3))
    with pytest.raises(ValueError, match="outside"):
        engine.submit(Request(prompt=[1, 512]))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit(Request(prompt=[1], max_tokens=-1))
    assert not engine.busy


def test_generate_runs_on_the_engine_with_left_padding():
    model = tiny_model()
    rows = [_prompt(7, 1), _prompt(4, 2)]
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 7 - len(r):] = torch.tensor(r)
        mask[i, 7 - len(r):] = 1
    out = model.generate(ids, 6, temperature=0, attention_mask=mask)
    for i, r in enumerate(rows):
        alone = model.generate(torch.tensor([r]), 6, temperature=0)
        assert out[i, 7:].tolist() == alone[0, len(r):].tolist()
    with pytest.raises(ValueError, match="left padding"):
        model.generate(ids, 2, attention_mask=mask.flip(1))


def test_text_stream_holds_back_a_possible_stop():
    s = TextStream(lambda ids: "".join(map(chr, ids)), stops=("END",))
    sent = [s.update([ord(c) for c in "hello E"[:i]]) for i in range(1, 8)]
    assert "".join(sent) == "hello "  # "E" could start "END"
    assert s.update([ord(c) for c in "hello EN!"]) == "EN!" and not s.stopped
    assert s.update([ord(c) for c in "hello EN!END more"]) == "" and s.stopped and s.text == "hello EN!"
