"""GET /v1/requests/{id}/explain: why a recently finished request took the time it did.

Where its end-to-end time went (frontend, queue, prefill, preemption, decode, stream; the parts
sum to it) and one sentence naming the main cause (treadle/observability/explain.py). The id is
the one the response's X-Request-Id carried, or the response body's (`cmpl-...`,
`chatcmpl-...`); `id/index` for one of n samples, `id/p` for prompt p of a completions batch.
Behind the API key like every /v1 route, and served without --enable-debug-endpoints: it shows
no prompt or output text. A key reads its own tenant's requests only (the admin key, any).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from treadle.frontend.async_engine import AsyncEngine
from treadle.observability.explain import explain
from treadle.server.auth import records_scope
from treadle.server.openai.errors import APIError


def requests_router(engine: AsyncEngine) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/requests/{request_id:path}/explain")
    async def explain_request(request_id: str, request: Request) -> dict:
        """Where a recently finished request's time went, and its main cause."""
        timeline = engine.timeline(
            request_id, records_scope(getattr(request.state, "api_key_name", None)))
        if timeline is None:
            raise APIError(404, f"no recently finished request {request_id[:200]!r} (finished "
                           f"requests are kept for a while, then forgotten)",
                           param="request_id", code="request_not_found")
        return explain(timeline)

    return router
