"""A bounded fuzz test of ``zaya serve``'s HTTP API (issue 32): hypothesis sends random and mutated bodies to every
route of a real server (uvicorn, a tiny model), while a well-formed seeded request runs again and again beside them.

Bodies: the valid completions and chat bodies mutated field by field (wrong types, huge / tiny / negative / NaN /
infinite numbers, lone surrogates, long lists, deep nesting, unknown fields, fields removed), garbage bytes, JSON
that is not an object, nesting 10**5 deep, wrong content types, wrong methods and unknown routes. Asserted: every
response is a 2xx or a 4xx (never a 500), with an OpenAI-style error body for a 4xx; nothing hangs (a client
timeout); a stream ends with ``[DONE]`` and no server error; the server is healthy after; and the concurrent request
gives, every time, exactly what it gives alone.

Fixed: the examples (``derandomize``), their number (``ZAYA_FUZZ_EXAMPLES``, default 500), no deadline. The figures
(bodies tried, the count of each status) are printed, and written as JSON to ``$ZAYA_FUZZ_REPORT`` when it is set
(benchmarks/results.md, "Serving: the HTTP API under fuzzing").
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_helpers import ServerThread, served_model

EXAMPLES = int(os.environ.get("ZAYA_FUZZ_EXAMPLES", "500"))
TIMEOUT_S = 30.0

COMPLETION = {"model": "tiny", "prompt": "ROMEO: I", "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
              "repetition_penalty": 1.1, "seed": 5, "stop": ["\n\n"], "stream": False, "echo": False,
              "logprobs": 1, "n": 1, "ignore_eos": False, "user": "fuzz"}
CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Speak"}],
        "max_tokens": 4, "temperature": 0.5, "seed": 3, "logprobs": True, "top_logprobs": 2, "stop": "x",
        "stream": False, "stream_options": {"include_usage": True}, "max_completion_tokens": 3}
CANARY = {"prompt": "JULIET: O", "max_tokens": 48, "temperature": 0.9, "top_k": 50, "seed": 123, "ignore_eos": True}

SURROGATES = ["\ud800", "\udfff", "a\udbffz", "\udc00\ud800"]
ints = st.one_of(st.integers(-3, 600), st.integers(), st.sampled_from(
    [0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 2**80, -(2**80), 10**100]))
floats = st.one_of(st.floats(), st.sampled_from([1e-45, 1e-300, 5e-324, -0.0, 1e308, -1e308, 0.5, 1.0, 2.0,
                                                 float("nan"), float("inf"), float("-inf")]))
texts = st.one_of(st.text(max_size=30), st.sampled_from(["", "tiny", "user", "system", "assistant", "<|eos|>",
                                                         "\x00", "\u202e", "x" * 600] + SURROGATES),
                  st.builds(lambda a, s, b: a + s + b, st.text(max_size=5), st.sampled_from(SURROGATES),
                            st.text(max_size=5)))
leaves = st.one_of(st.none(), st.booleans(), ints, floats, texts)
values = st.recursive(leaves, lambda children: st.lists(children, max_size=6)
                      | st.dictionaries(texts, children, max_size=4), max_leaves=12)
big = st.one_of(st.builds(lambda n, v: [v] * n, st.sampled_from([50, 1000, 5000]), leaves),
                st.builds(lambda n: [[1, 2]] * n, st.sampled_from([9, 33, 100])),
                st.builds(lambda n, v: _nest(v, n), st.sampled_from([2, 30, 300]), leaves))


unit = st.floats(0, 1).map(lambda x: x or 5e-324)
TYPED = {  # values of the right type near and at each field's limits: those reach the engine
    "temperature": st.one_of(st.floats(0, 100), st.sampled_from([1e-45, 1e-300, 5e-324, 1e-5, 9.99e-6, 100.0])),
    "top_p": st.one_of(unit, st.sampled_from([5e-324, 1e-300, 1e-45, 1.0])),
    "top_k": st.one_of(st.integers(0, 600), st.sampled_from([10**30, 2**63])),
    "repetition_penalty": st.one_of(st.floats(0.01, 100), st.sampled_from([0.01, 100.0, 1.0])),
    "seed": st.one_of(st.integers(0, 2**63 - 1), st.sampled_from([0, 2**63 - 1])),
    "max_tokens": st.integers(0, 130), "max_completion_tokens": st.integers(0, 130),
    "logprobs": st.one_of(st.integers(0, 20), st.booleans()), "top_logprobs": st.integers(0, 20),
    "prompt": st.one_of(texts, st.lists(st.integers(0, 511), min_size=1, max_size=40),
                        st.lists(st.lists(st.integers(0, 511), min_size=1, max_size=8), min_size=1, max_size=8),
                        st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=8)),
    "stop": st.one_of(texts, st.lists(st.text(max_size=8), max_size=16)),
    "echo": st.booleans(), "ignore_eos": st.booleans(), "stream": st.booleans(),
    "content": texts, "role": st.sampled_from(["system", "user", "assistant", "tool", "User"]),
}


def _nest(value, depth: int):
    for _ in range(depth):
        value = [value]
    return value


def _paths(body: dict) -> list[tuple]:
    """Every field of ``body`` as a path (those of the chat messages and stream options too), plus new ones."""
    paths = [(k,) for k in body] + [("bogus",), ("best_of",), ("logit_bias",)]
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, m in enumerate(messages):
            if isinstance(m, dict):
                paths += [("messages", i, k) for k in m] + [("messages", i, "bogus")]
    if isinstance(body.get("stream_options"), dict):
        paths.append(("stream_options", "include_usage"))
    return paths


@st.composite
def mutated(draw, base: dict) -> dict:
    body = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(body)))
        parent = body
        for p in path[:-1]:
            parent = parent[p]
        choice = draw(st.integers(0, 9))
        if choice == 0:
            parent.pop(path[-1], None)
        elif choice < 5 and path[-1] in TYPED:
            parent[path[-1]] = draw(TYPED[path[-1]])
        else:
            parent[path[-1]] = draw(st.one_of(values, big))
    return body


@st.composite
def requests(draw) -> tuple[str, str, dict, bytes]:
    """(method, path, headers, body bytes)."""
    kind = draw(st.sampled_from(["completion"] * 5 + ["chat"] * 5 + ["raw", "shape", "deep", "route"]))
    method, path = "POST", "/v1/completions"
    if kind == "completion":
        payload = draw(mutated(COMPLETION))
    elif kind == "chat":
        path, payload = "/v1/chat/completions", draw(mutated(CHAT))
    elif kind == "shape":
        payload = draw(values)
    if kind == "deep":  # 10**5 levels: more than Python's JSON reader (and writer) recurse
        depth = draw(st.sampled_from([10**4, 10**5]))
        opening, closing = draw(st.sampled_from([(b"[", b"]"), (b'{"prompt": ', b"}")]))
        raw = opening * depth + b"1" + closing * depth
    elif kind == "raw":
        raw = draw(st.one_of(st.binary(max_size=200), st.sampled_from(
            [b"", b"{", b'{"prompt": "a",', b"\xff\xfe\x00", b'{"prompt": "\\ud800"}', b'{"prompt": [1e999]}',
             b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}", b'{"prompt": "a"}' * 3])))
    else:
        raw = json.dumps(payload if kind != "route" else COMPLETION, allow_nan=True).encode()
    if kind == "route":
        method, path = draw(st.sampled_from([("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"),
                                             ("POST", "/v1/models"), ("POST", "/health"), ("GET", "/v1/nothing"),
                                             ("POST", "/v1/completions/../models"), ("DELETE", "/v1/models")]))
    elif kind in ("chat", "completion") and draw(st.integers(0, 5)) == 0:
        path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))  # the other route's body
    content_type = draw(st.sampled_from(["application/json"] * 6 + [
        "text/plain", "", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
        "application/json; charset=latin-1", "application/vnd.api+json"]))
    headers = {"content-type": content_type} if content_type else {}
    return method, path, headers, raw


@pytest.fixture(scope="module")
def fuzzed_server(shakespeare_dataset):
    from zaya.data.tokenizer import Tokenizer
    from zaya.serve.engine import Engine
    from zaya.serve.limits import ServeLimits
    from zaya.serve.server import build_app

    tok = Tokenizer.from_file(shakespeare_dataset / "tokenizer.json")
    engine = Engine(served_model(vocab_size=512, max_seq_len=128), num_slots=4, capacity=128,
                    decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    limits = ServeLimits(max_body_bytes=256 << 10, max_prompts=8)
    with ServerThread(build_app(engine, tok, model_name="tiny", limits=limits)) as url:
        yield url, engine


def _check(response: httpx.Response, streamed: bool) -> None:
    status = response.status_code
    assert 200 <= status < 300 or 400 <= status < 500, (status, response.text[:500])
    if status >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"], error
    elif streamed:
        lines = [line for line in response.text.splitlines() if line]
        assert lines[-1] == "data: [DONE]" and "server_error" not in response.text, response.text[-500:]
    else:
        response.json()


def test_the_http_api_under_fuzzing(fuzzed_server):
    url, engine = fuzzed_server
    statuses: Counter = Counter()
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        reference = client.post("/v1/completions", json=CANARY).json()["choices"][0]["text"]
        canary_runs, canary_bad, stop = [], [], threading.Event()

        def canary():
            with httpx.Client(base_url=url, timeout=TIMEOUT_S) as own:
                while not stop.is_set():
                    got = own.post("/v1/completions", json=CANARY)
                    (canary_runs if got.status_code == 200 and got.json()["choices"][0]["text"] == reference
                     else canary_bad).append(got.text[:300])

        runner = threading.Thread(target=canary)
        runner.start()
        start = time.time()

        @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(requests())
        def fuzz(req):
            method, path, headers, raw = req
            streamed = b'"stream": true' in raw
            response = client.request(method, path, content=raw, headers=headers)
            statuses[response.status_code] += 1
            _check(response, streamed)

        try:
            fuzz()
        finally:
            stop.set()
            runner.join(TIMEOUT_S)
        took = time.time() - start
        assert not runner.is_alive() and not canary_bad, canary_bad[:3]
        assert len(canary_runs) >= 2
        assert client.get("/health").json() == {"status": "ok"}
        assert client.post("/v1/completions", json=CANARY).json()["choices"][0]["text"] == reference
    deadline = time.time() + 10
    while engine.busy:
        assert time.time() < deadline, "requests left running in the engine"
        time.sleep(0.05)
    classes = Counter(f"{s // 100}xx" for s in statuses.elements())
    report = {"bodies": sum(statuses.values()), "classes": dict(sorted(classes.items())),
              "statuses": {str(k): v for k, v in sorted(statuses.items())}, "canary_runs": len(canary_runs),
              "seconds": round(took, 1)}
    print(f"\nfuzz: {json.dumps(report)}")
    if os.environ.get("ZAYA_FUZZ_REPORT"):
        with open(os.environ["ZAYA_FUZZ_REPORT"], "w") as f:
            json.dump(report, f, indent=2)
    assert report["bodies"] >= EXAMPLES and set(classes) <= {"2xx", "4xx"}
