"""GET /v1/models and /v1/models/{model}: the one model served, under each of its served names
(--served-model-name), with its context length, dtype and the platform it runs on."""

from __future__ import annotations

from fastapi import APIRouter

from treadle.server.openai.protocol import ModelCard, ModelList
from treadle.server.openai.serving import OpenAIServing


def models_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()
    engine = serving.engine

    @router.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in serving.model_names])

    @router.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        serving.check_model(model)
        return card(model)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=serving.created, max_model_len=engine.max_model_len,
                         dtype=engine.platform["dtype"], platform=engine.platform,
                         memory=engine.memory)

    return router
