"""The request-body bound of the HTTP app: a body larger than `args.limits.max_body_bytes` is answered 413 (OpenAI's
error shape) before it is read whole, whether its size is declared (Content-Length) or not (chunked), so no route
and no parser ever holds more than the bound.

An ASGI middleware, not a route check: FastAPI and Starlette read the body before a handler runs (JSON models,
multipart forms). The bound is set once per ingress replica (`configure`), like the API keys.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_max_bytes: int | None = None


def configure(max_bytes: int | None) -> None:
    """The bound for this process's app (None: unbounded)."""
    global _max_bytes
    _max_bytes = max_bytes


async def _too_large(send: Send, size: str, limit: int) -> None:
    body = json.dumps({"error": {"message": f"request body is too large: {size} bytes, at most {limit}",
                                 "type": "invalid_request_error", "param": None}}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: 413 for a declared length over the bound without reading anything; otherwise the body is
    read up to the bound (one byte more is a 413) and handed on whole."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = _max_bytes
        if scope["type"] != "http" or limit is None:
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _too_large(send, declared.decode(), limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _too_large(send, f"more than {limit}", limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)
