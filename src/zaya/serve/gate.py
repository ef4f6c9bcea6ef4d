"""What an HTTP request must pass before ``zaya serve``'s application reads it: the API key and the declared body size.

``Gate`` wraps the whole application (outside FastAPI's own middleware), so both are answered before a byte of the
body is read, with OpenAI-style error bodies:

- ``--api-key``: every route but ``/health`` and ``/metrics`` needs ``Authorization: Bearer KEY``, as OpenAI clients
  send it (``openai.OpenAI(api_key=KEY)``); the key is compared in constant time (``hmac.compare_digest``). Otherwise a 401.
- ``--max-body-bytes``: a request whose ``content-length`` is larger is a 413 at once. A body sent without a length
  (chunked) is counted as it is read, by FastAPI's ``max_body_size``, and refused when it passes the limit.

When the server stops (``stop_reading``, at the end of ``--shutdown-timeout``), a request still waiting for the rest
of its body is answered 503 at once: a client that sent its headers and half a body kept uvicorn waiting for the
rest until its own timeout cancelled the handler (8.3 s for a 3 s shutdown timeout). A request whose body is in is
left to the engine, which stops it.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json

OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Open without the API key, as in vLLM: a load balancer's health check and a Prometheus scraper hold no key."""
API_KEY_ENV = "ZAYA_API_KEY"
_DISCONNECT = {"type": "http.disconnect"}


class Gate:
    """An ASGI wrapper refusing HTTP requests without the bearer ``api_key`` (when one is set; ``OPEN_PATHS`` stay
    open) and those declaring a body over ``max_body_bytes``; after ``stop_reading`` its requests read no more."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        if api_key is not None and not api_key:
            raise ValueError("the API key is empty")
        self.app, self.max_body_bytes = app, max_body_bytes
        self._key = api_key.encode("utf-8") if api_key else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None

    def stop_reading(self) -> None:
        """From any thread: every request's pending and later reads answer that the client went away."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)

    def _reader(self, receive):
        """``receive``; until the body is complete, a read that ``stop_reading`` overtakes (or follows) is a 503
        (``HTTPException``, which FastAPI answers). Once the body is in, reads are ``receive``'s own: a running
        request is stopped by the engine, which ends its response cleanly."""
        complete = False

        async def read():
            nonlocal complete
            if complete:
                return await receive()
            message = None
            if not self._stopped.is_set():
                pending = asyncio.ensure_future(receive())
                stopped = asyncio.ensure_future(self._stopped.wait())
                try:
                    await asyncio.wait((pending, stopped), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    stopped.cancel()
                    if not pending.done():
                        pending.cancel()  # a request to cancel: the task is not cancelled yet
                if pending.done() and not pending.cancelled():
                    message = pending.result()
            if message is None:
                from fastapi import HTTPException  # the kind FastAPI's body reading passes on as it is

                raise HTTPException(503, "the server is stopping: the rest of this request's body did not come in "
                                         "time (--shutdown-timeout)")
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return read

    async def __call__(self, scope, receive, send) -> None:
        if self._loop is None:  # the first call (the lifespan's) runs on the server's loop
            self._loop, self._stopped = asyncio.get_running_loop(), asyncio.Event()
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.lower(): value for name, value in scope.get("headers", ())}
        if self._key is not None and scope.get("path") not in OPEN_PATHS and not self._authorized(headers):
            await _refuse(send, 401, "a valid API key is needed: send the header 'Authorization: Bearer KEY' with "
                                     f"the key this server was started with (--api-key or ${API_KEY_ENV})",
                          "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        declared = headers.get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await _refuse(send, 413, f"the request body is larger than this server takes ({self.max_body_bytes} "
                                     "bytes, --max-body-bytes)", "request_too_large", [(b"connection", b"close")])
            return
        await self.app(scope, self._reader(receive), send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


async def _refuse(send, status: int, message: str, code: str, extra_headers: list) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra_headers]})
    await send({"type": "http.response.body", "body": body})


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A warning when ``host`` is reachable from other machines and no API key guards the server."""
    if api_key or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return None
    except ValueError:  # a host name: it may resolve to anything
        pass
    return (f"serving on {host}, which other machines can reach, without an API key: anyone who can connect can "
            f"use the model; pass --api-key KEY (or set ${API_KEY_ENV}), or bind 127.0.0.1")
