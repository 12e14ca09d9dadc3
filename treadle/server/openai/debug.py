"""GET /debug/requests/{id} (--enable-debug-endpoints): a recently finished request's timeline;
a key reads its own tenant's only (the admin key, any)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from treadle.frontend.async_engine import AsyncEngine
from treadle.server.auth import records_scope
from treadle.server.openai.errors import APIError


def debug_router(engine: AsyncEngine) -> APIRouter:
    router = APIRouter()

    @router.get("/debug/requests/{request_id:path}")
    async def debug_request(request_id: str, request: Request) -> dict:
        """A recently finished request's timeline (`id/index` for one of n samples)."""
        timeline = engine.timeline(
            request_id, records_scope(getattr(request.state, "api_key_name", None)))
        if timeline is None:
            raise APIError(404, f"no recently finished request {request_id!r}",
                           param="request_id", code="request_not_found")
        return timeline

    return router
