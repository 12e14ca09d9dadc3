"""POST /v1/chat/completions: messages through the chat template (the model's own, or the one
`--chat-template` gives; a model with neither answers 400), n samples, chat-shape logprobs;
whole or streamed, the role first in a chunk of its own as OpenAI sends it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from treadle.frontend.output_processor import RequestState
from treadle.server.openai.errors import APIError
from treadle.server.openai.logprobs import chat_logprobs
from treadle.server.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    Delta,
    Usage,
)
from treadle.server.openai.serving import (
    OpenAIServing,
    RequestContext,
    Updates,
    check_finish,
    sse,
    usage,
    wanted,
)
from treadle.server.openai.tools import ChatTools, ToolCallStream, chat_tools, tool_message
from treadle.server.validation import check_prompt_logprobs


def chat_response(serving: OpenAIServing, body: ChatCompletionRequest, request_id: str,
                  prompt: list[int], state: RequestState,
                  tools: ChatTools | None) -> ChatCompletionResponse:
    choices = []
    for s in state.samples:
        message, finish_reason = tool_message(tools, serving.tool_parser, s.text,
                                              s.finish_reason)
        choices.append(ChatChoice(
            index=s.index, message=message,
            logprobs=ChatLogprobs(content=chat_logprobs(serving.table, s.logprobs))
            if body.logprobs else None,
            finish_reason=finish_reason, stop_reason=s.stop_reason,
            prompt_logprobs=serving.prompt_logprobs(body, state)))
    return ChatCompletionResponse(id=request_id, model=serving.model_name,
                                  choices=choices, usage=usage([prompt], [state]))


async def chat_chunks(serving: OpenAIServing, body: ChatCompletionRequest,
                      context: RequestContext, prompt: list[int], n: int, updates: Updates,
                      tools: ChatTools | None) -> AsyncIterator[ChatCompletionChunk]:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None,
              timings: dict[str, float] | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=f"chatcmpl-{context.request_id}", created=created,
                                   model=serving.model_name, choices=choices, usage=usage,
                                   timings=timings)

    for index in range(n):  # as OpenAI: the role first, in a chunk of its own
        yield chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])
    state = None
    # With tools, each sample's text goes through its ToolCallStream (tools.py).
    streams = {} if tools is None else {i: ToolCallStream(tools, serving.tool_parser)
                                        for i in range(n)}
    async for _, update in updates:
        state = update.state
        for delta in update.deltas:
            check_finish(delta.finish_reason)
            if not wanted(delta, body.logprobs):
                continue
            logprobs = (ChatLogprobs(content=chat_logprobs(serving.table, delta.logprobs))
                        if body.logprobs else None)
            out, finish_reason = Delta(content=delta.text), delta.finish_reason
            if tools is not None:
                out, finish_reason = streams[delta.index].delta(delta.text, finish_reason)
                if out is None:
                    continue
            yield chunk([ChatChunkChoice(index=delta.index, delta=out, logprobs=logprobs,
                                         finish_reason=finish_reason,
                                         stop_reason=delta.stop_reason)])
    timings = serving.finish_response(context.request_id, 1)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if include_usage or body.return_timings:
        yield chunk([], usage([prompt], [state]) if include_usage else None,
                    timings if body.return_timings else None)


def chat_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat(body: ChatCompletionRequest,
                   request: Request) -> ChatCompletionResponse | Response:
        context = serving.admit(body, request)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                      else body.max_tokens)
        # SamplingParams' names of the fields that chat names otherwise.
        names = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"
                 if body.max_completion_tokens is not None else "max_tokens"}
        fields = serving.sampling_fields(body)
        tools = chat_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        fields["structured_outputs"] = await serving.structured_output(body, tools)
        if body.logprobs:
            fields["logprobs"] = body.top_logprobs or 0
        # Check the fields before the costly template; with max_tokens left out, the rest of the
        # context is the most it can be.
        serving.sampling_params(
            {**fields, "max_tokens": max_tokens or serving.engine.max_model_len}, names)
        prompt = await serving.apply_template(body.messages, tools=tools)
        fields["max_tokens"] = serving.check_context(len(prompt), max_tokens, "messages")
        params = serving.sampling_params(fields, names)
        check_prompt_logprobs(len(prompt), params, "prompt_logprobs")
        updates = serving.generate(context.request_id, [prompt], params, body.priority, context,
                                   "messages")
        if body.stream:
            updates = await serving.start_stream(request, updates)
            chunks = chat_chunks(serving, body, context, prompt, params.n, updates, tools)
            return StreamingResponse(sse(chunks, serving.keepalive),
                                     media_type="text/event-stream")
        [state] = await serving.run(request, updates, 1)
        response = await asyncio.to_thread(chat_response, serving, body,
                                           f"chatcmpl-{context.request_id}", prompt, state,
                                           tools)
        timings = serving.finish_response(context.request_id, 1)
        if body.return_timings:
            response.timings = timings
        return response

    return router
