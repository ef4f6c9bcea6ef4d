"""``zaya serve``'s HTTP API through real clients (openai, httpx) against uvicorn on a free loopback port: the
completions and chat routes, streaming, echo/logprobs scoring, usage, models, health, and every bad request."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from serve_helpers import ServerThread, tiny_model


@pytest.fixture(scope="module")
def server(shakespeare_dataset):
    from zaya.data.tokenizer import Tokenizer
    from zaya.serve.engine import Engine
    from zaya.serve.server import build_app

    tok = Tokenizer.from_file(shakespeare_dataset / "tokenizer.json")
    model = tiny_model(vocab_size=512, max_seq_len=64)
    engine = Engine(model, num_slots=4, capacity=64, decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    with ServerThread(build_app(engine, tok, model_name="tiny")) as url:
        yield url, tok, model


def test_completions_chat_streaming_and_scoring(server):
    import openai

    url, tok, model = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}

    prompt = "ROMEO: I"
    ids = tok.encode(prompt)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    choice = out.choices[0]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(choice.logprobs.tokens)
    with torch.no_grad():  # greedy = argmax of the forward over the prompt and what was generated
        gen = model.generate(torch.tensor([ids]), out.usage.completion_tokens, temperature=0)[0, len(ids):]
    assert choice.text == tok.decode(gen.tolist(), skip_special_tokens=True)

    # streaming: the pieces add up to the same text, and the stream ends with [DONE]
    pieces = [c.choices[0].text for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                                                     temperature=0, stream=True)]
    assert "".join(pieces) == choice.text
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 3, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["usage"]["prompt_tokens"] == len(ids)

    # scoring: max_tokens 0 with echo returns every prompt token's log-probability (the first has none)
    scored = client.completions.create(model="tiny", prompt=[ids], max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert all(abs(v - ref[i, ids[i + 1]].item()) < 1e-4 for i, v in enumerate(lp.token_logprobs[1:]))

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Speak."}],
                                          max_tokens=5, temperature=0.7, seed=1)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 5
    again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Speak."}],
                                           max_tokens=5, temperature=0.7, seed=1)
    assert again.choices[0].message.content == chat.choices[0].message.content  # a seed reproduces
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Speak."}],
                                              max_tokens=5, temperature=0.7, seed=1, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content


BAD = [
    ({"prompt": "a", "bogus": 1}, "unknown field 'bogus'"),
    ({"prompt": "a", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "stream": 1}, "stream"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a " * 80, "max_tokens": 4}, "context"),
    ({"prompt": [[1, 99999]]}, "outside"),
    ({"prompt": ""}, "no tokens"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "a", "model": "other"}, "does not exist"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    url, _, _ = server
    for body, words in BAD:
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        error = r.json()["error"]
        assert words in error["message"] and error["type"] == "invalid_request_error", (body, error)
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "a",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    assert httpx.get(f"{url}/v1/nothing").status_code == 404
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
