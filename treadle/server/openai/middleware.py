"""ASGI middleware in front of the routes: request ids, API keys, the request body limit.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which would sit between a streaming
response and its client and hide the client's disconnect from the route.
"""

from __future__ import annotations

import hmac
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from treadle.server.openai.errors import APIError


class RequestIdMiddleware:
    """Echo the client's X-Request-Id (or a fresh one) on every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def protected(path: str) -> bool:
    """What needs a key: the API and tokenizing; probes and the schema stay open."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


class APIKeyMiddleware:
    """Bearer auth against any of `keys`, compared in constant time."""

    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]

    def authorized(self, header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        presented = token.strip().encode("latin-1")  # how Starlette decoded the header
        # Compare against every key, so the time taken tells nothing about which one is near.
        matches = [hmac.compare_digest(presented, key) for key in self.keys]
        return scheme.lower() == "bearer" and any(matches)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and protected(scope["path"])
                and not self.authorized(Headers(scope=scope).get("authorization"))):
            error = APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`: at once when Content-Length says so, else as
    soon as the bytes read pass it. The body is read here, whole, before the route sees it (the
    routes parse whole JSON bodies anyway)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body exceeds {self.max_bytes} bytes")
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await too_large.response()(scope, receive, send)
        chunks, size, message = [], 0, {"type": "http.request", "more_body": True}
        while message["type"] == "http.request" and message.get("more_body", False):
            message = await receive()
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await too_large.response()(scope, receive, send)
        # The whole body as one message (or the disconnect that cut it short), then whatever
        # comes next: the disconnect a route may wait for.
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}
                   if message["type"] == "http.request" else message]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)
