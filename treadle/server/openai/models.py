"""GET /v1/models and /v1/models/{model}: the one model served, with its context length, dtype
and the platform it runs on."""

from __future__ import annotations

from fastapi import APIRouter

from treadle.server.openai.protocol import ModelCard, ModelList
from treadle.server.openai.serving import OpenAIServing


def models_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()
    engine = serving.engine

    @router.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.model_name, created=serving.created,
                                         max_model_len=engine.max_model_len,
                                         dtype=engine.platform["dtype"],
                                         platform=engine.platform)])

    @router.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        serving.check_model(model)
        return (await models()).data[0]

    return router
