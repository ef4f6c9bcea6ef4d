"""``zaya serve``: the engine behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with server-sent-event streaming that ends
in ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``. The engine runs on one thread
(``zaya.serve.worker``); handlers submit requests to it and await their progress, so many HTTP clients share each
batched decode step (continuous batching).

What a client cannot do to the server or to other clients (docs/serving.md, "What is checked"):

- every error is a 4xx with an OpenAI-style body before the request reaches the engine: a body over
  ``max_body_bytes`` (413, refused while it is read), a field out of range (``zaya.serve.api``), a token id outside
  the vocabulary (checked before anything decodes it), more than ``max_prompts`` prompts, a prompt longer than the
  context; with an API key, a request without it (401);
- tokenization, the chat template (in its sandboxed child process) and building a response run off the event loop,
  so ``/health`` and the streams stay responsive;
- a request the engine fails, fails alone (a 500 naming what failed); a client that goes away, streaming or not, has
  its request aborted and its slot freed;
- on SIGTERM / SIGINT, requests still running after ``shutdown_timeout`` seconds are cancelled and the server exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

from starlette.requests import Request as HTTPRequest

from zaya.data.tokenizer import TokenizerFailure
from zaya.core.errors import ConfigError
from zaya.model.slots import SlotMemoryError
from zaya.serve.api import APIError, ChatRequest, CompletionRequest, describe_validation_error, error_body
from zaya.serve.gate import Gate, exposure_warning
from zaya.serve.chat import ChatTemplate, ChatTemplateError
from zaya.serve.engine import ContextLengthError, Engine
from zaya.serve.kv_budget import describe, kv_blocks
from zaya.serve.limits import ServeLimits, context_length
from zaya.serve.metrics import ServeMetrics
from zaya.serve.prompt import encode_prompt
from zaya.serve.request import Request
from zaya.serve.sampling import SamplingParams
from zaya.serve.structured import Grammars
from zaya.serve.tools import ReplyStream, chat_constraint, reply
from zaya.serve.worker import EngineWorker

log = logging.getLogger("zaya.serve")

DISCONNECT_POLL_S = 0.25
"""How often a non-streaming handler asks whether its client is still there."""
SHUTDOWN_BACKSTOP_S = 2.0
"""After SIGTERM, seconds past ``--shutdown-timeout`` when uvicorn cancels whatever handler is still running."""


class _Tracked:
    """A request plus an asyncio event set from the worker thread whenever it progresses."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.changed = asyncio.Event()
        self._loop = loop

    def notify(self) -> None:
        self._loop.call_soon_threadsafe(self.changed.set)

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait for progress; False when ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self.changed.wait(), timeout)
        except TimeoutError:
            return False
        self.changed.clear()
        return True


