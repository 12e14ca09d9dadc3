"""The OpenAI-compatible REST app: one router per endpoint family over one AsyncEngine, behind the
middleware (request ids, CORS, API keys, the body limit) and OpenAI-shaped errors.

| module | routes |
|---|---|
| completions | POST /v1/completions |
| chat | POST /v1/chat/completions |
| embeddings | POST /v1/embeddings |
| models | GET /v1/models, /v1/models/{model} |
| tokenization | POST /tokenize, /detokenize |
| health | GET /health, /ready, /metrics |
| debug | GET /debug/requests/{id} (with enable_debug_endpoints) |
| requests | GET /v1/requests/{id}/explain |
| server/dashboard | GET /dashboard (the live page), /dashboard/feed, /dashboard/requests/{id} |

What the generating routes share (admission, context checks, the generate loop, streaming, error
mapping) is in `serving`. The engine and the gRPC frontend are started and stopped by the
launcher (treadle.server.launcher), not here: the app's lifespan only builds its token table.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware

from treadle.config import ServerConfig
from treadle.frontend.async_engine import AsyncEngine
from treadle.server.chat_template import chat_tokenizer
from treadle.server.dashboard.router import PAGE_PATHS, dashboard_router
from treadle.server.openai.chat import chat_router
from treadle.server.openai.completions import completions_router
from treadle.server.openai.debug import debug_router
from treadle.server.openai.embeddings import embeddings_router
from treadle.server.openai.errors import install_error_handlers
from treadle.server.openai.health import health_router
from treadle.server.openai.logprobs import TokenTable
from treadle.server.openai.lora_adapters import LoraAdapters
from treadle.server.openai.middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
)
from treadle.server.openai.models import models_router
from treadle.server.openai.requests import requests_router
from treadle.server.openai.serving import ClientDisconnected, OpenAIServing
from treadle.server.openai.tokenization import tokenize_router


def build_app(engine: AsyncEngine, config: ServerConfig, loras: LoraAdapters | None = None
              ) -> FastAPI:
    """The REST app over `engine`, which the caller starts before serving it. From `config`:
    api_keys (Bearer keys for every route but /health and /ready, and /metrics unless
    metrics_without_auth; none: open), allowed_origins (CORS), max_request_bytes,
    enable_debug_endpoints, chat_template (replacing the model's own), served_model_name,
    sse_keepalive_interval (root_path is uvicorn's: the launcher's). `loras`: the adapters
    served, shared with the gRPC frontend (None: lora_modules's, this app's own). ValueError
    for a chat template that is neither a file nor a template that parses."""
    if loras is None:
        loras = LoraAdapters.served(config, engine.config.engine.model)
    serving = OpenAIServing(engine, chat_tokenizer(engine.tokenizer, config.chat_template),
                            config.served_model_name, config.sse_keepalive_interval,
                            config.tool_call_parser, loras)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Each token's text and bytes, for logprobs: once, off the event loop.
        serving.tokens = await asyncio.to_thread(TokenTable, engine.tokenizer)
        yield

    app = FastAPI(title="Treadle", summary="An OpenAI-compatible LLM server", lifespan=lifespan)
    install_error_handlers(app)

    async def client_gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    app.add_exception_handler(ClientDisconnected, client_gone)
    # The last added runs first: ids on every response, CORS (a preflight carries no key), the
    # key, then the body limit, so that no one without a key can make the server read a body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=list(config.api_keys),
                           metrics_without_auth=config.metrics_without_auth,
                           open_paths=PAGE_PATHS)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(RequestIdMiddleware, reserve=engine.request_ids.reserve,
                       release=engine.request_ids.release)
    app.include_router(health_router(engine))
    app.include_router(dashboard_router(engine))
    if config.enable_debug_endpoints:
        app.include_router(debug_router(engine))
    app.include_router(models_router(serving))
    app.include_router(requests_router(engine))
    app.include_router(tokenize_router(serving))
    app.include_router(completions_router(serving))
    app.include_router(chat_router(serving))
    app.include_router(embeddings_router(serving))
    return app
