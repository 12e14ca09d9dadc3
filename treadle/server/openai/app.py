"""The OpenAI-compatible REST server: FastAPI routes over an AsyncEngine.

A client request becomes one engine request per prompt (a completions batch has several; each
runs its n samples), whose updates merge into one stream. Tokenizing, chat templates and
detokenizing run in threads: the event loop only moves data. A request is refused (4xx) before
the response starts when the frontend or the engine rejects it; an error after a stream began is
its last SSE event, then `[DONE]`. A client that disconnects, streaming or not, has its requests
aborted.

Health: /health and /ready answer {"status": ...}, the engine's status (ok, stalled, restarting,
dead, stopping), 503 unless ok; a stalled engine is not restarted here, so liveness failing is
what lets an orchestrator restart a stuck server. Shutdown (`run`): on SIGTERM new connections
are refused at once; requests still running when the grace period ends get a last error of their
own (an SSE `server_shutdown` event and `[DONE]`, gRPC UNAVAILABLE), so no stream is cut off.

Tenants and objectives: a request's tenant is its API key's name, else its `user` field, else
"default" (AsyncEngine.resolve_tenant); `cache_salt` is vLLM's field; TTFT and TPOT objectives
come from the `ttft_ms` / `tpot_ms` fields, else the `X-Treadle-TTFT-Ms` / `X-Treadle-TPOT-Ms`
headers. A tenant over its limits, or (deadline policy) a TTFT the engine cannot meet, is a 429
whose code names the limit (tenant_requests, tenant_queued_tokens, deadline). A request that
waits past --max-queue-wait is a 503 of type queue_timeout before its stream starts, else that
error as its last SSE event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from treadle.engine.async_engine import (
    UNAVAILABLE,
    AsyncEngine,
    EngineOverloaded,
    EngineUnavailable,
    RequestUpdate,
)
from treadle.engine.output_processor import RequestState, SampleDelta
from treadle.engine.sampling_params import SamplingParams
from treadle.server.grpc.servicer import start_grpc_server
from treadle.server.openai.errors import APIError, from_value_error, install_error_handlers
from treadle.server.openai.logprobs import (
    TokenTable,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from treadle.server.openai.middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
)
from treadle.server.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
)
from treadle.server.validation import (
    apply_chat_template,
    check_batch,
    check_prompt_text,
    objective_seconds,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
MAX_REQUEST_BYTES = 4 << 20  # far above any context's worth of JSON
Updates = AsyncIterator[tuple[int, RequestUpdate]]  # (prompt index, update)

# Where SamplingParams or the engine name a field otherwise than the request does.
COMPLETION_PARAMS = {name: name for name in CompletionRequest.model_fields}
CHAT_PARAMS = {**{name: name for name in ChatCompletionRequest.model_fields},
               "logprobs": "top_logprobs", "prompt": "messages"}


TTFT_HEADER = "x-treadle-ttft-ms"
TPOT_HEADER = "x-treadle-tpot-ms"


class ClientDisconnected(Exception):
    pass


@dataclass(frozen=True)
class RequestContext:
    """Who a request is for and what it asks of the schedule, beside its sampling."""

    tenant: str
    cache_salt: str | None
    ttft: float | None  # seconds
    tpot: float | None


async def merge(streams: list[AsyncIterator[RequestUpdate]]) -> Updates:
    """The updates of several engine requests as one stream; leaving it early closes them all,
    which aborts their requests."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestUpdate]) -> None:
        try:
            async with aclosing(stream):
                async for update in stream:
                    queue.put_nowait((index, update))
            queue.put_nowait((index, None))
        except Exception as e:
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def prepend(first: tuple[int, RequestUpdate], rest: Updates) -> Updates:
    yield first
    async with aclosing(rest):
        async for item in rest:
            yield item


