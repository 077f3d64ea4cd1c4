"""ASGI middleware of the server: the request-body size limit and per-status request counts.

``BodySizeLimit`` answers 413 with OpenAI's error body when a request's body is longer than
``max_bytes``: at once when ``Content-Length`` says so, else as soon as the streamed body passes
the limit (a chunked upload is never buffered past it). ``StatusCounter`` counts every answered
request by route and status code (``pagedkv_http_requests_total``); unknown paths share the
route label ``"other"`` so a scanner cannot grow the label set.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
"""8 MiB: far above what a prompt of any supported ``max_model_len`` needs as text or ids."""


def _too_large_message(max_bytes: int) -> str:
    return f"request body is larger than {max_bytes} bytes (--max-request-bytes)"


class BodySizeLimit:
    """Refuse request bodies over ``max_bytes`` with 413 (``request_too_large``)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await _send_413(send, limit)
                return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # FastAPI passes HTTPException from the body read on
                    raise HTTPException(413, _too_large_message(limit))
            return message

        await self.app(scope, limited, send)


async def _send_413(send: Send, limit: int) -> None:
    body = json.dumps(
        {
            "error": {
                "message": _too_large_message(limit),
                "type": "invalid_request_error",
                "param": None,
                "code": "request_too_large",
            }
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class StatusCounter:
    """Count each answered request by route and status (``count(route, status)`` is called
    once per request, when its response starts)."""

    def __init__(
        self, app: ASGIApp, routes: Collection[str], count: Callable[[str, int], None]
    ) -> None:
        self.app = app
        self.routes = frozenset(routes)
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in self.routes else "other"
        if route == "other" and path.startswith("/v1/models/"):
            route = "/v1/models/{model_id}"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.count(route, int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)
