"""GET /dashboard: the page; /dashboard/feed: its live data (SSE); /dashboard/requests/{id}: a
request's row and timeline for the page's request panel.

The page's three files are open (they hold no data, and a browser cannot put a key on a page
load); the feed and the request panel need the API key when keys are set. The page sends the key
as `Authorization: Bearer`, reading the feed with fetch rather than EventSource, which cannot set
a header: the key never goes into a URL the server logs. A key sees its own tenant's requests
only (the admin key, every tenant's): the feed's rows and census, the request panel.

At most MAX_FEEDS feeds are open at once; a feed's slot is freed as its response ends, however
it ends.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from treadle.frontend.async_engine import AsyncEngine
from treadle.server.auth import records_scope
from treadle.server.openai.errors import APIError

STATIC = Path(__file__).parent / "static"
PAGE_FILES = {"/dashboard": ("index.html", "text/html; charset=utf-8"),
              "/dashboard/app.js": ("app.js", "text/javascript; charset=utf-8"),
              "/dashboard/style.css": ("style.css", "text/css; charset=utf-8")}
PAGE_PATHS = frozenset(PAGE_FILES)  # open with keys set: no data in them
FEED_SECONDS = 1.0  # one update a second: the page's pace, and the engine's census's
MAX_FEEDS = 16  # pages open at once: each costs a snapshot a second


def has_explain(app: FastAPI) -> bool:
    """Whether the app serves GET /v1/requests/{id}/explain: the page asks it only then, so
    that a server without it shows no failed requests in the browser's console."""
    probe = {"type": "http", "method": "GET", "path": "/v1/requests/probe/explain",
             "root_path": ""}
    return any(route.matches(probe)[0] == Match.FULL for route in app.routes)


def viewer(request: Request) -> str | None:
    """The tenant whose requests the caller may see (None: every tenant's)."""
    return records_scope(getattr(request.state, "api_key_name", None))


class FeedResponse(StreamingResponse):
    """A feed's response: `closed()` is called once it has ended, however (a client gone
    mid-write cancels the stream, and only the garbage collector would finish its generator)."""

    def __init__(self, content: AsyncIterator[str], closed: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.closed = closed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.closed()
            await self.body_iterator.aclose()


async def disconnected(request: Request) -> None:
    """Returns when the client has gone."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def dashboard_router(engine: AsyncEngine) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    pages = {path: ((STATIC / name).read_bytes(), media) for path, (name, media)
             in PAGE_FILES.items()}
    open_feeds = 0
    # The adapters a step may run (None: LoRA off, and the page hides its adapters table).
    config = engine.config.engine
    max_loras = config.scheduler.max_loras if config.model.enable_lora else None

    def page(path: str):
        body, media = pages[path]

        async def serve() -> Response:
            return Response(body, media_type=media, headers={"Cache-Control": "no-cache"})
        return serve

    for path in PAGE_FILES:
        router.add_api_route(path, page(path), methods=["GET"])

    def snapshot(cursor: int, explain: bool, tenant: str | None) -> tuple[int, str]:
        objectives = engine.admission.objectives(None, None)
        data = engine.live.snapshot(cursor, engine.num_blocks, tenant=tenant)
        data["engine"] = {"model": engine.model_name, "status": engine.status,
                          "num_blocks": engine.num_blocks, "max_model_len": engine.max_model_len,
                          "objectives": {"ttft": objectives[0], "tpot": objectives[1]},
                          "interval": FEED_SECONDS, "explain": explain,
                          "max_loras": max_loras}
        return data["cursor"], json.dumps(data, separators=(",", ":"))

    async def updates(request: Request, explain: bool) -> AsyncIterator[str]:
        tenant = viewer(request)
        cursor = 0
        # Ends at once when the page goes (not at the next write), and when the server stops,
        # so that a page left open never holds up a shutdown.
        gone = asyncio.ensure_future(disconnected(request))
        try:
            while engine.status not in ("stopping", "dead"):
                # Off the loop: the latency percentiles sort up to a minute of samples.
                cursor, data = await asyncio.to_thread(snapshot, cursor, explain, tenant)
                yield f"data: {data}\n\n"
                if (await asyncio.wait({gone}, timeout=FEED_SECONDS))[0]:
                    return
        finally:
            gone.cancel()

    def close_feed() -> None:
        nonlocal open_feeds
        open_feeds -= 1

    @router.get("/dashboard/feed")
    async def feed(request: Request) -> StreamingResponse:
        nonlocal open_feeds
        if open_feeds >= MAX_FEEDS:
            raise APIError(429, f"{MAX_FEEDS} dashboard feeds are open, the limit; close one",
                           code="too_many_feeds")
        open_feeds += 1
        return FeedResponse(updates(request, has_explain(request.app)), close_feed)

    @router.get("/dashboard/requests/{request_id:path}")
    async def request_detail(request_id: str, request: Request) -> dict:
        """A recent request's Gantt row and, once finished, its timeline (as
        /debug/requests/{id}, without that endpoint's flag: the page needs it)."""
        tenant = viewer(request)
        row = engine.live.row(request_id, time.monotonic(), tenant)
        timeline = engine.timeline(request_id, tenant)
        if row is None and timeline is None:
            raise APIError(404, f"no recent request {request_id!r}", code="request_not_found")
        return {"row": row, "timeline": timeline}

    return router
