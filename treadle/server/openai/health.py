"""Probes and metrics: /health (liveness) and /ready (readiness) answer the engine's status (ok,
stalled, restarting, dead, stopping), 503 unless ok; /metrics is Prometheus' text format, or
OpenMetrics with request-id exemplars.

A stalled engine is not restarted here, so liveness failing is what lets an orchestrator restart a
stuck server."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics import exposition as openmetrics_exposition

from treadle.frontend.async_engine import AsyncEngine


def health_router(engine: AsyncEngine) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        """Liveness: the engine's status, 503 unless ok."""
        status = engine.status
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        """Prometheus text format; OpenMetrics, with request-id exemplars, to a client that
        asks for it (Accept: application/openmetrics-text), as Prometheus does."""
        if "application/openmetrics-text" in request.headers.get("accept", ""):
            return Response(engine.metrics.render(openmetrics=True),
                            media_type=openmetrics_exposition.CONTENT_TYPE_LATEST)
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: the engine is alive and making progress."""
        ready = engine.is_ready()
        return JSONResponse({"ready": ready, "status": engine.status, **engine.load()},
                            status_code=200 if ready else 503)

    return router
