"""ASGI middleware in front of the routes: request ids, API keys, the request body limit.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which would sit between a streaming
response and its client and hide the client's disconnect from the route.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from treadle.config import APIKey
from treadle.server.auth import APIKeys
from treadle.server.openai.errors import APIError


class RequestIdMiddleware:
    """Each request's id, held while it is served: the client's X-Request-Id sanitised and made
    unique by `reserve` (frontend/request_ids.py), or a fresh one; the routes key
    everything by it (`request.state.request_id`) and every response echoes it. Also when the
    request was received (`request.state.received`, time.monotonic()), where its latency
    breakdown starts."""

    def __init__(self, app: ASGIApp, reserve: Callable[[str | None], str],
                 release: Callable[[str], None]) -> None:
        self.app = app
        self.reserve = reserve
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        received = time.monotonic()
        request_id = self.reserve(Headers(scope=scope).get("x-request-id"))
        state = scope.setdefault("state", {})
        state["request_id"], state["received"] = request_id, received

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.release(request_id)


OPEN_PATHS = frozenset({"/health", "/ready"})  # probes, which carry no key


class APIKeyMiddleware:
    """With keys set, every route but the probes needs `Authorization: Bearer <key>`: the API,
    tokenizing, request timelines, the docs and the schema; /metrics too unless
    `metrics_without_auth` (for scrapers that cannot send a header); `open_paths` besides (the
    dashboard's page files, which hold no data). The key's name goes to the
    route as `request.state.api_key_name`: the request's tenant; the key itself as
    `request.state.api_key` (the adapters it may use)."""

    def __init__(self, app: ASGIApp, keys: list[str | APIKey],
                 metrics_without_auth: bool = False, open_paths: frozenset[str] = frozenset()
                 ) -> None:
        self.app = app
        self.keys = APIKeys(keys)
        self.open_paths = (OPEN_PATHS | open_paths
                           | ({"/metrics"} if metrics_without_auth else set()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            key = self.keys.find(Headers(scope=scope).get("authorization"))
            if key is None:
                error = APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                return await error.response()(scope, receive, send)
            state = scope.setdefault("state", {})
            state["api_key_name"], state["api_key"] = key.name, key
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
