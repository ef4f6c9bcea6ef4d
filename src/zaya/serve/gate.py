"""What an HTTP request must pass before ``zaya serve``'s application reads it: the API key and the declared body size.

``Gate`` wraps the whole application (outside FastAPI's own middleware), so both are answered before a byte of the
body is read, with OpenAI-style error bodies:

- ``--api-key``: every route but ``/health`` needs ``Authorization: Bearer KEY``, as OpenAI clients send it
  (``openai.OpenAI(api_key=KEY)``); the key is compared in constant time (``hmac.compare_digest``). Otherwise a 401.
- ``--max-body-bytes``: a request whose ``content-length`` is larger is a 413 at once. A body sent without a length
  (chunked) is counted as it is read, by FastAPI's ``max_body_size``, and refused when it passes the limit.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

OPEN_PATHS = frozenset({"/health"})
API_KEY_ENV = "ZAYA_API_KEY"


class Gate:
    """An ASGI wrapper refusing HTTP requests without the bearer ``api_key`` (when one is set; ``OPEN_PATHS`` stay
    open) and those declaring a body over ``max_body_bytes``."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        if api_key is not None and not api_key:
            raise ValueError("the API key is empty")
        self.app, self.max_body_bytes = app, max_body_bytes
        self._key = api_key.encode("utf-8") if api_key else None

    async def __call__(self, scope, receive, send) -> None:
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
        await self.app(scope, receive, send)

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
