"""GET /v1/models and /v1/models/{model}: the one model served, under each of its served names
(--served-model-name), with its context length, dtype and the platform it runs on, and its LoRA
adapters (`parent`: the base), those the caller's key may use; POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's), behind the API key as every route, and refused (403) to keys
bound to adapters."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from treadle.server.openai.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from treadle.server.openai.serving import OpenAIServing, api_key


def models_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()
    engine = serving.engine

    @router.get("/v1/models")
    async def models(request: Request) -> ModelList:
        return ModelList(data=[card(name) for name in serving.model_names]
                         + [card(name) for name in serving.loras.names(api_key(request))])

    @router.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> ModelCard:
        serving.check_model(model, request)
        return card(model)

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> str:
        serving.check_may_manage_adapters(request)
        serving.loras.load(body.lora_name, body.lora_path)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> str:
        serving.check_may_manage_adapters(request)
        serving.loras.unload(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def card(name: str) -> ModelCard:
        parent = serving.model_name if serving.loras.get(name) is not None else None
        return ModelCard(id=name, created=serving.created, max_model_len=engine.max_model_len,
                         dtype=engine.platform["dtype"], platform=engine.platform,
                         memory=engine.memory, parent=parent)

    return router
