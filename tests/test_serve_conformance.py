"""OpenAI conformance of ``zaya serve`` through the official ``openai`` client's typed objects: every route (models
list and retrieve, completions and chat, with and without streaming), the shapes common clients send (content parts,
the developer role, presence / frequency penalties, logprobs, stop, seed) and errors as the client's typed
exceptions with OpenAI's status, code and param. One module-scoped server on the tiny model."""

from __future__ import annotations

import pytest

from serve_helpers import ServerThread, served_model

openai = pytest.importorskip("openai")

SPEAK = [{"role": "user", "content": "Speak, friend."}]


@pytest.fixture(scope="module")
def client(shakespeare_dataset):
    from zaya.data.tokenizer import Tokenizer
    from zaya.serve.engine import Engine
    from zaya.serve.server import build_app

    tok = Tokenizer.from_file(shakespeare_dataset / "tokenizer.json")
    engine = Engine(served_model(vocab_size=512, max_seq_len=64), num_slots=4, capacity=64,
                    decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    with ServerThread(build_app(engine, tok, model_name="tiny")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _chat(client, messages=SPEAK, **kwargs) -> str:
    kwargs = {"max_tokens": 16, "temperature": 0, **kwargs}
    return client.chat.completions.create(model="tiny", messages=messages, **kwargs).choices[0].message.content


def test_models_list_and_retrieve(client):
    listed = client.models.list().data
    assert [m.id for m in listed] == ["tiny"] and listed[0].object == "model"
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.owned_by == "zaya"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-9")
    assert caught.value.status_code == 404 and caught.value.code == "model_not_found"
    assert caught.value.type == "invalid_request_error" and caught.value.param == "model"


def test_completions_with_and_without_stream(client):
    out = client.completions.create(model="tiny", prompt="ROMEO: I", max_tokens=8, temperature=0.8, seed=3,
                                    logprobs=2)
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.tokens) == out.usage.completion_tokens
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    pieces = list(client.completions.create(model="tiny", prompt="ROMEO: I", max_tokens=8, temperature=0.8, seed=3,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in pieces if c.choices) == choice.text  # the seed reproduces
    assert pieces[-1].usage.completion_tokens == out.usage.completion_tokens

    greedy = client.completions.create(model="tiny", prompt="ROMEO: I", max_tokens=12, temperature=0).choices[0]
    stop = greedy.text[len(greedy.text) // 2:][:2]
    cut = client.completions.create(model="tiny", prompt="ROMEO: I", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == greedy.text[:greedy.text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_chat_shapes_penalties_logprobs_and_stream(client):
    plain = _chat(client)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Speak, "}, {"type": "text", "text": "friend."}]}]
    assert _chat(client, parts) == plain  # text parts are joined
    system = _chat(client, [{"role": "system", "content": "Be brief."}, *SPEAK])
    assert _chat(client, [{"role": "developer", "content": "Be brief."}, *SPEAK]) == system

    assert _chat(client, frequency_penalty=0, presence_penalty=0) == plain  # 0 is off
    assert _chat(client, frequency_penalty=2) != plain  # the greedy output repeats; a penalty changes it

    out = client.chat.completions.create(model="tiny", messages=SPEAK, max_tokens=6, temperature=0.7, seed=1,
                                         logprobs=True, top_logprobs=2, presence_penalty=0.5)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert len(choice.logprobs.content) == out.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    chunks = list(client.chat.completions.create(model="tiny", messages=SPEAK, max_tokens=6, temperature=0.7,
                                                 seed=1, presence_penalty=0.5, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.total_tokens == out.usage.total_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


@pytest.mark.parametrize("kwargs, code, param", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                 {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "invalid_value", "messages.0.content.1.type"),
    ({"extra_body": {"best_of": 2}}, "unknown_parameter", "best_of"),
    ({"temperature": "hot"}, "invalid_type", "temperature"),
    ({"presence_penalty": 2.5}, "invalid_value", "presence_penalty"),
    ({"n": 2}, "invalid_value", "n"),
    ({"messages": [{"role": "robot", "content": "a"}]}, "invalid_value", "messages.0.role"),
    ({"messages": [{"role": "user", "content": "a " * 80}], "max_tokens": 8}, "context_length_exceeded", "messages"),
])
def test_errors_are_the_clients_typed_exceptions(client, kwargs, code, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{"model": "tiny", "messages": SPEAK, "max_tokens": 2, **kwargs})
    error = caught.value
    assert (error.status_code, error.code, error.param, error.type) == (400, code, param, "invalid_request_error")
    if code == "invalid_value" and param.endswith("type"):
        assert "image_url" in error.message and "text parts only" in error.message
