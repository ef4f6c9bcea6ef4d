"""``zaya serve``: the engine behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with server-sent-event streaming that ends
in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``. The engine runs on one worker thread
(``EngineWorker``), which steps it while any request is queued or running; handlers submit requests to it and
await their progress, so many HTTP clients share each batched decode step (continuous batching). A request that
is invalid gets a 4xx with an OpenAI-style error body before it reaches the engine; an error inside a step fails
the requests of that step (500) and the server keeps serving. A client that disconnects mid-stream has its request
aborted and its slot freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import traceback
import uuid
from typing import AsyncIterator, Callable

from zaya.serve.api import APIError, ChatRequest, CompletionRequest, error_body
from zaya.serve.chat import ChatTemplate
from zaya.serve.engine import ContextLengthError, Engine
from zaya.serve.request import Request
from zaya.serve.sampling import SamplingParams

log = logging.getLogger("zaya.serve")


class EngineWorker:
    """Owns the engine on a daemon thread. ``submit(request, notify)`` queues a checked request; ``notify()`` is
    called on the worker thread after every step that changed it (and once when it finishes)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._notify: dict[int, Callable[[], None]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="zaya-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, notify: Callable[[], None]) -> None:
        self._inbox.put(("submit", request, notify))
        self._wake.set()

    def abort(self, request: Request) -> None:
        self._inbox.put(("abort", request, None))
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop:
            while True:
                try:
                    kind, request, notify = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit":
                    try:
                        engine.submit(request)
                        self._notify[request.id] = notify
                    except ValueError as exc:  # checked by the handler already; kept for safety
                        request.finish_reason = "error"
                        request.text = str(exc)
                        notify()
                else:
                    engine.abort(request)
                    self._notify.pop(request.id, None)
            if not engine.busy:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                changed = engine.step()
            except Exception:  # noqa: BLE001 - a bug in a step must not take the server down
                log.error("engine step failed:\n%s", traceback.format_exc())
                changed = []
                for active in list(engine.slots):
                    if active is not None:
                        engine.abort(active.request)
                        active.request.finish_reason = "error"
                        changed.append(active.request)
            for request in changed:
                notify = self._notify.get(request.id)
                if notify is not None:
                    notify()
                if request.finished:
                    self._notify.pop(request.id, None)


class _Tracked:
    """A request plus an asyncio event set from the worker thread whenever it progresses."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.changed = asyncio.Event()
        self._loop = loop

    def notify(self) -> None:
        self._loop.call_soon_threadsafe(self.changed.set)

    async def wait(self) -> None:
        await self.changed.wait()
        self.changed.clear()


def build_app(engine: Engine, tokenizer, model_name: str = "zaya", chat_template: ChatTemplate | None = None):
    """The FastAPI application serving ``engine`` (its worker starts with the app and stops with it)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    template = chat_template or ChatTemplate.for_tokenizer(tokenizer)
    eos = engine.model.config.eos_token_id
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        state["worker"] = EngineWorker(engine)
        try:
            yield
        finally:
            state.pop("worker").close()

    app = FastAPI(title="zaya", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        kind = first.get("type", "")
        if kind == "json_invalid":
            message = f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})"
        elif kind == "extra_forbidden":
            message = f"unknown field {'.'.join(loc)!r}"
        else:
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(message, param=".".join(loc) or None, code=kind or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), type="invalid_request_error"), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        log.error("request failed:\n%s", traceback.format_exc())
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", type="server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "zaya", "max_model_len": engine.capacity}]}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def make_request(body, prompt: list[int], max_tokens: int, stops: tuple[str, ...], logprobs: int | None,
                     prompt_logprobs: bool) -> Request:
        try:
            sampling = SamplingParams(temperature=float(body.temperature), top_k=body.top_k or None,
                                      top_p=float(body.top_p), repetition_penalty=float(body.repetition_penalty),
                                      seed=body.seed)
            request = Request(prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop=stops,
                              eos_token_id=eos, ignore_eos=body.ignore_eos, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs)
            engine.check(request)
        except ContextLengthError as exc:
            raise APIError(400, str(exc), param="messages" if isinstance(body, ChatRequest) else "prompt",
                           code="context_length_exceeded") from None
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return request

    async def run(requests: list[Request]) -> list[Request]:
        loop = asyncio.get_running_loop()
        tracked = [_Tracked(r, loop) for r in requests]
        try:
            for t in tracked:
                state["worker"].submit(t.request, t.notify)
            for t in tracked:
                while not t.request.finished:
                    await t.wait()
        except asyncio.CancelledError:
            for t in tracked:
                if not t.request.finished:
                    state["worker"].abort(t.request)
            raise
        for r in requests:
            if r.finish_reason == "error":
                raise APIError(500, "the engine failed while running this request", type="server_error")
        return requests

    async def stream(request: Request, chunk: Callable[[Request, int, int, bool], dict],
                     include_usage: bool, usage_chunk: Callable[[Request], dict]) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        t = _Tracked(request, loop)
        state["worker"].submit(request, t.notify)
        sent_text, sent_tokens = 0, 0
        try:
            while True:
                await t.wait()
                done = request.finished
                text_end, token_end = len(request.text), len(request.output)
                if request.finish_reason == "error":
                    yield f"data: {json.dumps(error_body('the engine failed', type='server_error'))}\n\n"
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

    def streaming(r: Request, chunk, body, rid: str, created: int, obj: str):
        """The SSE response of one streamed request (``chunk`` builds each event; usage last when asked)."""

        def usage_chunk(r: Request) -> dict:
            return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [],
                    "usage": usage([r])}

        include = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(r, chunk, include, usage_chunk), media_type="text/event-stream")

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
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        p = body.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError(400, "prompt: give at least one prompt", param="prompt")
        ids = [tokenizer.encode(x) if isinstance(x, str) else x for x in prompts]
        texts = [x if isinstance(x, str) else tokenizer.decode(x) for x in prompts]
        for x in ids:
            if not x:
                raise APIError(400, "prompt: a prompt has no tokens", param="prompt")
        want_prompt_lp = body.echo and body.logprobs is not None
        requests = [make_request(body, x, body.max_tokens, body.stops(), body.logprobs, want_prompt_lp) for x in ids]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            if len(requests) != 1:
                raise APIError(400, "stream: streaming takes one prompt per request", param="stream")
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

            return streaming(r, chunk, body, rid, created, "text_completion")
        await run(requests)
        choices = []
        for i, (r, text) in enumerate(zip(requests, texts)):
            out = (text if body.echo else "") + r.text
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(r, body.echo)
            choices.append({"index": i, "text": out, "logprobs": lp, "finish_reason": r.finish_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage(requests)}

    # ------------------------------------------------------------------------------------------- chat
    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        check_model(body.model)
        ids, template_stops = template.render([m.model_dump(exclude_none=True) for m in body.messages])
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = max(0, min(512, engine.capacity - len(ids)))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        r = make_request(body, ids, max_tokens, body.stops() + template_stops, logprobs, False)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def content_logprobs(r: Request, start: int) -> dict:
            return {"content": [{"token": token_text(lp.token), "logprob": lp.logprob,
                                 "bytes": list(token_text(lp.token).encode()),
                                 "top_logprobs": [{"token": token_text(t), "logprob": v,
                                                   "bytes": list(token_text(t).encode())} for t, v in lp.top]}
                                for lp in r.output_logprobs[start:]]}

        if body.stream:
            def chunk(r: Request, sent_text: int, sent_tokens: int, done: bool) -> dict:
                delta = {"content": r.text[sent_text:]}
                if sent_text == 0 and sent_tokens == 0:
                    delta["role"] = "assistant"
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                        "choices": [{"index": 0, "delta": delta,
                                     "logprobs": content_logprobs(r, sent_tokens) if body.logprobs else None,
                                     "finish_reason": r.finish_reason if done else None}]}

            return streaming(r, chunk, body, rid, created, "chat.completion.chunk")
        await run([r])
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                             "logprobs": content_logprobs(r, 0) if body.logprobs else None,
                             "finish_reason": r.finish_reason}],
                "usage": usage([r])}

    return app


def serve(model, tokenizer, host: str = "127.0.0.1", port: int = 8000, model_name: str = "zaya",
          num_slots: int = 16, capacity: int | None = None, prefill_chunk: int = 512) -> None:
    """Run the server until interrupted (uvicorn)."""
    import uvicorn

    engine = Engine(model, num_slots=num_slots, capacity=capacity, prefill_chunk=prefill_chunk,
                    decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    uvicorn.run(build_app(engine, tokenizer, model_name), host=host, port=port, log_level="info")
