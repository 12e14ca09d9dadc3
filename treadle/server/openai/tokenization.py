"""POST /tokenize and /detokenize (vLLM's routes): a prompt or a chat's messages to token ids,
token ids to text."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from treadle.server.openai.errors import APIError
from treadle.server.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from treadle.server.openai.serving import OpenAIServing


def tokenize_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()
    engine = serving.engine

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        serving.check_model(body.model, request)
        if body.messages is not None:
            tokens = await serving.apply_template(body.messages, body.add_generation_prompt)
        else:
            serving.check_prompt_texts([body.prompt])
            tokens = (await serving.encode([body.prompt], body.add_special_tokens))[0]
        return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len,
                                tokens=tokens)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        serving.check_model(body.model, request)
        vocab = len(serving.table.texts)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be token ids in [0, {vocab}), got {bad[0]}",
                           param="tokens")
        text = await asyncio.to_thread(engine.tokenizer.decode, body.tokens)
        return DetokenizeResponse(prompt=text)

    return router