async def collect(updates: Updates, num_prompts: int) -> list[RequestState]:
    """Each prompt's final state."""
    states: dict[int, RequestState] = {}
    async for index, update in updates:
        states[index] = update.state
    return [states[i] for i in range(num_prompts)]


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (aborting its engine requests)
    and raise ClientDisconnected."""
    async def disconnected() -> None:
        # The body has been read, so the next message is the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.create_task(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()  # a no-op once done
        watcher.cancel()
    if task not in done:
        raise ClientDisconnected
    return task.result()


# What AsyncEngine.generate raises when it refuses a request.
ENGINE_ERRORS = (ValueError, EngineOverloaded, RuntimeError)


def engine_error(error: Exception, params: dict[str, str]) -> APIError:
    """The engine refused a request: the client's fault (ValueError), a full queue, or an engine
    that is down or died (type engine_error) or a server shutting down (server_shutdown)."""
    if isinstance(error, EngineUnavailable):
        return APIError(503, str(error), error_type=error.kind)
    if isinstance(error, ValueError):
        return from_value_error(error, params)
    if isinstance(error, EngineOverloaded):
        # The server-wide queue's limits keep OpenAI's code; the others name theirs.
        code = error.reason if error.reason in ("tenant_requests", "tenant_queued_tokens",
                                                "deadline") else "rate_limit_exceeded"
        return APIError(429, str(error), code=code, param="ttft_ms" if code == "deadline"
                        else None, error_type="rate_limit_error",
                        headers={"Retry-After": str(error.retry_after)})
    if isinstance(error, RuntimeError):
        return APIError(503, str(error), error_type="service_unavailable")
    logger.error("unexpected error in a request", exc_info=error)
    return APIError(500, "internal server error")


QUEUE_TIMEOUT_MESSAGE = ("the request waited longer than the server's queue time limit "
                         "(max_queue_wait) without being scheduled; retry later")


def queue_timeout_error() -> APIError:
    return APIError(503, QUEUE_TIMEOUT_MESSAGE, code="queue_timeout", error_type="queue_timeout",
                    headers={"Retry-After": "1"})


def check_finish(finish_reason: str | None) -> None:
    """Only stop and length reach a client; an engine failure, abort or queue timeout becomes an
    error."""
    if finish_reason == "error":
        raise APIError(500, "the engine failed while running this request")
    if finish_reason == "abort":
        raise APIError(503, "the request was aborted", error_type="service_unavailable")
    if finish_reason == "queue_timeout":
        raise queue_timeout_error()


def usage(prompts: list[list[int]], states: list[RequestState]) -> Usage:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(s.num_output_tokens for s in states)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=sum(s.num_cached_tokens for s in states)))


async def sse(chunks: AsyncIterator[BaseModel], params: dict[str, str]) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's format: chunks, or chunks and an error event, then
    `[DONE]`: a client reading to `[DONE]` always sees the stream end (as vLLM's do)."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json()}\n\n"
    except Exception as e:
        error = e if isinstance(e, APIError) else engine_error(e, params)
        yield f"data: {json.dumps(error.body())}\n\n"
    yield "data: [DONE]\n\n"


def sampling_params(fields: dict[str, Any], params: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        raise from_value_error(e, params) from e


def wanted(delta: SampleDelta, logprobs: bool) -> bool:
    """Whether a delta is worth a chunk: text held back (a possible stop string, part of a
    UTF-8 character) leaves it empty, but its tokens' logprobs may still be asked for."""
    return bool(delta.text) or delta.finished or logprobs


