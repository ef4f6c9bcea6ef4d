"""The serving engine: continuous batching gives what each request gets alone, chunked prefill and the batched
decode step equal the full forward, sampling options, stops, eos and log-probabilities, and generate on it."""

from __future__ import annotations

import pytest
import torch

from serve_helpers import served_model
from zaya.serve.engine import ContextLengthError, Engine
from zaya.serve.generate import generate
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
    model = served_model()
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
    model = served_model()
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
    model = served_model()
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
    model = served_model()
    rows = [_prompt(7, 1), _prompt(4, 2)]
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 7 - len(r):] = torch.tensor(r)
        mask[i, 7 - len(r):] = 1
    out = generate(model, ids, 6, temperature=0, attention_mask=mask)
    for i, r in enumerate(rows):
        alone = generate(model, torch.tensor([r]), 6, temperature=0)
        assert out[i, 7:].tolist() == alone[0, len(r):].tolist()
    with pytest.raises(ValueError, match="left padding"):
        generate(model, ids, 2, attention_mask=mask.flip(1))


def test_text_stream_holds_back_a_possible_stop():
    s = TextStream(lambda ids: "".join(map(chr, ids)), stops=("END",))
    sent = [s.update([ord(c) for c in "hello E"[:i]]) for i in range(1, 8)]
    assert "".join(sent) == "hello "  # "E" could start "END"
    assert s.update([ord(c) for c in "hello EN!"]) == "EN!" and not s.stopped
    assert s.update([ord(c) for c in "hello EN!END more"]) == "" and s.stopped and s.text == "hello EN!"


def _forced(params: SamplingParams, **values) -> SamplingParams:
    """``params`` with values its checks refuse (a bug upstream, or a caller that skipped them)."""
    for name, value in values.items():
        object.__setattr__(params, name, value)
    return params


def test_one_requests_failure_never_fails_another():
    """A request that fails while being admitted (a seed torch refuses), sampled (a NaN temperature) or finished (a
    stop-string decode that raises on its output) fails alone, with its reason; the others give exactly what they
    give alone."""
    model = served_model()
    text = {i: chr(ord("a") + i % 26) for i in range(512)}
    plain = lambda ids: "".join(text[i] for i in ids)  # noqa: E731
    poisoned_prompt = _prompt(3, 5)
    poison = Engine(model, num_slots=1, capacity=64).run(
        [Request(prompt=poisoned_prompt, max_tokens=1, sampling=SamplingParams(temperature=0))])[0].output[0]

    def decode(ids):
        if ids and ids[0] == poison:
            raise RuntimeError(f"cannot decode {ids}")
        return plain(ids)

    def good() -> list[Request]:
        return [Request(prompt=_prompt(9, 1), max_tokens=10, logprobs=2,
                        sampling=SamplingParams(temperature=0.9, top_p=0.8, seed=4)),
                Request(prompt=_prompt(5, 2), max_tokens=12, sampling=SamplingParams(temperature=0), stop=("zzzz",))]

    bad = [Request(prompt=_prompt(4, 3), max_tokens=5, sampling=_forced(SamplingParams(seed=1), seed=2**64)),
           Request(prompt=_prompt(6, 4), max_tokens=5,
                   sampling=_forced(SamplingParams(temperature=0.5), temperature=float("nan"))),
           Request(prompt=poisoned_prompt, max_tokens=5, sampling=SamplingParams(temperature=0), stop=("q",))]
    together = good()
    # 3 slots for 5 requests: the bad ones are admitted among the good ones, and queued behind them
    Engine(model, num_slots=3, capacity=64, prefill_chunk=8, decode=decode).run(
        [together[0], bad[0], bad[1], together[1], bad[2]])
    for b, what in zip(bad, ("admitting the request", "sampling", "taking the sampled token")):
        assert b.finish_reason == "error" and b.error.startswith(what), (b.finish_reason, b.error)
    assert "cannot decode" in bad[2].error
    for got, want in zip(together, good()):
        alone = Engine(model, num_slots=1, capacity=64, decode=decode).run([want])[0]
        assert got.output[:1] != [poison] and got.finish_reason == alone.finish_reason == "length"
        assert got.output == alone.output and got.text == alone.text and len(got.output) == got.max_tokens
        assert [lp.token for lp in got.output_logprobs] == [lp.token for lp in alone.output_logprobs]


