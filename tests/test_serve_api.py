"""``zaya serve``'s HTTP API through real clients (openai, httpx) against uvicorn on a free loopback port: the
completions and chat routes, streaming, echo/logprobs scoring, usage, models, health, every bad request, and what a
hostile client cannot do (fail another request, hang one, pass the limits, skip the API key)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import httpx
import pytest
import torch

from serve_helpers import ServerThread, post_json, served_model
from zaya.serve.generate import generate


@pytest.fixture(scope="module")
def server(shakespeare_dataset):
    from zaya.data.tokenizer import Tokenizer
    from zaya.serve.engine import Engine
    from zaya.serve.server import build_app

    tok = Tokenizer.from_file(shakespeare_dataset / "tokenizer.json")
    model = served_model(vocab_size=512, max_seq_len=64)
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
        gen = generate(model, torch.tensor([ids]), out.usage.completion_tokens, temperature=0)[0, len(ids):]
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


BAD = [  # body, words in the message, OpenAI's code
    ({"prompt": "a", "bogus": 1}, "unknown field 'bogus'", "unknown_parameter"),
    ({"prompt": "a", "max_tokens": "3"}, "max_tokens", "invalid_type"),
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens", "invalid_type"),
    ({"prompt": "a", "temperature": "hot"}, "temperature", "invalid_type"),
    ({"prompt": "a", "stream": 1}, "stream", "invalid_type"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens", "invalid_value"),
    ({"prompt": "a", "top_p": 0}, "top_p", "invalid_value"),
    ({"prompt": "a", "frequency_penalty": 2.5}, "frequency_penalty", "invalid_value"),
    ({"prompt": "a " * 80, "max_tokens": 4}, "context", "context_length_exceeded"),
    ({"prompt": [[1, 99999]]}, "outside", "invalid_token_id"),
    ({"prompt": ""}, "no tokens", "invalid_value"),
    ({"max_tokens": 3}, "prompt", "missing_required_parameter"),
    ({"prompt": "a", "model": "other"}, "does not exist", "model_not_found"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    url, _, _ = server
    for body, words, code in BAD:
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        error = r.json()["error"]
        assert words in error["message"] and error["type"] == "invalid_request_error", (body, error)
        assert error["code"] == code, (body, error)
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "a",', headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and "not valid JSON" in error["message"]
    assert error["param"] is None and error["code"] == "invalid_json", error
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    assert httpx.get(f"{url}/v1/nothing").status_code == 404
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


# ----------------------------------------------------------------------------------------------- hostile clients
KEY = "sekrit-key"


@pytest.fixture(scope="module")
def guarded(shakespeare_dataset):
    """A server with an API key and small limits whose steps are slowed (a 10 ms decode per request and token), so
    that requests are still running while others arrive; ``submitted`` records what reached the engine."""
    from zaya.data.tokenizer import Tokenizer
    from zaya.serve.engine import Engine
    from zaya.serve.limits import ServeLimits
    from zaya.serve.server import build_app

    tok = Tokenizer.from_file(shakespeare_dataset / "tokenizer.json")

    def slow_decode(ids):
        time.sleep(0.01)
        return tok.decode(ids, skip_special_tokens=True)

    engine = Engine(served_model(vocab_size=512, max_seq_len=128), num_slots=4, capacity=128, decode=slow_decode)
    submitted = []
    submit = engine.submit
    engine.submit = lambda r: (submitted.append(r), submit(r))[1]
    limits = ServeLimits(api_key=KEY, max_body_bytes=64 << 10, max_prompts=4)
    with ServerThread(build_app(engine, tok, model_name="tiny", limits=limits)) as url:
        yield url, engine, submitted


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def test_tiny_sampling_values_never_fail_a_concurrent_request(guarded):
    """Temperatures and top-p values that underflow fp32 made torch.multinomial raise inside the shared step, and
    every request in it got a 500: now each is served (greedy below 1e-5) and a request running beside them gives
    exactly what it gives alone."""
    url, engine, submitted = guarded
    normal = {"prompt": "ROMEO: I", "max_tokens": 60, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    alone = post_json(f"{url}/v1/completions", normal, KEY)
    assert alone.status_code == 200
    results = {}
    runner = threading.Thread(target=lambda: results.setdefault("normal", post_json(f"{url}/v1/completions",
                                                                                    normal, KEY)))
    before = len(submitted)
    runner.start()
    _wait_for(lambda: len(submitted) > before and len(submitted[before].output) >= 3)
    hostile = [{"temperature": t} for t in (1e-45, 1e-300, 5e-324, 1e-6)] + [
        {"top_p": 1e-300}, {"top_p": 5e-324, "top_k": 1}, {"temperature": 1e-40, "repetition_penalty": 0.01},
        {"temperature": 100, "repetition_penalty": 100, "top_k": 10**30}]
    answers = [None] * len(hostile)

    def send(i, extra):
        answers[i] = post_json(f"{url}/v1/completions", {"prompt": "ROMEO:", "max_tokens": 8, **extra}, KEY)

    senders = [threading.Thread(target=send, args=(i, h)) for i, h in enumerate(hostile)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(30)
    assert not submitted[before].finished  # the hostile ones ran while the normal one did
    runner.join(30)
    for extra, answer in zip(hostile, answers):
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1, (extra, answer.text)
    assert results["normal"].status_code == 200
    assert results["normal"].json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]


HOSTILE_400 = [
    ({"prompt": "a", "seed": 2**64}, "seed"), ({"prompt": "a", "seed": 2**63}, "seed"), ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": [-1]}, "prompt"), ({"prompt": [2**80]}, "prompt"), ({"prompt": [[5, 512]]}, "prompt"),
    ({"prompt": [[1], [-(2**70)]], "echo": True}, "prompt"),
    ({"prompt": "\ud800"}, "prompt"), ({"prompt": ["ok", "x\udfff"]}, "prompt.1"),
    ({"prompt": "a", "stop": ["\ud800"]}, "stop"), ({"prompt": "a", "user": "\udc00"}, "user"),
    ({"prompt": "a", "model": "\ud83d"}, "model"),
    ({"prompt": "a", "temperature": float("nan")}, "temperature"), ({"prompt": "a", "top_p": float("inf")}, "top_p"),
    ({"prompt": "a", "repetition_penalty": 1e-45}, "repetition_penalty"),
    ({"prompt": "a", "temperature": 10**400}, "temperature"), ({"prompt": "a", "stop": ["x"] * 17}, "stop"),
    ({"prompt": "a", "max_tokens": 2**80}, "prompt"), ({"prompt": ["a"] * 5}, "prompt"),
]


def test_hostile_values_are_400s_naming_the_field_on_a_connection_kept_alive(guarded):
    """A seed of 2**64 hung its request (and failed the others); token ids -1 / 2**80 and lone surrogates were 500s
    that reset the connection. Each is now a 400 naming the field, and the same keep-alive connection serves the
    next request."""
    url, _, _ = guarded
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    chat = [({"messages": [{"role": "user", "content": "\udbff"}]}, "messages.0.content"),
            ({"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, "messages.0.name"),
            ({"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "seed")]
    for path, cases in (("/v1/completions", HOSTILE_400), ("/v1/chat/completions", chat)):
        for body, param in cases:
            raw = json.dumps(body).encode().replace(b"NaN", b"NaN").replace(b"\\u", b"\\u")
            conn.request("POST", path, body=raw, headers=headers)
            r = conn.getresponse()
            error = json.loads(r.read())["error"]
            assert r.status == 400 and error["param"] is not None and error["param"].startswith(param), (body, error)
            assert param.split(".")[0] in error["message"] and error["type"] == "invalid_request_error"
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "a", "max_tokens": 2}), headers=headers)
    assert conn.getresponse().status == 200


def test_body_limit_and_prompt_cap(guarded):
    """A body over --max-body-bytes is a 413 while it is read (declared or chunked), with an OpenAI-style body;
    more prompts than --max-prompts are a 400; /health stays open meanwhile."""
    url, engine, _ = guarded
    big = {"prompt": "x" * (70 << 10)}
    r = post_json(f"{url}/v1/completions", big, KEY)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

    def chunks():  # no content-length: the limit is counted as the body arrives
        for _ in range(40):
            yield b"[" * 4096

    r = httpx.post(f"{url}/v1/completions", content=chunks(), timeout=20,
                   headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = post_json(f"{url}/v1/completions", {"prompt": [[1, 2]] * 5, "max_tokens": 1}, KEY)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_prompts"
    r = post_json(f"{url}/v1/completions", {"prompt": [[1, 2]] * 4, "max_tokens": 1}, KEY)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_api_key_through_the_openai_client(guarded):
    """--api-key: the openai client's Bearer header is checked on every route but /health (401 with an
    OpenAI-style body otherwise)."""
    import openai

    from zaya.serve.gate import exposure_warning

    url, _, _ = guarded
    for key in ("none", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as caught:
            openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0).models.list()
        assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "a"})
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="a", max_tokens=2).usage.completion_tokens <= 2
    assert exposure_warning("0.0.0.0", None) and exposure_warning("example.org", None)
    assert not exposure_warning("0.0.0.0", KEY) and not exposure_warning("127.0.0.1", None)
    assert not exposure_warning("::1", None) and not exposure_warning("localhost", None)


def test_a_non_streaming_request_whose_client_leaves_is_aborted(guarded):
    """The slot of a non-streaming request is freed when its client disconnects (it ran to the end before)."""
    url, engine, submitted = guarded
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 120, "ignore_eos": True}).encode()
    before = len(submitted)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        _wait_for(lambda: len(submitted) > before and len(submitted[before].output) >= 2)
    request = submitted[before]
    _wait_for(lambda: request.finished, timeout=5)
    assert request.finish_reason == "abort" and len(request.output) < 120
    _wait_for(lambda: not engine.busy, timeout=5)


def test_a_huge_prompt_stalls_nothing(server):
    """A 4 MB prompt (under the default body limit) is refused as too long for the context after its first chunk
    is counted, without holding the GIL: /health answers meanwhile (it stalled 6-12 s while the whole prompt was
    tokenized on the event loop or with the GIL held)."""
    url, _, _ = server
    answer = {}
    body = {"prompt": "To be, or not to be " * 200_000}
    sender = threading.Thread(target=lambda: answer.setdefault("r", post_json(f"{url}/v1/completions", body)))
    sender.start()
    worst = 0.0
    while sender.is_alive():
        start = time.time()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        worst = max(worst, time.time() - start)
        time.sleep(0.02)
    r = answer["r"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert worst < 2.0, f"/health took {worst:.1f} s"
