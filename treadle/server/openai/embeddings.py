"""POST /v1/embeddings: a string, a list of strings, token ids or a list of token-id lists, each
embedded as the served model's final hidden states pooled (`--pooling`: the last token's, or the
mean) and L2-normalised.

Each input runs as a prefill-only engine request through the same scheduler as generation, so
embeddings share batches with chat and completions; its KV blocks are freed (and its full blocks
left in the prefix cache) when its prompt is computed. `encoding_format` base64 is OpenAI's:
little-endian float32, base64-encoded (the official client asks for it by default). A decoder LLM
is not Matryoshka-trained, so `dimensions` is refused with a 400, as vLLM refuses it for such
models.
"""

from __future__ import annotations

import base64
import struct
import uuid

from fastapi import APIRouter, Request

from treadle.core.sampling_params import SamplingParams
from treadle.frontend.admission import EngineOverloaded
from treadle.frontend.supervisor import EngineUnavailable
from treadle.server.openai.errors import APIError
from treadle.server.openai.protocol import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from treadle.server.openai.serving import (
    OpenAIServing,
    RequestContext,
    count_prompts,
    engine_error,
    request_context,
)
from treadle.server.validation import check_prompt_text

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs
# Only n=1 matters to a pooling request: nothing is sampled.
POOLING_PARAMS = SamplingParams(max_tokens=1)


def admit(serving: OpenAIServing, body: EmbeddingRequest, request: Request) -> RequestContext:
    """Refuse a request for another model, one asking for `dimensions`, or one the queue or its
    tenant's limits cannot take, before any costly work; its tenant."""
    serving.check_model(body.model, request)
    if body.dimensions is not None:
        raise APIError(400, f'Model "{serving.model_name}" does not support matryoshka '
                       f"representation, changing output dimensions will lead to poor results.",
                       param="dimensions", code="unsupported_value")
    try:
        admitted = serving.engine.admit(getattr(request.state, "api_key_name", None), body.user,
                                        num_prompts=count_prompts(body.input),
                                        prompt_field="input")
    except (EngineUnavailable, EngineOverloaded) as e:
        raise engine_error(e) from e
    return request_context(admitted, request)


async def embedding_inputs(serving: OpenAIServing, body: EmbeddingRequest) -> list[list[int]]:
    """Token ids of each input: bounded in number and length, none empty, each within the
    model's context."""
    given = [body.input] if isinstance(body.input, str) else body.input
    if not given:
        raise APIError(400, "input must not be empty", param="input")
    batch = [given] if isinstance(given[0], int) else given
    if len(batch) > MAX_INPUTS:
        raise APIError(400, f"input must be at most {MAX_INPUTS} inputs, got {len(batch)}",
                       param="input")
    limit = serving.engine.max_model_len
    if isinstance(batch[0], str):
        for text in batch:
            check_prompt_text("input", text, limit)
        if not all(batch):
            raise APIError(400, "input must not contain an empty string", param="input")
        inputs = await serving.encode(batch, body.add_special_tokens)
    else:
        inputs = batch
        serving.engine.check_prompt_token_ids([t for ids in inputs for t in ids], "input")
    for i, ids in enumerate(inputs):
        if not ids:
            raise APIError(400, f"input[{i}] must have at least one token", param="input")
        if len(ids) > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                           f"However, input[{i}] has {len(ids)} tokens. Please reduce the "
                           f"length of the input.", param="input",
                           code="context_length_exceeded")
    return inputs


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def embeddings_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
        context = admit(serving, body, request)
        inputs = await embedding_inputs(serving, body)
        request_id = f"embd-{uuid.uuid4().hex}"
        updates = serving.generate(request_id, inputs, POOLING_PARAMS, body.priority, context,
                                   "input", pooling=True)
        states = await serving.run(request, updates, len(inputs))
        num_tokens = sum(len(ids) for ids in inputs)
        return EmbeddingResponse(
            data=[Embedding(index=i, embedding=encode_vector(state.embedding,
                                                             body.encoding_format))
                  for i, state in enumerate(states)],
            model=serving.model_name,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))

    return router