def test_sampling_values_at_their_limits_give_finite_probabilities():
    """Temperatures, top-p values and repetition penalties that underflow or overflow fp32 (1e-45, 1e-300, a
    subnormal, 1e300) sample a token (greedy below MIN_TEMPERATURE) instead of raising in torch.multinomial."""
    from zaya.serve.sampling import MIN_TEMPERATURE, apply_repetition_penalty, sample_next

    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)) * 20
    gen = torch.Generator().manual_seed(1)
    for t in (1e-45, 1e-300, 5e-324, MIN_TEMPERATURE / 2):
        assert sample_next(logits, t, None, None, gen).tolist() == logits.argmax(-1).tolist()
    assert sample_next(logits, 1.0, None, 1e-300, gen).tolist() == logits.argmax(-1).tolist()  # top-p keeps one
    seen = torch.ones_like(logits, dtype=torch.bool)
    for penalty in (1e-45, 5e-324, 1e300):
        penalised = apply_repetition_penalty(logits, seen, penalty)
        assert torch.isfinite(penalised).all()
        for t, k, p in ((1.0, None, None), (MIN_TEMPERATURE, 5, 0.5), (1e300, None, None)):
            assert sample_next(penalised, t, k, p, gen).shape == (3,)
    for bad in ({"seed": 2**64}, {"seed": -1}, {"seed": 1.5}, {"temperature": float("nan")},
                {"temperature": float("inf")}, {"repetition_penalty": float("inf")}, {"repetition_penalty": 0},
                {"top_p": float("nan")}, {"top_k": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_the_worker_finishes_every_request_it_takes():
    """An exception escaping a step fails the requests the engine held (not the worker: it serves the next ones);
    a request the engine refuses is finished with its error; closing finishes the rest with "abort". Each notify
    is called once the request has finished."""
    import threading

    from zaya.serve.worker import EngineWorker

    engine = Engine(served_model(), num_slots=2, capacity=64)
    worker = EngineWorker(engine)
    done = {}

    def submit(request: Request) -> Request:
        event = done[request.id] = threading.Event()
        worker.submit(request, lambda: event.set() if request.finished else None)
        return request

    def wait(request: Request) -> None:
        assert done[request.id].wait(10), request

    step = engine.step
    engine.step = lambda: (_ for _ in ()).throw(RuntimeError("a bug in the step"))
    broken = [submit(Request(prompt=_prompt(5, i), max_tokens=4)) for i in range(3)]
    for r in broken:
        wait(r)
        assert r.finish_reason == "error" and "a bug in the step" in r.error
    engine.step = step
    refused = submit(Request(prompt=[1, 512], max_tokens=2))
    ok = submit(Request(prompt=_prompt(5, 9), max_tokens=3, sampling=SamplingParams(temperature=0)))
    for r in (refused, ok):
        wait(r)
    assert refused.finish_reason == "error" and "outside" in refused.error and ok.finish_reason == "length"
    running = [submit(Request(prompt=_prompt(5, i), max_tokens=56)) for i in range(3)]
    worker.close()
    late = submit(Request(prompt=_prompt(5, 1), max_tokens=2))
    for r in running + [late]:
        wait(r)
        assert r.finish_reason in ("abort", "length")
    assert late.finish_reason == "abort" and any(r.finish_reason == "abort" for r in running)


class _EvenTokens:
    """A constraint that allows only even token ids, and records what it was told."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(torch.arange(logits.shape[-1]) % 2 == 1, float("-inf"))

    def accept(self, token: int) -> None:
        self.accepted.append(token)


def test_a_constraint_restricts_only_its_own_request():
    """The engine masks a constrained request's logits before it samples (greedy included), tells the constraint
    every token it takes, and never speculates it; an unconstrained request beside it is untouched."""
    model = served_model()
    constraint = _EvenTokens()
    plain = Request(prompt=_prompt(7, 2), max_tokens=12, sampling=SamplingParams(temperature=0))
    constrained = [Request(prompt=_prompt(7, 1), max_tokens=12, sampling=SamplingParams(temperature=0),
                           constraint=constraint),
                   Request(prompt=_prompt(7, 1), max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=3),
                           constraint=_EvenTokens())]
    engine = Engine(model, num_slots=3, capacity=64, speculative_ngram=2)
    engine.run([plain, *constrained])
    for r in constrained:
        assert len(r.output) == 12 and all(t % 2 == 0 for t in r.output)
        assert r.constraint.accepted == r.output
    free = Engine(model, num_slots=1, capacity=64).run([Request(prompt=_prompt(7, 1), max_tokens=12,
                                                                 sampling=SamplingParams(temperature=0))])[0]
    assert any(t % 2 for t in free.output)  # the mask changed something
    assert plain.output == Engine(model, num_slots=1, capacity=64).run(
        [Request(prompt=_prompt(7, 2), max_tokens=12, sampling=SamplingParams(temperature=0))])[0].output


def test_a_request_is_submitted_once():
    """Submitting a request again (waiting, running or finished) is refused: two slots writing one request's
    progress would corrupt it."""
    engine = Engine(served_model(), num_slots=2, capacity=64)
    r = engine.submit(Request(prompt=_prompt(5, 1), max_tokens=3))
    with pytest.raises(ValueError, match="submitted before"):
        engine.submit(r)
    engine.step()
    with pytest.raises(ValueError, match="submitted before"):
        engine.run([r])
    while engine.busy:
        engine.step()
    with pytest.raises(ValueError, match="submitted before"):
        engine.submit(r)
