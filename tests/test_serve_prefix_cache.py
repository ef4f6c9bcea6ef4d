"""Paged KV memory and prefix caching in the engine (``zaya.serve.engine``, ``zaya.model.slots``): a request that
starts from cached blocks (their keys and the CCA convolution / value-shift state kept after their last token)
gives exactly what a cold engine gives, whether the blocks came from a prompt's prefill, from decode steps, or from
speculative steps; a pool smaller than the slots' contexts makes requests wait, evicts idle cached blocks, and
never changes an output."""

from __future__ import annotations

import pytest
import torch

from serve_helpers import served_model
from zaya.serve.engine import ContextLengthError, Engine
from zaya.serve.request import Request
from zaya.serve.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _request(prompt: list[int], max_tokens: int = 9, sampling: SamplingParams = GREEDY, **kw) -> Request:
    return Request(prompt=list(prompt), max_tokens=max_tokens, sampling=sampling, logprobs=2, **kw)


def _cold(model, request: Request) -> Request:
    fresh = _request(request.prompt, request.max_tokens, request.sampling)
    return Engine(model, num_slots=1, capacity=128, prefix_caching=False).run([fresh])[0]


def _same(got: Request, want: Request) -> None:
    assert got.output == want.output and got.finish_reason == want.finish_reason
    for a, b in zip(got.output_logprobs, want.output_logprobs):  # fp32: chunked vs whole prefill rounding only
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4


@pytest.fixture(scope="module")
def model():
    return served_model()


def test_requests_that_start_from_a_cached_prefix_equal_a_cold_engine(model):
    shared = _tokens(23, 1)  # a system prompt: 5 full blocks of 4 and 3 tokens
    engine = Engine(model, num_slots=3, capacity=128, block_size=4)
    engine.run([_request(shared)])
    assert engine.prefix_hits == 0 and engine.decoder.pool.cached() >= 5
    later = [_request(shared + _tokens(k, 10 + k)) for k in (1, 6, 13)]  # suffixes within and across blocks
    later += [_request(shared[:20]),  # exactly 5 cached blocks: the last one is computed again for its logits
              _request(shared[:2] + _tokens(9, 3)),  # shares less than a block: nothing to reuse
              _request(shared + _tokens(5, 4), sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=7))]
    queried, hits = engine.prefix_queried, engine.prefix_hits
    engine.run(later)
    for got in later:
        _same(got, _cold(model, got))
    assert engine.prefix_queried - queried == sum(len(r.prompt) for r in later)
    assert engine.prefix_hits - hits == 5 * 4 * 4 + 4 * 4  # four requests reuse 5 blocks, the exact one 4


def test_a_chat_turn_reuses_blocks_its_previous_turn_decoded_and_speculated(model):
    """Turn 2's prompt holds turn 1's prompt and answer: the blocks the answer filled in decode steps (and, with
    prompt-lookup speculation, in verify steps, some drafts rejected) are reused, their CCA state included."""
    for speculative in (0, 3):
        engine = Engine(model, num_slots=2, capacity=128, block_size=4, speculative_ngram=speculative)
        first = _request(_tokens(10, 5) * 2, max_tokens=17)  # repeats itself: speculation drafts from it
        engine.run([first])
        _same(first, _cold(model, first))
        if speculative:
            assert engine.drafted > 0
        second = _request(first.prompt + first.output + _tokens(6, 6), max_tokens=8)
        hits = engine.prefix_hits
        engine.run([second])
        assert engine.prefix_hits - hits == (len(first.prompt) + len(first.output) - 1) // 4 * 4
        _same(second, _cold(model, second))


def test_a_small_pool_makes_requests_wait_and_evicts_idle_blocks_without_changing_outputs(model):
    shared = _tokens(12, 8)
    # 15 usable blocks of 4 tokens; each request needs 6 (12 + 9 + up to 3 prompt tokens, + 9 outputs): two run at
    # once in 3 slots, the third waits for blocks, and new prompts push out idle cached blocks
    engine = Engine(model, num_slots=3, capacity=64, block_size=4, kv_blocks=16)
    requests = [_request(shared + _tokens(3, 20 + i)) for i in range(4)]
    requests += [_request(_tokens(15, 30 + i)) for i in range(4)]
    held = []
    for r in requests:
        engine.submit(r)
    while engine.busy:
        engine.step()
        held.append(engine.decoder.pool.held())
        assert engine.decoder.pool.held() + engine._promised() <= 15
    assert max(held) <= 15 and engine.decoder.pool.evictions > 0 and engine.prefix_hits > 0
    for r in requests:
        _same(r, _cold(model, r))
    assert engine.decoder.pool.held() == 0
    with pytest.raises(ContextLengthError, match=r"need 16 KV blocks of 4 tokens, and the whole KV cache holds 15"):
        engine.submit(_request(_tokens(60, 1), max_tokens=4))


def test_prompt_logprobs_are_computed_from_the_whole_prompt(model):
    shared = _tokens(16, 9)
    engine = Engine(model, num_slots=1, capacity=128, block_size=4)
    engine.run([_request(shared)])
    r = engine.run([_request(shared + [5], prompt_logprobs=True)])[0]
    cold = Engine(model, num_slots=1, capacity=128, prefix_caching=False).run(
        [_request(shared + [5], prompt_logprobs=True)])[0]
    assert len(r.prompt_token_logprobs) == 17 and r.prompt_token_logprobs[0] is None
    assert [round(a.logprob, 4) for a in r.prompt_token_logprobs[1:]] == \
        [round(b.logprob, 4) for b in cold.prompt_token_logprobs[1:]]
