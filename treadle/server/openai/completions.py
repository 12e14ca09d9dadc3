"""POST /v1/completions: a prompt (text or token ids) or a batch of them, each run n times; echo,
legacy-shape logprobs, prompt logprobs; whole or streamed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from treadle.core.sampling_params import SamplingParams
from treadle.frontend.output_processor import RequestState
from treadle.server.openai.errors import APIError
from treadle.server.openai.logprobs import completion_logprobs
from treadle.server.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from treadle.server.openai.serving import (
    OpenAIServing,
    RequestContext,
    Updates,
    check_finish,
    sse,
    usage,
    wanted,
)
from treadle.server.validation import check_batch, check_prompt_logprobs


async def completion_prompts(serving: OpenAIServing, body: CompletionRequest,
                             params: SamplingParams
                             ) -> tuple[list[list[int]], list[str] | None]:
    """Token ids of each prompt, and with echo, each prompt's text."""
    prompt = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    batch = [prompt] if isinstance(prompt[0], int) else prompt
    check_batch(len(batch), params)  # before any work proportional to the prompts' number
    if isinstance(batch[0], str):
        texts = batch
        serving.check_prompt_texts(texts)
        prompts = await serving.encode(texts, body.add_special_tokens)
    else:
        prompts = batch
        for p in prompts:
            serving.check_context(len(p), body.max_tokens, "prompt")
        serving.engine.check_prompt_token_ids([t for p in prompts for t in p])  # before echo
        texts = (await asyncio.to_thread(serving.engine.tokenizer.batch_decode, prompts)
                 if body.echo else None)
    if not all(prompts):
        raise APIError(400, "prompt must not be empty", param="prompt")
    return prompts, texts


def completion_response(serving: OpenAIServing, body: CompletionRequest, request_id: str,
                        prompts: list[list[int]], texts: list[str] | None,
                        states: list[RequestState]) -> CompletionResponse:
    choices = []
    for p, state in enumerate(states):
        for sample in state.samples:
            text, logprobs = sample.text, None
            if body.echo:
                text = texts[p] + text
            if body.logprobs is not None:
                ids, entries = sample.token_ids, sample.logprobs
                if body.echo:
                    ids, entries = prompts[p] + ids, state.prompt_logprobs + entries
                logprobs = completion_logprobs(serving.table, ids, entries, 0)
            choices.append(CompletionChoice(
                index=p * state.params.n + sample.index, text=text, logprobs=logprobs,
                finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
                prompt_logprobs=serving.prompt_logprobs(body, state)))
    return CompletionResponse(id=request_id, model=serving.model_name, choices=choices,
                              usage=usage(prompts, states))


async def completion_chunks(serving: OpenAIServing, body: CompletionRequest,
                            context: RequestContext, prompts: list[list[int]],
                            texts: list[str] | None, n: int, updates: Updates
                            ) -> AsyncIterator[CompletionResponse]:
    request_id = f"cmpl-{context.request_id}"
    created = int(time.time())
    model = serving.model_name
    sent: dict[int, int] = {}  # choice index -> characters sent, for text_offset
    states: dict[int, RequestState] = {}
    async for p, update in updates:
        state = states[p] = update.state
        for delta in update.deltas:
            check_finish(delta.finish_reason)
            index = p * n + delta.index
            if not wanted(delta, body.logprobs is not None) and index in sent:
                continue
            text, ids, entries = delta.text, delta.token_ids, delta.logprobs
            if body.echo and index not in sent:  # the prompt goes with the first chunk
                text = texts[p] + text
                if body.logprobs is not None:
                    ids, entries = prompts[p] + ids, state.prompt_logprobs + entries
            offset = sent.get(index, 0)
            logprobs = (completion_logprobs(serving.table, ids, entries, offset)
                        if body.logprobs is not None else None)
            sent[index] = offset + (sum(len(t) for t in logprobs.tokens) if logprobs
                                    else len(text))
            yield CompletionResponse(id=request_id, created=created, model=model, choices=[
                CompletionChoice(index=index, text=text, logprobs=logprobs,
                                 finish_reason=delta.finish_reason,
                                 stop_reason=delta.stop_reason)])
    timings = serving.finish_response(context.request_id, len(prompts))
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if include_usage or body.return_timings:
        yield CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                 usage=usage(prompts, list(states.values()))
                                 if include_usage else None,
                                 timings=timings if body.return_timings else None)


def completions_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest,
                          request: Request) -> CompletionResponse | Response:
        context = serving.admit(body, request)
        fields = {**serving.sampling_fields(body), "max_tokens": body.max_tokens}
        fields["structured_outputs"] = await serving.structured_output(body)
        if body.logprobs is not None:
            fields["logprobs"] = body.logprobs
            if body.echo:  # the echoed prompt carries its logprobs too
                fields.setdefault("prompt_logprobs", body.logprobs)
        params = serving.sampling_params(fields)
        prompts, texts = await completion_prompts(serving, body, params)
        for prompt in prompts:
            serving.check_context(len(prompt), body.max_tokens, "prompt")
        # Echo with logprobs asks for them as `logprobs`.
        check_prompt_logprobs(sum(map(len, prompts)), params, "prompt_logprobs"
                              if body.prompt_logprobs is not None else "logprobs")
        updates = serving.generate(context.request_id, prompts, params, body.priority, context,
                                   "prompt")
        if body.stream:
            updates = await serving.start_stream(request, updates)
            chunks = completion_chunks(serving, body, context, prompts, texts, params.n,
                                       updates)
            return StreamingResponse(sse(chunks, serving.keepalive),
                                     media_type="text/event-stream")
        states = await serving.run(request, updates, len(prompts))
        # Formatting many logprobs is slow enough to keep off the event loop.
        response = await asyncio.to_thread(completion_response, serving, body,
                                           f"cmpl-{context.request_id}", prompts, texts, states)
        timings = serving.finish_response(context.request_id, len(prompts))
        if body.return_timings:
            response.timings = timings
        return response

    return router