class OpenAIServer:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.tokens: TokenTable | None = None  # built at startup, off the event loop
        self.created = int(time.time())

    @property
    def table(self) -> TokenTable:
        assert self.tokens is not None, "the server has not started"
        return self.tokens

    def admit(self, body: CompletionRequest | ChatCompletionRequest, request: Request
              ) -> RequestContext:
        """Refuse a request for another model, or one the full queue or its tenant's limits
        cannot take, before any costly work; its tenant, salt and objectives."""
        self.check_model(body.model)
        try:
            context = self.request_context(body, request)
        except ValueError as e:
            raise from_value_error(e, {"user": "user", "ttft_ms": "ttft_ms",
                                       "tpot_ms": "tpot_ms", "cache_salt": "cache_salt"}) from e
        try:
            self.engine.check_available()
            self.engine.check_capacity(tenant=context.tenant)
        except (EngineUnavailable, EngineOverloaded) as e:
            raise engine_error(e, {}) from e
        return context

    def request_context(self, body: CompletionRequest | ChatCompletionRequest,
                        request: Request) -> RequestContext:
        """ValueError names the bad field."""
        key_name = getattr(request.state, "api_key_name", None)
        tenant = self.engine.resolve_tenant(key_name, body.user)
        headers = request.headers
        ttft = objective_seconds("ttft_ms", body.ttft_ms if body.ttft_ms is not None
                                 else headers.get(TTFT_HEADER))
        tpot = objective_seconds("tpot_ms", body.tpot_ms if body.tpot_ms is not None
                                 else headers.get(TPOT_HEADER))
        if body.cache_salt is not None:
            self.engine.cache_salt(tenant, body.cache_salt)  # its length: a 400 now
        return RequestContext(tenant, body.cache_salt, ttft, tpot)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.engine.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")

    def check_context(self, num_prompt: int, max_tokens: int | None, what: str) -> int:
        """`max_tokens` (None: the rest of the context), if the prompt and completion fit."""
        limit = self.engine.max_model_len
        start = f"This model's maximum context length is {limit} tokens. However, "
        if max_tokens is None and num_prompt >= limit:
            message = (f"{start}your {what} resulted in {num_prompt} tokens. Please reduce the "
                       f"length of the {what}.")
        elif max_tokens is not None and num_prompt + max_tokens > limit:
            message = (f"{start}you requested {num_prompt + max_tokens} tokens ({num_prompt} in "
                       f"the {what}, {max_tokens} in the completion). Please reduce the length "
                       f"of the {what} or completion.")
        else:
            return limit - num_prompt if max_tokens is None else max_tokens
        raise APIError(400, message, param=what, code="context_length_exceeded")

    async def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        encoded = await asyncio.to_thread(self.engine.tokenizer, texts,
                                          add_special_tokens=add_special_tokens)
        return encoded["input_ids"]

    async def apply_template(self, messages: list[ChatMessage],
                             add_generation_prompt: bool = True) -> list[int]:
        try:
            return await asyncio.to_thread(
                apply_chat_template, self.engine.tokenizer,
                [(m.role, m.text()) for m in messages], self.engine.max_model_len,
                add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e

    def check_prompt_texts(self, texts: list[str]) -> None:
        for text in texts:
            try:
                check_prompt_text("prompt", text, self.engine.max_model_len)
            except ValueError as e:
                raise APIError(400, str(e), param="prompt") from e

    def generate(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 priority: int, context: RequestContext) -> Updates:
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}"
                                                      for i in range(len(prompts))]
        return merge([self.engine.generate(i, p, params, priority, tenant=context.tenant,
                                           cache_salt=context.cache_salt, ttft=context.ttft,
                                           tpot=context.tpot)
                      for i, p in zip(ids, prompts, strict=True)])

    async def run(self, request: Request, updates: Updates, num_prompts: int,
                  params: dict[str, str]) -> list[RequestState]:
        """Run to the end (non-streaming): each prompt's final state."""
        try:
            states = await unless_disconnected(request, collect(updates, num_prompts))
        except ENGINE_ERRORS as e:
            raise engine_error(e, params) from e
        for state in states:
            for sample in state.samples:
                check_finish(sample.finish_reason)
        return states

    async def start_stream(self, request: Request, updates: Updates,
                           params: dict[str, str]) -> Updates:
        """Wait for the first update, so that a request the engine refuses is still a 4xx."""
        try:
            first = await unless_disconnected(request, anext(updates))
        except ENGINE_ERRORS as e:
            raise engine_error(e, params) from e
        if any(d.finish_reason == "queue_timeout" for d in first[1].deltas):
            await updates.aclose()  # aborts the request's other prompts and samples
            raise queue_timeout_error()
        return prepend(first, updates)

    # Routes.

    async def health(self) -> JSONResponse:
        """Liveness: the engine's status, 503 unless ok."""
        status = self.engine.status
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    async def metrics(self) -> Response:
        """Prometheus text format."""
        return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def ready(self) -> JSONResponse:
        """Readiness: the engine is alive and making progress."""
        ready = self.engine.is_ready()
        return JSONResponse({"ready": ready, "status": self.engine.status, **self.engine.load()},
                            status_code=200 if ready else 503)

    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.engine.model_name, created=self.created,
                                         max_model_len=self.engine.max_model_len,
                                         dtype=self.engine.platform["dtype"],
                                         platform=self.engine.platform)])

    async def debug_request(self, request_id: str) -> dict:
        """A recently finished request's timeline (`id/index` for one of n samples)."""
        timeline = self.engine.timeline(request_id)
        if timeline is None:
            raise APIError(404, f"no recently finished request {request_id!r}",
                           param="request_id", code="request_not_found")
        return timeline

    async def model(self, model: str) -> ModelCard:
        self.check_model(model)
        return (await self.models()).data[0]

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        if body.messages is not None:
            tokens = await self.apply_template(body.messages, body.add_generation_prompt)
        else:
            self.check_prompt_texts([body.prompt])
            tokens = (await self.encode([body.prompt], body.add_special_tokens))[0]
        return TokenizeResponse(count=len(tokens), max_model_len=self.engine.max_model_len,
                                tokens=tokens)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        vocab = len(self.table.texts)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be token ids in [0, {vocab}), got {bad[0]}",
                           param="tokens")
        text = await asyncio.to_thread(self.engine.tokenizer.decode, body.tokens)
        return DetokenizeResponse(prompt=text)

    async def completions(self, body: CompletionRequest,
                          request: Request) -> CompletionResponse | Response:
        context = self.admit(body, request)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options needs stream", param="stream_options")
        fields = {**body.sampling_fields(), "max_tokens": body.max_tokens}
        if body.logprobs is not None:
            fields["logprobs"] = body.logprobs
            if body.echo:  # the echoed prompt carries its logprobs too
                fields.setdefault("prompt_logprobs", body.logprobs)
        params = sampling_params(fields, COMPLETION_PARAMS)
        prompts, texts = await self.completion_prompts(body, params)
        for prompt in prompts:
            self.check_context(len(prompt), body.max_tokens, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        updates = self.generate(request_id, prompts, params, body.priority, context)
        if body.stream:
            updates = await self.start_stream(request, updates, COMPLETION_PARAMS)
            chunks = self.completion_chunks(body, request_id, prompts, texts, params.n, updates)
            return StreamingResponse(sse(chunks, COMPLETION_PARAMS),
                                     media_type="text/event-stream")
        states = await self.run(request, updates, len(prompts), COMPLETION_PARAMS)
        # Formatting many logprobs is slow enough to keep off the event loop.
        return await asyncio.to_thread(self.completion_response, body, request_id, prompts,
                                       texts, states)

    async def completion_prompts(self, body: CompletionRequest, params: SamplingParams
                                 ) -> tuple[list[list[int]], list[str] | None]:
        """Token ids of each prompt, and with echo, each prompt's text."""
        prompt = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        batch = [prompt] if isinstance(prompt[0], int) else prompt
        # Before any work proportional to the prompts' number or size.
        try:
            check_batch(len(batch), params)
        except ValueError as e:
            raise from_value_error(e, COMPLETION_PARAMS) from e
        if isinstance(batch[0], str):
            texts = batch
            self.check_prompt_texts(texts)
            prompts = await self.encode(texts, body.add_special_tokens)
        else:
            prompts = batch
            for p in prompts:
                self.check_context(len(p), body.max_tokens, "prompt")
            try:  # before echo decodes them
                self.engine.check_prompt_token_ids([t for p in prompts for t in p])
            except ValueError as e:
                raise from_value_error(e, COMPLETION_PARAMS) from e
            texts = (await asyncio.to_thread(self.engine.tokenizer.batch_decode, prompts)
                     if body.echo else None)
        if not all(prompts):
            raise APIError(400, "prompt must not be empty", param="prompt")
        return prompts, texts

    def completion_response(self, body: CompletionRequest, request_id: str,
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
                    logprobs = completion_logprobs(self.table, ids, entries, 0)
                choices.append(CompletionChoice(
                    index=p * state.params.n + sample.index, text=text, logprobs=logprobs,
                    finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
                    prompt_logprobs=self.prompt_logprobs(body, state)))
        return CompletionResponse(id=request_id, model=self.engine.model_name, choices=choices,
                                  usage=usage(prompts, states))

    def prompt_logprobs(self, body: CompletionRequest | ChatCompletionRequest,
                        state: RequestState) -> list | None:
        if body.prompt_logprobs is None or state.prompt_logprobs is None:
            return None
        return prompt_logprobs(self.table, state.prompt_logprobs)

    async def completion_chunks(self, body: CompletionRequest, request_id: str,
                                prompts: list[list[int]], texts: list[str] | None, n: int,
                                updates: Updates) -> AsyncIterator[CompletionResponse]:
        created = int(time.time())
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
                logprobs = (completion_logprobs(self.table, ids, entries, offset)
                            if body.logprobs is not None else None)
                sent[index] = offset + (sum(len(t) for t in logprobs.tokens) if logprobs
                                        else len(text))
                yield CompletionResponse(id=request_id, created=created,
                                         model=self.engine.model_name, choices=[
                                             CompletionChoice(
                                                 index=index, text=text, logprobs=logprobs,
                                                 finish_reason=delta.finish_reason,
                                                 stop_reason=delta.stop_reason)])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield CompletionResponse(id=request_id, created=created, model=self.engine.model_name,
                                     choices=[], usage=usage(prompts, list(states.values())))

    async def chat(self, body: ChatCompletionRequest,
                   request: Request) -> ChatCompletionResponse | Response:
        context = self.admit(body, request)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options needs stream", param="stream_options")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                      else body.max_tokens)
        names = {**CHAT_PARAMS, "max_tokens": "max_completion_tokens"
                 if body.max_completion_tokens is not None else "max_tokens"}
        fields = body.sampling_fields()
        if body.logprobs:
            fields["logprobs"] = body.top_logprobs or 0
        # Check the fields before the costly template; with max_tokens left out, the rest of the
        # context is the most it can be.
        sampling_params({**fields, "max_tokens": max_tokens or self.engine.max_model_len}, names)
        prompt = await self.apply_template(body.messages)
        fields["max_tokens"] = self.check_context(len(prompt), max_tokens, "messages")
        params = sampling_params(fields, names)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        updates = self.generate(request_id, [prompt], params, body.priority, context)
        if body.stream:
            updates = await self.start_stream(request, updates, names)
            chunks = self.chat_chunks(body, request_id, prompt, params.n, updates)
            return StreamingResponse(sse(chunks, names), media_type="text/event-stream")
        [state] = await self.run(request, updates, 1, names)
        return await asyncio.to_thread(self.chat_response, body, request_id, prompt, state)

    def chat_response(self, body: ChatCompletionRequest, request_id: str, prompt: list[int],
                      state: RequestState) -> ChatCompletionResponse:
        choices = [ChatChoice(
            index=s.index, message=AssistantMessage(content=s.text),
            logprobs=ChatLogprobs(content=chat_logprobs(self.table, s.logprobs))
            if body.logprobs else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            prompt_logprobs=self.prompt_logprobs(body, state)) for s in state.samples]
        return ChatCompletionResponse(id=request_id, model=self.engine.model_name,
                                      choices=choices, usage=usage([prompt], [state]))

    async def chat_chunks(self, body: ChatCompletionRequest, request_id: str, prompt: list[int],
                          n: int, updates: Updates) -> AsyncIterator[ChatCompletionChunk]:
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None
                  ) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created,
                                       model=self.engine.model_name, choices=choices,
                                       usage=usage)

        for index in range(n):  # as OpenAI: the role first, in a chunk of its own
            yield chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])
        state = None
        async for _, update in updates:
            state = update.state
            for delta in update.deltas:
                check_finish(delta.finish_reason)
                if not wanted(delta, body.logprobs):
                    continue
                logprobs = (ChatLogprobs(content=chat_logprobs(self.table, delta.logprobs))
                            if body.logprobs else None)
                yield chunk([ChatChunkChoice(index=delta.index, delta=Delta(content=delta.text),
                                             logprobs=logprobs, finish_reason=delta.finish_reason,
                                             stop_reason=delta.stop_reason)])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage([prompt], [state]))


