"""GET /dashboard: the page; /dashboard/feed: its live data (SSE); /dashboard/requests/{id}: a
request's row and timeline for the page's request panel.

The page's three files are open (they hold no data, and a browser cannot put a key on a page
load); the feed and the request panel need the API key when keys are set. The page sends the key
as `Authorization: Bearer`, reading the feed with fetch rather than EventSource, which cannot set
a header: the key never goes into a URL the server logs.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from starlette.routing import Match

from treadle.frontend.async_engine import AsyncEngine
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


async def disconnected(request: Request) -> None:
    """Returns when the client has gone."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def dashboard_router(engine: AsyncEngine) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    pages = {path: ((STATIC / name).read_bytes(), media) for path, (name, media)
             in PAGE_FILES.items()}
    feeds: weakref.WeakSet = weakref.WeakSet()  # the feeds' generators still alive

    def page(path: str):
        body, media = pages[path]

        async def serve() -> Response:
            return Response(body, media_type=media, headers={"Cache-Control": "no-cache"})
        return serve

    for path in PAGE_FILES:
        router.add_api_route(path, page(path), methods=["GET"])

    def snapshot(cursor: int, explain: bool) -> tuple[int, str]:
        objectives = engine.admission.objectives(None, None)
        data = engine.live.snapshot(cursor, engine.num_blocks)
        data["engine"] = {"model": engine.model_name, "status": engine.status,
                          "num_blocks": engine.num_blocks, "max_model_len": engine.max_model_len,
                          "objectives": {"ttft": objectives[0], "tpot": objectives[1]},
                          "interval": FEED_SECONDS, "explain": explain}
        return data["cursor"], json.dumps(data, separators=(",", ":"))

    async def updates(request: Request, explain: bool) -> AsyncIterator[str]:
        cursor = 0
        # Ends at once when the page goes (not at the next write), and when the server stops,
        # so that a page left open never holds up a shutdown.
        gone = asyncio.ensure_future(disconnected(request))
        try:
            while engine.status not in ("stopping", "dead"):
                # Off the loop: the latency percentiles sort up to a minute of samples.
                cursor, data = await asyncio.to_thread(snapshot, cursor, explain)
                yield f"data: {data}\n\n"
                if (await asyncio.wait({gone}, timeout=FEED_SECONDS))[0]:
                    return
        finally:
            gone.cancel()

    @router.get("/dashboard/feed")
    async def feed(request: Request) -> StreamingResponse:
        if len(feeds) >= MAX_FEEDS:
            raise APIError(429, f"{MAX_FEEDS} dashboard feeds are open, the limit; close one",
                           code="too_many_feeds")
        stream = updates(request, has_explain(request.app))
        feeds.add(stream)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/requests/{request_id:path}")
    async def request_detail(request_id: str) -> dict:
        """A recent request's Gantt row and, once finished, its timeline (as
        /debug/requests/{id}, without that endpoint's flag: the page needs it)."""
        row = engine.live.row(request_id, time.monotonic())
        timeline = engine.timeline(request_id)
        if row is None and timeline is None:
            raise APIError(404, f"no recent request {request_id!r}", code="request_not_found")
        return {"row": row, "timeline": timeline}

    return router
