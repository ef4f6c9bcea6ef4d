"""What an operator sees of ``zaya serve``: Prometheus metrics (``GET /metrics``) and one log line per request.

``ServeMetrics(engine)`` keeps its metrics in a registry of its own (several servers in one process do not
collide). Requests are measured on the engine's thread, by the ``notify`` callback the worker calls after every step
that changed a request and once when it finishes (``track`` wraps it): the sampled ids are on the host by then, so
measuring adds no device sync. Gauges read the engine when scraped (``Engine.occupancy``). Every metric is listed
in docs/serving.md, "Metrics and logs".

The log line (logger ``zaya.serve``, INFO), one per finished engine request, key=value, no prompt text::

    request id=cmpl-1f.. endpoint=/v1/completions index=0 prompt_tokens=5 output_tokens=8 ttft_s=0.0123
    latency_s=0.2345 finish_reason=length

(one line; ``error="..."`` follows when the request failed; ``ttft_s=-`` when no token was sampled).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from zaya.serve.engine import Engine
from zaya.serve.request import Request

log = logging.getLogger("zaya.serve")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
"""Seconds: a GPU's first token in milliseconds, a CPU's or a long queue's in seconds to minutes (vLLM's range)."""
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0)
"""Seconds between tokens: a GPU decode step takes milliseconds, a CPU one tens to hundreds."""
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0)


class ServeMetrics:
    """The metrics of one server over ``engine`` (``zaya_`` names; docs/serving.md)."""

    def __init__(self, engine: Engine) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("zaya_requests", "Requests finished by the engine, by endpoint and finish reason "
                                "(stop, length, abort, error).", ["endpoint", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("zaya_prompt_tokens", "Prompt tokens prefilled (counted when a request's "
                                     "prefill completes).", registry=r)
        self.generation_tokens = Counter("zaya_generation_tokens", "Output tokens generated (as in usage: an eos "
                                         "is not one).", registry=r)
        self.ttft = Histogram("zaya_time_to_first_token_seconds", "Seconds from a request's submission to the "
                              "engine to its first sampled token.", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("zaya_inter_token_latency_seconds", "Seconds between two sampled tokens of a request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.latency = Histogram("zaya_e2e_request_latency_seconds", "Seconds from a request's submission to the "
                                 "engine to its finish.", buckets=LATENCY_BUCKETS, registry=r)
        Gauge("zaya_requests_waiting", "Requests waiting for a slot.", registry=r).set_function(
            lambda: engine.occupancy()[0])
        Gauge("zaya_requests_running", "Requests holding a slot (prefilling or decoding).", registry=r).set_function(
            lambda: engine.occupancy()[1])
        Gauge("zaya_slots", "Sequences decoded at once at most (--max-num-seqs).", registry=r).set(engine.num_slots)
        pool = engine.decoder.pool
        Gauge("zaya_kv_cache_used_blocks", "KV blocks held by running requests.", registry=r).set_function(
            lambda: engine.occupancy()[2])
        Gauge("zaya_kv_cache_cached_blocks", "KV blocks holding a cached prompt prefix (held or idle).",
              registry=r).set_function(pool.cached)
        Gauge("zaya_kv_cache_blocks", "KV blocks in the pool (--kv-cache-memory).", registry=r).set(pool.usable)
        Gauge("zaya_kv_cache_block_tokens", "Tokens per KV block (--block-size).", registry=r).set(engine.block_size)

        r.register(_EngineCounters(engine))

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)

    def track(self, request: Request, endpoint: str, rid: str, index: int,
              notify: Callable[[], None]) -> Callable[[], None]:
        """``notify`` measuring ``request`` first (give it to ``EngineWorker.submit``): ``rid`` and ``index`` are
        the HTTP response's id and the choice's index, for the log line."""
        return _Clock(self, request, endpoint, rid, index, notify)


class _Clock:
    """One request's timings, advanced on the engine's thread each time the worker notifies it."""

    def __init__(self, metrics: ServeMetrics, request: Request, endpoint: str, rid: str, index: int,
                 notify: Callable[[], None]) -> None:
        self.metrics, self.request, self.endpoint, self.rid, self.index = metrics, request, endpoint, rid, index
        self.notify = notify
        self.start = time.monotonic()
        self.first: float | None = None
        self.last = 0.0
        self.tokens = 0
        self.done = False

    def __call__(self) -> None:
        try:
            if not self.done:
                self._measure(time.monotonic())
        finally:
            self.notify()

    def _measure(self, now: float) -> None:
        m, r = self.metrics, self.request
        grown = len(r.output) - self.tokens
        self.tokens += grown
        m.generation_tokens.inc(grown)
        sampled = grown + (r.finish_reason == "stop" and grown == 0)  # an eos ends the output without joining it
        if sampled and self.first is None:
            self.first = self.last = now
            m.ttft.observe(now - self.start)
            m.prompt_tokens.inc(len(r.prompt))
            sampled -= 1
        if sampled:
            for _ in range(sampled):
                m.itl.observe((now - self.last) / sampled)
            self.last = now
        if not r.finished:
            return
        self.done = True
        if self.first is None and r.finish_reason == "length":  # max_tokens 0: the prompt scored, nothing sampled
            m.prompt_tokens.inc(len(r.prompt))
        m.requests.labels(self.endpoint, r.finish_reason).inc()
        m.latency.observe(now - self.start)
        ttft = "-" if self.first is None else f"{self.first - self.start:.4f}"
        line = (f"request id={self.rid} endpoint={self.endpoint} index={self.index} prompt_tokens={len(r.prompt)} "
                f"output_tokens={len(r.output)} ttft_s={ttft} latency_s={now - self.start:.4f} "
                f"finish_reason={r.finish_reason}")
        if r.error:
            line += f" error={json.dumps(r.error)}"
        log.info(line)


class _EngineCounters:
    """Counters the engine keeps, read when scraped: prompt-lookup speculation's draft tokens verified and kept
    (``Engine.drafted`` / ``accepted``, 0 without ``--speculative-ngram``; kept / verified is the acceptance rate),
    prompt tokens looked up in the prefix cache and found there (``prefix_queried`` / ``prefix_hits``; found /
    looked up is the hit rate), and cached blocks evicted."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        e = self.engine
        for name, doc, value in (
                ("zaya_spec_decode_draft_tokens", "Draft tokens verified by speculative decoding.", e.drafted),
                ("zaya_spec_decode_accepted_tokens", "Draft tokens speculative decoding kept.", e.accepted),
                ("zaya_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", e.prefix_queried),
                ("zaya_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again).",
                 e.prefix_hits),
                ("zaya_kv_cache_evictions", "Cached KV blocks reclaimed for new tokens.", e.decoder.pool.evictions)):
            yield CounterMetricFamily(name, doc, value=value)