def build_app(engine: AsyncEngine, api_keys: list[str] | None = None,
              allowed_origins: list[str] | None = None,
              max_request_bytes: int = MAX_REQUEST_BYTES,
              grpc_address: tuple[str, int] | None = None,
              enable_debug_endpoints: bool = False,
              metrics_without_auth: bool = False) -> FastAPI:
    """The app; its lifespan starts the engine (the model loads) and shuts it down.
    `api_keys`: Bearer keys for every route but /health and /ready (none: open), and /metrics
    unless `metrics_without_auth`; `allowed_origins`: CORS;
    `grpc_address`: (host, port) where the gRPC frontend serves the same engine (None: none);
    `enable_debug_endpoints`: GET /debug/requests/{id}, each request's timeline."""
    server = OpenAIServer(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        grpc_server = None
        try:
            server.tokens = await asyncio.to_thread(TokenTable, engine.tokenizer)
            if grpc_address is not None:
                grpc_server, _ = await start_grpc_server(engine, *grpc_address,
                                                         api_keys=api_keys or ())
            app.state.grpc_server = grpc_server  # for run()'s shutdown
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace=None)
            await engine.shutdown()

    app = FastAPI(title="Treadle", summary="An OpenAI-compatible LLM server", lifespan=lifespan)
    install_error_handlers(app)

    async def client_gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    app.add_exception_handler(ClientDisconnected, client_gone)
    # The last added runs first: ids on every response, CORS (a preflight carries no key), the
    # key, then the body limit, so that no one without a key can make the server read a body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, keys=api_keys,
                           metrics_without_auth=metrics_without_auth)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(RequestIdMiddleware)
    app.get("/health")(server.health)
    app.get("/metrics", response_class=PlainTextResponse)(server.metrics)
    if enable_debug_endpoints:
        app.get("/debug/requests/{request_id:path}")(server.debug_request)
    app.get("/ready")(server.ready)
    app.get("/v1/models")(server.models)
    app.get("/v1/models/{model:path}")(server.model)
    app.post("/tokenize")(server.tokenize)
    app.post("/detokenize")(server.detokenize)
    app.post("/v1/completions", response_model=CompletionResponse)(server.completions)
    app.post("/v1/chat/completions", response_model=ChatCompletionResponse)(server.chat)
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn whose shutdown ends the requests still running at the grace period's end with a
    last error of their own, and that stops by itself once the engine is dead for good."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace: float) -> None:
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self.engine_dead = False
        self.signalled: float | None = None  # when SIGTERM or SIGINT came: the grace starts
        self.grpc_stopping: asyncio.Task | None = None
        engine.add_listener(self.on_engine_status)

    def on_engine_status(self, status: str) -> None:
        if status == "dead":  # exit, so that whatever runs the server starts a new one
            self.engine_dead = self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.signalled is None:
            self.signalled = time.monotonic()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list | None = None) -> None:
        self.engine.drain()
        grpc_server = getattr(self.config.app.state, "grpc_server", None)
        if grpc_server is not None:  # refuses new calls now; cancels what our ending missed
            self.grpc_stopping = asyncio.create_task(grpc_server.stop(grace=self.grace + 1))
        # uvicorn notices the signal on its next tick (0.1 s): count the grace from the signal.
        elapsed = 0.0 if self.signalled is None else time.monotonic() - self.signalled
        ending = asyncio.get_running_loop().call_later(
            max(self.grace - elapsed, 0.0), self.engine.fail_all,
            EngineUnavailable(UNAVAILABLE["stopping"], "server_shutdown"))
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()


def run(app: FastAPI, engine: AsyncEngine, host: str, port: int, shutdown_timeout: float
        ) -> int:
    """Serve until SIGTERM or SIGINT (0), or until the engine is dead for good (1)."""
    # uvicorn's own cancelling of the requests still running is the backstop: by then ours have
    # ended with their last event.
    config = uvicorn.Config(app, host=host, port=port,
                            timeout_graceful_shutdown=shutdown_timeout + 0.5)
    server = GracefulServer(config, engine, shutdown_timeout)
    server.run()
    return 1 if server.engine_dead else 0