def build_app(engine: Engine, tokenizer, model_name: str = "zaya", chat_template: ChatTemplate | None = None,
              limits: ServeLimits | None = None):
    """The FastAPI application serving ``engine`` (its worker starts with the app and stops with it)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    class ASCIIJSONResponse(JSONResponse):
        """JSON with non-ASCII characters escaped: a string a client sent (an unknown field's name with a lone
        surrogate) is echoed in an error without failing to encode."""

        def render(self, content) -> bytes:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")

    limits = limits or ServeLimits()
    template = chat_template or ChatTemplate.for_tokenizer(tokenizer, timeout=limits.template_timeout,
                                                           max_chars=limits.template_chars)
    eos = engine.model.config.eos_token_id
    metrics = ServeMetrics(engine)
    grammars = Grammars(tokenizer, eos)
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        state["worker"] = app.state.engine_worker = EngineWorker(engine)
        state["templates"] = ThreadPoolExecutor(1, thread_name_prefix="zaya-template")
        try:
            yield
        finally:
            state.pop("templates").shutdown(wait=False, cancel_futures=True)
            state.pop("worker").close()
            template.close()

    class GatedFastAPI(FastAPI):
        """FastAPI behind ``Gate`` (the API key, the declared body size), outside all of its own middleware."""

        def build_middleware_stack(self):
            self.state.gate = Gate(super().build_middleware_stack(), limits.api_key, limits.max_body_bytes)
            return self.state.gate

    app = GatedFastAPI(title="zaya", lifespan=lifespan, max_body_size=limits.max_body_bytes,
                       default_response_class=ASCIIJSONResponse)

    def error(status: int, body: dict):
        return ASCIIJSONResponse(body, status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error(exc.status, exc.body())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        message, param, code = describe_validation_error(list(exc.errors()))
        return error(400, error_body(message, param=param, code=code))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        if exc.status_code == 413:
            return error(413, error_body(f"the request body is larger than this server takes "
                                         f"({limits.max_body_bytes} bytes, --max-body-bytes)",
                                         code="request_too_large"))
        return error(exc.status_code, error_body(str(exc.detail)))

    @app.exception_handler(TokenizerFailure)
    async def _tokenizer(_, exc: TokenizerFailure):  # decoding this request's output (encoding is a 400 below)
        return error(500, error_body(str(exc), type="server_error", code="tokenizer_failed"))

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        log.error("request failed:\n%s", traceback.format_exc())
        return error(500, error_body(f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST
        from starlette.responses import Response

        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "zaya",
                "max_model_len": engine.capacity}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return model_card()

    def make_request(body, prompt: list[int], max_tokens: int, stops: tuple[str, ...], logprobs: int | None,
                     prompt_logprobs: bool, constraint=None) -> Request:
        try:
            sampling = SamplingParams(temperature=body.temperature, top_k=body.top_k or None, top_p=body.top_p,
                                      repetition_penalty=body.repetition_penalty,
                                      presence_penalty=body.presence_penalty,
                                      frequency_penalty=body.frequency_penalty, seed=body.seed)
            request = Request(prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop=stops,
                              eos_token_id=eos, ignore_eos=body.ignore_eos, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, constraint=constraint)
            engine.check(request)
        except ContextLengthError as exc:
            raise APIError(400, str(exc), param="messages" if isinstance(body, ChatRequest) else "prompt",
                           code="context_length_exceeded") from None
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        return request

    async def run(requests: list[Request], http: HTTPRequest, rid: str) -> None:
        """Submit ``requests`` (the response ``rid``'s) and wait until all have finished; aborted when the client
        goes away."""
        loop = asyncio.get_running_loop()
        tracked = [_Tracked(r, loop) for r in requests]
        try:
            for i, t in enumerate(tracked):
                state["worker"].submit(t.request, metrics.track(t.request, http.url.path, rid, i, t.notify))
            checked = time.monotonic()
            for t in tracked:
                while not t.request.finished:
                    await t.wait(DISCONNECT_POLL_S)
                    if time.monotonic() - checked >= DISCONNECT_POLL_S:
                        checked = time.monotonic()
                        if await http.is_disconnected():
                            raise APIError(499, "the client closed the connection", code="client_closed")
        finally:
            for t in tracked:
                if not t.request.finished:
                    state["worker"].abort(t.request)
        for r in requests:
            check_finished(r)

    def check_finished(r: Request) -> None:
        if r.finish_reason == "error":
            raise APIError(500, f"the engine failed on this request: {r.error}", type="server_error",
                           code="engine_error")
        if r.finish_reason == "abort":
            raise APIError(503, f"the request was stopped: {r.error or 'aborted'}", type="server_error",
                           code="aborted")

    async def stream(request: Request, chunk: Callable[[Request, int, int, bool], dict],
                     include_usage: bool, usage_chunk: Callable[[Request], dict], endpoint: str,
                     rid: str) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        t = _Tracked(request, loop)
        state["worker"].submit(request, metrics.track(request, endpoint, rid, 0, t.notify))
        sent_text, sent_tokens = 0, 0
        try:
            while True:
                await t.wait()
                done = request.finished
                text_end, token_end = len(request.text), len(request.output)
                if request.finish_reason in ("error", "abort"):
                    kind = "the engine failed on this request" if request.finish_reason == "error" else "stopped"
                    body = error_body(f"{kind}: {request.error}", type="server_error")
                    yield f"data: {json.dumps(body)}\n\n"
                    break
                if text_end > sent_text or done:
                    yield f"data: {json.dumps(chunk(request, sent_text, sent_tokens, done))}\n\n"
                    sent_text, sent_tokens = text_end, token_end
                if done:
                    break
            if include_usage:
                yield f"data: {json.dumps(usage_chunk(request))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not request.finished:
                state["worker"].abort(request)

    def streaming(r: Request, chunk, body, rid: str, created: int, obj: str, endpoint: str):
        """The SSE response of one streamed request to ``endpoint`` (``chunk`` builds each event; usage last when
        asked)."""

        def usage_chunk(r: Request) -> dict:
            return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [],
                    "usage": usage([r])}

        include = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(r, chunk, include, usage_chunk, endpoint, rid),
                                 media_type="text/event-stream")

    def usage(requests: list[Request]) -> dict:
        p = sum(len(r.prompt) for r in requests)
        c = sum(len(r.output) for r in requests)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def token_text(token: int) -> str:
        return tokenizer.decode([token])

    def completion_logprobs(r: Request, echo: bool, offset: int = 0) -> dict:
        entries = []
        if echo:
            entries += list(zip(r.prompt, r.prompt_token_logprobs))
        entries += list(zip(r.output, r.output_logprobs))
        tokens, values, tops, offsets = [], [], [], []
        position = offset
        for token, lp in entries:
            s = token_text(token)
            tokens.append(s)
            offsets.append(position)
            position += len(s)
            values.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else {token_text(t): v for t, v in lp.top})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    # ------------------------------------------------------------------------------------------- completions
    def completion_requests(body: CompletionRequest) -> tuple[list[Request], list[str]]:
        """The engine requests of a completions body and the prompts' texts (in the thread pool: tokenizing a
        long prompt takes a while). Token ids are checked against the vocabulary before anything decodes them."""
        p = body.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError(400, "prompt: give at least one prompt", param="prompt", code="invalid_value")
        if len(prompts) > limits.max_prompts:
            raise APIError(400, f"prompt: {len(prompts)} prompts in one request; this server takes at most "
                                f"{limits.max_prompts} (--max-prompts): send them in several requests",
                           param="prompt", code="too_many_prompts")
        for x in prompts:
            if not isinstance(x, str) and x and not (0 <= min(x) and max(x) < engine.vocab_size):
                bad = next(t for t in x if not 0 <= t < engine.vocab_size)
                raise APIError(400, f"prompt: token id {bad} is outside the vocabulary [0, {engine.vocab_size})",
                               param="prompt", code="invalid_token_id")
        try:
            prefix = tokenizer.prefix_ids  # a text prompt starts as generate's and transformers' do
            ids = [prefix + encode_prompt(tokenizer, x, engine.capacity) if isinstance(x, str) else x
                   for x in prompts]
        except ContextLengthError as exc:
            raise APIError(400, str(exc), param="prompt", code="context_length_exceeded") from None
        except TokenizerFailure as exc:
            raise APIError(400, f"the model's tokenizer cannot encode this prompt: {exc}", param="prompt",
                           code="tokenizer_failed") from None
        for x in ids:
            if not x:
                raise APIError(400, "prompt: a prompt has no tokens", param="prompt", code="invalid_value")
        want_prompt_lp = body.echo and body.logprobs is not None
        requests = [make_request(body, x, body.max_tokens, body.stops(), body.logprobs, want_prompt_lp)
                    for x in ids]
        texts = [x if isinstance(x, str) else tokenizer.decode(x) for x in prompts] if body.echo else []
        return requests, texts

    def completion_response(body: CompletionRequest, requests: list[Request], texts: list[str], rid: str,
                            created: int) -> dict:
        choices = []
        for i, r in enumerate(requests):
            out = (texts[i] if body.echo else "") + r.text
            lp = completion_logprobs(r, body.echo) if body.logprobs is not None else None
            choices.append({"index": i, "text": out, "logprobs": lp, "finish_reason": r.finish_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage(requests)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        check_model(body.model)
        requests, texts = await run_in_threadpool(completion_requests, body)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            if len(requests) != 1:
                raise APIError(400, "stream: streaming takes one prompt per request", param="stream",
                               code="invalid_value")
            r, echo_text = requests[0], texts[0] if body.echo else ""

            def chunk(r: Request, sent_text: int, sent_tokens: int, done: bool) -> dict:
                text = r.text[sent_text:]
                lp = None
                if body.logprobs is not None:
                    lp = completion_logprobs(Request(prompt=r.prompt, output=r.output[sent_tokens:],
                                                     output_logprobs=r.output_logprobs[sent_tokens:],
                                                     prompt_token_logprobs=r.prompt_token_logprobs),
                                             body.echo and sent_tokens == 0 and sent_text == 0)
                if sent_text == 0 and sent_tokens == 0:
                    text = echo_text + text
                return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                        "choices": [{"index": 0, "text": text, "logprobs": lp,
                                     "finish_reason": r.finish_reason if done else None}]}

            return streaming(r, chunk, body, rid, created, "text_completion", http.url.path)
        await run(requests, http, rid)
        return await run_in_threadpool(completion_response, body, requests, texts, rid, created)

    # ------------------------------------------------------------------------------------------- chat
    def render_chat(body: ChatRequest) -> tuple[list[int], tuple[str, ...]]:
        try:
            return template.render(body.template_messages(), engine.capacity, body.template_tools())
        except ContextLengthError as exc:
            raise APIError(400, str(exc), param="messages", code="context_length_exceeded") from None
        except TokenizerFailure as exc:
            raise APIError(400, f"the model's tokenizer cannot encode this conversation: {exc}", param="messages",
                           code="tokenizer_failed") from None
        except ChatTemplateError as exc:
            if exc.client_error:
                raise APIError(400, str(exc), param="messages", code="chat_template_refused") from None
            raise APIError(500, str(exc), type="server_error", code="chat_template_failed") from None

    def chat_request(body: ChatRequest, ids: list[int], template_stops: tuple[str, ...]) -> Request:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = max(0, min(512, engine.capacity - len(ids)))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return make_request(body, ids, max_tokens, body.stops() + template_stops, logprobs, False,
                            chat_constraint(body, grammars))

    def content_logprobs(r: Request, start: int) -> dict:
        return {"content": [{"token": token_text(lp.token), "logprob": lp.logprob,
                             "bytes": list(token_text(lp.token).encode()),
                             "top_logprobs": [{"token": token_text(t), "logprob": v,
                                               "bytes": list(token_text(t).encode())} for t, v in lp.top]}
                            for lp in r.output_logprobs[start:]]}

    def chat_response(body: ChatRequest, r: Request, rid: str, created: int) -> dict:
        message, finish_reason = reply(r.text, r.finish_reason, body.tool_names())
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": message,
                             "logprobs": content_logprobs(r, 0) if body.logprobs else None,
                             "finish_reason": finish_reason}],
                "usage": usage([r])}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest):
        check_model(body.model)
        body.check_tools()
        if template.jinja is not None:  # its own thread: a slow template delays no tokenization
            ids, template_stops = await asyncio.get_running_loop().run_in_executor(state["templates"],
                                                                                   render_chat, body)
        else:
            ids, template_stops = await run_in_threadpool(render_chat, body)
        r = await run_in_threadpool(chat_request, body, ids, template_stops)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        if body.stream:
            replies = ReplyStream(body.tool_names())

            def chunk(r: Request, sent_text: int, sent_tokens: int, done: bool) -> dict:
                delta, finish_reason = replies.delta(r.text, done, r.finish_reason)
                if sent_text == 0 and sent_tokens == 0:
                    delta["role"] = "assistant"
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                        "choices": [{"index": 0, "delta": delta,
                                     "logprobs": content_logprobs(r, sent_tokens) if body.logprobs else None,
                                     "finish_reason": finish_reason}]}

            return streaming(r, chunk, body, rid, created, "chat.completion.chunk", http.url.path)
        await run([r], http, rid)
        return await run_in_threadpool(chat_response, body, r, rid, created)

    return app


def serve(model, tokenizer, host: str = "127.0.0.1", port: int = 8000, model_name: str = "zaya",
          num_slots: int = 16, capacity: int | None = None, prefill_chunk: int = 512,
          limits: ServeLimits | None = None, speculative_ngram: int = 0, speculative_tokens: int = 4,
          kv_cache_memory: int | None = None, block_size: int = 16, prefix_caching: bool = True,
          compile: bool = False) -> None:
    """Run the server until SIGTERM / SIGINT (uvicorn). ``num_slots`` sequences at once of up to ``capacity``
    tokens, whose keys and values share a pool of ``kv_cache_memory`` bytes (None: ``zaya.serve.kv_budget``'s
    default) in blocks of ``block_size`` tokens; ``prefix_caching``: reuse cached prompt prefixes;
    ``speculative_*``: the engine's prompt-lookup speculation; ``compile``: the decode step under torch.compile. The signal stops new connections; requests still
    running ``limits.shutdown_timeout`` seconds later are stopped (a 503, or an error event ending the stream), and
    the server exits. A second SIGINT exits at once."""
    import uvicorn

    limits = limits or ServeLimits()
    warning = exposure_warning(host, limits.api_key)
    if warning:
        print(f"# warning: {warning}", file=sys.stderr)
    capacity = context_length(capacity, model.config.max_seq_len)
    blocks = kv_blocks(model, num_slots, capacity, block_size, kv_cache_memory, prefix_caching)
    try:  # the memory is checked before any of it is allocated
        engine = Engine(model, num_slots=num_slots, capacity=capacity, prefill_chunk=prefill_chunk,
                        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                        speculative_ngram=speculative_ngram, speculative_tokens=speculative_tokens,
                        block_size=block_size, kv_blocks=blocks, prefix_caching=prefix_caching, compile=compile)
    except SlotMemoryError as exc:
        raise ConfigError(f"{exc.what}: pass fewer --max-num-seqs (now {num_slots}), a smaller --max-model-len "
                          f"(now {capacity}), the context each sequence may reach, or a smaller "
                          f"--kv-cache-memory") from None
    print(f"# KV cache: {describe(blocks, block_size, model, prefix_caching)}, "
          f"prefix caching {'on' if prefix_caching else 'off'}, decode step {'compiled' if compile else 'eager'}",
          file=sys.stderr)
    app = build_app(engine, tokenizer, model_name, limits=limits)
    if not log.handlers:  # the requests' lines (zaya.serve.metrics) on stderr beside uvicorn's
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:  # the grace period, then the engine stops what still runs: every handler then returns
                timer = threading.Timer(limits.shutdown_timeout, _stop_requests, args=(app,))
                timer.daemon = True
                timer.start()

    # uvicorn's own timeout only backs ours up (a client that reads no response): it cancels the handlers (a
    # traceback for each in the log)
    Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                          timeout_graceful_shutdown=limits.shutdown_timeout + SHUTDOWN_BACKSTOP_S)).run()


def _stop_requests(app) -> None:
    """The end of the grace period: the engine stops what still runs, and requests still reading a body read no
    more (a client that sent half of one is told it went away): every handler then returns."""
    worker = getattr(app.state, "engine_worker", None)
    if worker is not None:
        worker.stop_requests()
    gate = getattr(app.state, "gate", None)
    if gate is not None:
        gate.stop_reading()
