"""``zaya serve``'s operator side: ``GET /metrics`` (Prometheus' format, open without the API key) moves by exactly
what a known set of requests did, its gauges fall back to 0 when the server is idle, and every finished request
leaves one key=value log line without its prompt."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from serve_helpers import ServerThread, post_json, served_model

KEY = "metrics-key"


@pytest.fixture(scope="module")
def server(shakespeare_dataset):
    from zaya.data.tokenizer import Tokenizer
    from zaya.serve.engine import Engine
    from zaya.serve.limits import ServeLimits
    from zaya.serve.server import build_app

    tok = Tokenizer.from_file(shakespeare_dataset / "tokenizer.json")
    engine = Engine(served_model(max_seq_len=64), num_slots=4, capacity=64,
                    decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    with ServerThread(build_app(engine, tok, model_name="tiny", limits=ServeLimits(api_key=KEY))) as url:
        yield url


def scrape(url: str) -> dict[tuple, float]:
    """Every sample of /metrics (fetched without the key) as {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def settled(url: str, finished: float) -> dict[tuple, float]:
    """/metrics once ``finished`` requests have been counted (a non-streaming reply can overtake the engine thread's
    record of its last step by a moment) and nothing runs."""
    deadline = time.time() + 10
    while True:
        m = scrape(url)
        done = sum(v for (name, _), v in m.items() if name == "zaya_requests_total")
        if done >= finished and m[("zaya_requests_running", ())] == 0:
            return m
        assert time.time() < deadline, m
        time.sleep(0.05)


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def call(url: str, route: str, body: dict) -> dict:
    r = post_json(f"{url}/v1/{route}", body, KEY)
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_move_by_what_the_requests_did(server):
    url = server
    before = scrape(url)
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "a"}).status_code == 401  # the API is still guarded
    done = sum(v for (name, _), v in before.items() if name == "zaya_requests_total")
    usages = [call(url, "completions", {"prompt": [5, 6, 7, 8], "max_tokens": 5, "ignore_eos": True})["usage"],
              call(url, "completions", {"prompt": ["ROMEO:", "JULIET: O"], "max_tokens": 3,
                                        "ignore_eos": True})["usage"],
              call(url, "completions", {"prompt": [9, 10], "max_tokens": 0, "echo": True, "logprobs": 0})["usage"]]
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line]
    usages.append(json.loads(lines[-2][6:])["usage"])
    after = settled(url, done + 5)

    assert [u["completion_tokens"] for u in usages] == [5, 6, 0, 4]
    assert delta(after, before, "zaya_requests_total", endpoint="/v1/completions", finish_reason="length") == 4
    assert delta(after, before, "zaya_requests_total", endpoint="/v1/chat/completions", finish_reason="length") == 1
    assert delta(after, before, "zaya_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta(after, before, "zaya_generation_tokens_total") == 15
    assert delta(after, before, "zaya_time_to_first_token_seconds_count") == 4  # max_tokens 0 samples nothing
    assert delta(after, before, "zaya_inter_token_latency_seconds_count") == 4 + 2 + 2 + 3
    assert delta(after, before, "zaya_e2e_request_latency_seconds_count") == 5
    assert delta(after, before, "zaya_inter_token_latency_seconds_bucket", le="+Inf") == 11
    assert after[("zaya_e2e_request_latency_seconds_sum", ())] > before.get(("zaya_e2e_request_latency_seconds_sum",
                                                                             ()), 0.0)
    assert after[("zaya_slots", ())] == 4 and after[("zaya_kv_cache_blocks", ())] == 4 * 64 // 16
    assert after[("zaya_kv_cache_block_tokens", ())] == 16
    for gauge in ("zaya_requests_waiting", "zaya_requests_running", "zaya_kv_cache_used_blocks"):
        assert after[(gauge, ())] == 0, gauge
    # the prompts looked up in the prefix cache: all but the one that wants prompt log-probabilities
    looked_up = usages[0]["prompt_tokens"] + usages[1]["prompt_tokens"] + usages[3]["prompt_tokens"]
    assert delta(after, before, "zaya_prefix_cache_queries_total") == looked_up


def test_prefix_cache_hits_and_blocks_are_counted(server):
    url = server
    before = scrape(url)
    done = sum(v for (name, _), v in before.items() if name == "zaya_requests_total")
    prompt = list(range(3, 43))  # 40 tokens: 2 full blocks of 16 reused by the second request
    for _ in range(2):
        call(url, "completions", {"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
    after = settled(url, done + 2)
    assert delta(after, before, "zaya_prefix_cache_queries_total") == 80
    assert delta(after, before, "zaya_prefix_cache_hits_total") == 32
    assert after[("zaya_kv_cache_cached_blocks", ())] >= 2 and after[("zaya_kv_cache_used_blocks", ())] == 0


def test_one_log_line_per_request_and_an_abort_counted(server, caplog):
    url = server
    caplog.set_level(logging.INFO, logger="zaya.serve")
    before = scrape(url)
    done = sum(v for (name, _), v in before.items() if name == "zaya_requests_total")
    out = call(url, "completions", {"prompt": ["ROMEO:", "JULIET: O"], "max_tokens": 3, "ignore_eos": True})
    with httpx.stream("POST", f"{url}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"prompt": "KING:", "max_tokens": 60, "ignore_eos": True, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):  # a client that leaves after the first events
            if i == 2:
                break
    after = settled(url, done + 3)
    assert delta(after, before, "zaya_requests_total", endpoint="/v1/completions", finish_reason="abort") == 1
    assert after[("zaya_requests_running", ())] == 0 and after[("zaya_kv_cache_used_blocks", ())] == 0

    lines = [rec.getMessage() for rec in caplog.records if rec.name == "zaya.serve" and
             rec.getMessage().startswith("request ")]
    assert len(lines) == 3, lines
    fields = [dict(part.split("=", 1) for part in line.split()[1:]) for line in lines]
    mine = sorted((f for f in fields if f["id"] == out["id"]), key=lambda f: f["index"])
    assert [f["index"] for f in mine] == ["0", "1"]
    for f, choice_tokens in zip(mine, [3, 3]):
        assert f["endpoint"] == "/v1/completions" and f["finish_reason"] == "length"
        assert int(f["output_tokens"]) == choice_tokens
        assert 0 < float(f["ttft_s"]) <= float(f["latency_s"])
    assert sum(int(f["prompt_tokens"]) for f in mine) == out["usage"]["prompt_tokens"]
    (aborted,) = [f for f in fields if f["id"] != out["id"]]
    assert aborted["finish_reason"] == "abort" and aborted["id"].startswith("cmpl-")
    assert all("ROMEO" not in line and "KING" not in line for line in lines)
