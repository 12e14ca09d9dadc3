"""What every generating route shares: admission, context checks, tokenizing and chat prompts off
the event loop, one engine request per prompt in one stream, running to the end or streaming
(SSE), and the engine's refusals as OpenAI errors.

A client request becomes one engine request per prompt (a completions batch has several; each
runs its n samples), admitted together, whose updates come as one stream
(AsyncEngine.generate_batch). A request is refused (4xx) before the response starts when the
frontend or the engine rejects it; an error after a stream began is its last SSE event, then
`[DONE]`. A client that disconnects, streaming or not, has its requests aborted.

Every request field is honoured or refused: a field of OpenAI's API that Treadle does not implement
yet is accepted at its default only, else a 400 (code unsupported_value) naming it (protocol's
NOT_YET tables); a field OpenAI does not know either is ignored with a warning, as vLLM does.

Tenants and objectives: a request's tenant is its API key's name, else its `user` field, else
its `safety_identifier` (OpenAI's successor of `user`), else "default"
(AsyncEngine.admit); `cache_salt` is vLLM's field; TTFT and TPOT objectives
come from the `ttft_ms` / `tpot_ms` fields, else the `X-Treadle-TTFT-Ms` / `X-Treadle-TPOT-Ms`
headers. A tenant over its limits, or (deadline policy) a TTFT the engine cannot meet, is a 429
whose code names the limit (tenant_requests, tenant_queued_tokens, deadline); a batch of more
prompts than a tenant may ever have in flight is a 400 naming max_requests_per_tenant. A request
that waits past --max-queue-wait is a 503 of type queue_timeout before its stream starts, else
that error as its last SSE event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from treadle.config import APIKey
from treadle.core.lora_request import LoRARequest
from treadle.core.sampling_params import SamplingParams, StructuredOutputsParams, check_max_logprobs
from treadle.core.structured_output import ConstraintChecker
from treadle.errors import InvalidField
from treadle.frontend.admission import Admitted, EngineOverloaded, check_tenant_name
from treadle.frontend.async_engine import AsyncEngine, RequestUpdate
from treadle.frontend.output_processor import RequestState, SampleDelta
from treadle.frontend.supervisor import EngineUnavailable
from treadle.observability.explain import e2e, timings
from treadle.server.auth import may_manage_adapters
from treadle.server.chat_template import apply_chat_template
from treadle.server.openai.errors import APIError, invalid_request
from treadle.server.openai.logprobs import TokenTable, prompt_logprobs
from treadle.server.openai.lora_adapters import LoraAdapters
from treadle.server.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
)
from treadle.server.openai.tool_parsers import tool_parser
from treadle.server.openai.tools import ChatTools, check_tool_results, template_inputs
from treadle.server.validation import check_prompt_text

if TYPE_CHECKING:
    from treadle.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")
Updates = AsyncIterator[tuple[int, RequestUpdate]]  # (prompt index, update)

TTFT_HEADER = "x-treadle-ttft-ms"
TPOT_HEADER = "x-treadle-tpot-ms"
# What AsyncEngine.generate_batch raises when it refuses a request.
ENGINE_ERRORS = (ValueError, EngineOverloaded, RuntimeError)
GRAMMAR_ERROR_MESSAGE = ("the output's constraint could not be followed: its grammar failed "
                         "after the output's start (too complex for the grammar engine); "
                         "simplify it")
SERVER_QUEUE_LIMITS = ("queue_full", "queued_tokens_full")  # Admission's server-wide reasons
QUEUE_TIMEOUT_MESSAGE = ("the request waited longer than the server's queue time limit "
                         "(max_queue_wait) without being scheduled; retry later")


def count_prompts(prompt: str | list) -> int:
    """How many prompts a completions `prompt` (or an embeddings `input`) holds: one text or
    list of token ids, or a list of them."""
    return 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) \
        else len(prompt)


def prompt_ids(request_id: str, num_prompts: int) -> list[str]:
    """The engine request of each prompt: the request's id, or `id/p` for prompt p of several
    ("/" is in no client's id)."""
    return [request_id] if num_prompts == 1 else [f"{request_id}/{p}" for p in range(num_prompts)]


class ClientDisconnected(Exception):
    pass


@dataclass(frozen=True)
class RequestContext:
    """Who a request is for and what it asks of the schedule, beside its sampling."""

    tenant: str
    cache_salt: str | None
    ttft: float | None  # seconds
    tpot: float | None
    request_id: str  # what the request's records are keyed by (RequestIdMiddleware's)
    received: float  # time.monotonic() when the request came in
    lora_request: LoRARequest | None = None  # the adapter its `model` names; None: the base


def api_key(request: Request) -> APIKey | None:
    """The caller's API key (APIKeyMiddleware's); None when the server has no keys."""
    return getattr(request.state, "api_key", None)


def request_context(admitted: Admitted, request: Request) -> RequestContext:
    return RequestContext(admitted.tenant, admitted.cache_salt, admitted.ttft, admitted.tpot,
                          request.state.request_id, request.state.received)


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


def engine_error(error: Exception) -> APIError:
    """The engine refused a request: the client's fault (InvalidField, naming its field), a full
    queue, or an engine that is down or died (type engine_error) or a server shutting down
    (server_shutdown)."""
    if isinstance(error, EngineUnavailable):
        return APIError(503, str(error), error_type=error.kind)
    if isinstance(error, ValueError):
        return invalid_request(error)
    if isinstance(error, EngineOverloaded):
        # The server-wide queue's limits keep OpenAI's code; the others (a tenant's limits, a
        # queue policy's refusal) name theirs.
        code = "rate_limit_exceeded" if error.reason in SERVER_QUEUE_LIMITS else error.reason
        return APIError(429, str(error), code=code, error_type="rate_limit_error",
                        headers={"Retry-After": str(error.retry_after)})
    if isinstance(error, RuntimeError):
        return APIError(503, str(error), error_type="service_unavailable")
    logger.error("unexpected error in a request", exc_info=error)
    return APIError(500, "internal server error")


def queue_timeout_error() -> APIError:
    return APIError(503, QUEUE_TIMEOUT_MESSAGE, code="queue_timeout", error_type="queue_timeout",
                    headers={"Retry-After": "1"})


def check_finish(finish_reason: str | None) -> None:
    """Only stop and length reach a client; an engine failure, abort, queue timeout or a
    constraint whose grammar failed midway becomes an error."""
    if finish_reason == "error":
        raise APIError(500, "the engine failed while running this request")
    if finish_reason == "grammar_error":
        raise APIError(400, GRAMMAR_ERROR_MESSAGE, code="grammar_error")
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


KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it


async def sse(chunks: AsyncIterator[BaseModel], keepalive: float) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's format: chunks, or chunks and an error event, then
    `[DONE]`: a client reading to `[DONE]` always sees the stream end (as vLLM's do). Each
    `keepalive` seconds without a chunk (the request still queued, text held back) send a
    comment, so that proxies with idle timeouts do not cut the stream."""
    pending: asyncio.Task | None = None
    try:
        while True:
            pending = asyncio.ensure_future(anext_of(chunks))
            while not (await asyncio.wait({pending}, timeout=keepalive))[0]:
                yield KEEPALIVE
            chunk, pending = pending.result(), None
            yield f"data: {chunk.model_dump_json()}\n\n"
    except StopAsyncIteration:
        pass
    except Exception as e:
        error = e if isinstance(e, APIError) else engine_error(e)
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        if pending is not None:  # the client left: cancelling it closes the chunks' updates
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await chunks.aclose()
    yield "data: [DONE]\n\n"


async def anext_of(iterator: AsyncIterator[T]) -> T:
    return await anext(iterator)


async def after(first: asyncio.Future, rest: Updates) -> Updates:
    """The update `first` will give, then the rest."""
    async with aclosing(rest):
        yield await first
        async for item in rest:
            yield item


def wanted(delta: SampleDelta, logprobs: bool) -> bool:
    """Whether a delta is worth a chunk: text held back (a possible stop string, part of a
    UTF-8 character) leaves it empty, but its tokens' logprobs may still be asked for."""
    return bool(delta.text) or delta.finished or logprobs


class OpenAIServing:
    """The engine as every route sees it, with the tokenizer work kept off the event loop.
    `chat_tokenizer`: the engine's tokenizer, or a copy with the server's chat template."""

    def __init__(self, engine: AsyncEngine, chat_tokenizer: Tokenizer,
                 model_names: tuple[str, ...], sse_keepalive_interval: float,
                 tool_call_parser: str, loras: LoraAdapters) -> None:
        """The ServerConfig settings of the same names (their defaults are its own):
        `model_names`: those a request's `model` may be, the first in responses (empty: the
        model's own name); `sse_keepalive_interval`: seconds of silence before a streamed
        response gets a keep-alive comment; `tool_call_parser`: how model outputs' tool calls
        are written (tool_parsers.py); `loras`: the adapters served by name."""
        self.engine = engine
        self.chat_tokenizer = chat_tokenizer
        self.tool_parser = tool_parser(tool_call_parser)
        self.model_names = model_names or (engine.model_name,)
        self.keepalive = sse_keepalive_interval
        self.tokens: TokenTable | None = None  # built at startup, off the event loop
        self.created = int(time.time())
        self.loras = loras

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @functools.cached_property
    def constraints(self) -> ConstraintChecker:
        """Made at the first constraint, the engine started: its vocabulary's size is known."""
        return ConstraintChecker(self.engine.tokenizer_file, self.engine.vocab_size,
                                 self.engine.tokenizer.eos_token_id)

    def sampling_fields(self, body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        """The SamplingParams fields the client set, over the model's generation config's."""
        return {**self.engine.sampling_defaults, **body.sampling_fields()}

    @property
    def table(self) -> TokenTable:
        assert self.tokens is not None, "the server has not started"
        return self.tokens

    def admit(self, body: CompletionRequest | ChatCompletionRequest, request: Request
              ) -> RequestContext:
        """Refuse a request for another model, or one the full queue or its tenant's limits
        cannot take (its prompts counted), or one asking for what Treadle does not support yet,
        before any costly work; its tenant, salt and objectives."""
        self.check_model(body.model, request)
        unsupported = body.unsupported()
        if unsupported is not None:
            param, message = unsupported
            raise APIError(400, message, param=param, code="unsupported_value")
        user = body.user
        headers = request.headers
        try:
            if not user and body.safety_identifier:
                check_tenant_name(body.safety_identifier, "safety_identifier")  # named as sent
                user = body.safety_identifier
            admitted = self.engine.admit(
                getattr(request.state, "api_key_name", None), user,
                ttft_ms=body.ttft_ms if body.ttft_ms is not None else headers.get(TTFT_HEADER),
                tpot_ms=body.tpot_ms if body.tpot_ms is not None else headers.get(TPOT_HEADER),
                cache_salt=body.cache_salt, num_prompts=count_prompts(body.prompt)
                if isinstance(body, CompletionRequest) else 1)
        except (EngineUnavailable, EngineOverloaded) as e:
            raise engine_error(e) from e
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options needs stream", param="stream_options")
        lora = None if body.model is None else self.loras.get(body.model, api_key(request))
        return replace(request_context(admitted, request), lora_request=lora)

    def check_model(self, model: str | None, request: Request) -> None:
        """404 for a model that is neither a served name nor an adapter the caller's key may
        use; OpenAI's message, the same for both, so that no key learns of adapters not its
        own."""
        if model is not None and model not in self.model_names and \
                self.loras.get(model, api_key(request)) is None:
            raise APIError(404, f"The model `{model}` does not exist or you do not have access "
                           "to it.", param="model", code="model_not_found")

    def check_may_manage_adapters(self, request: Request) -> None:
        """403 for a key bound to adapters: loading and unloading are for unbound keys."""
        if not may_manage_adapters(api_key(request)):
            raise APIError(403, "this API key is bound to LoRA adapters and may not load or "
                           "unload them", code="permission_denied",
                           error_type="permission_error")

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

    def sampling_params(self, fields: dict[str, Any], names: dict[str, str] | None = None
                        ) -> SamplingParams:
        """SamplingParams of `fields`, within the server's max_logprobs; InvalidField naming the
        request's field, which `names` gives where the request names a field otherwise than
        SamplingParams does."""
        try:
            params = SamplingParams(**fields)
            check_max_logprobs(params, self.engine.config.engine.model.max_logprobs)
        except InvalidField as e:
            raise e.renamed(names or {}) from None
        return params

    async def apply_template(self, messages: list[ChatMessage],
                             add_generation_prompt: bool = True,
                             tools: ChatTools | None = None) -> list[int]:
        check_tool_results(messages)
        template = self.chat_tokenizer.chat_template
        turns, fields, template_tools = template_inputs(
            messages, tools, self.tool_parser, native=template is not None and "tools" in template)
        return await asyncio.to_thread(
            apply_chat_template, self.chat_tokenizer, turns, self.engine.max_model_len,
            add_generation_prompt, template_tools, fields)

    async def structured_output(self, body: CompletionRequest | ChatCompletionRequest,
                                tools: ChatTools | None = None
                                ) -> StructuredOutputsParams | None:
        """The request's constraint (its structured-output field's, or the one enforcing a
        required or named tool choice), checked to compile (in a thread: a large grammar takes
        a while); a 400 naming its field otherwise."""
        found = body.structured_output()
        if tools is not None and tools.constrained:
            if found is not None:
                raise APIError(400, f"tool_choice {tools.choice!r} cannot be combined with "
                               f"{found[0]}", param="tool_choice")
            found = "tools", tools.constraint()
        if found is None:
            return None
        name, params = found
        try:
            await asyncio.to_thread(self.constraints.check, params)
        except ValueError as e:
            raise APIError(400, f"{name}: {e}", param=name) from e
        return params

    def check_prompt_texts(self, texts: list[str]) -> None:
        for text in texts:
            check_prompt_text("prompt", text, self.engine.max_model_len)

    def prompt_logprobs(self, body: CompletionRequest | ChatCompletionRequest,
                        state: RequestState) -> list | None:
        if body.prompt_logprobs is None or state.prompt_logprobs is None:
            return None
        return prompt_logprobs(self.table, state.prompt_logprobs)

    def generate(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 priority: int, context: RequestContext, prompt_field: str,
                 pooling: bool = False) -> Updates:
        """`prompt_field`: the request's field the prompts came from (errors name it);
        `pooling`: embedding requests (AsyncEngine.generate's)."""
        updates = self.engine.generate_batch(
            prompt_ids(request_id, len(prompts)), prompts, params, priority,
            tenant=context.tenant, cache_salt=context.cache_salt, ttft=context.ttft,
            tpot=context.tpot, received=context.received, pooling=pooling,
            prompt_field=prompt_field, lora_request=context.lora_request)
        lora = context.lora_request
        return updates if lora is None else self.counted(updates, lora.lora_name)

    async def counted(self, updates: Updates, lora_name: str) -> Updates:
        """The updates, the adapter counted in use while they stream."""
        with self.loras.in_use(lora_name):
            async with aclosing(updates):
                async for item in updates:
                    yield item

    def finish_response(self, request_id: str, num_prompts: int) -> dict[str, float] | None:
        """The response is written, all but its last bytes: mark its samples' timelines; the
        `timings` of the one that took longest (None: none left to explain)."""
        timelines = self.engine.response_finished(prompt_ids(request_id, num_prompts))
        return timings(max(timelines, key=e2e)) if timelines else None

    async def run(self, request: Request, updates: Updates, num_prompts: int
                  ) -> list[RequestState]:
        """Run to the end (non-streaming): each prompt's final state."""
        try:
            states = await unless_disconnected(request, collect(updates, num_prompts))
        except ENGINE_ERRORS as e:
            raise engine_error(e) from e
        for state in states:
            for sample in state.samples:
                check_finish(sample.finish_reason)
        return states

    async def start_stream(self, request: Request, updates: Updates) -> Updates:
        """Wait for the first update, so that a request the engine refuses is still a 4xx; one
        still queued after the keep-alive interval starts its stream anyway (keep-alives then
        hold it open, and a later refusal is its last SSE event)."""
        pending = asyncio.ensure_future(anext_of(updates))
        try:
            await unless_disconnected(request, asyncio.wait({pending}, timeout=self.keepalive))
        except BaseException:
            pending.cancel()  # aborts the requests
            await asyncio.gather(pending, return_exceptions=True)
            raise
        if not pending.done():
            return after(pending, updates)
        try:
            first = pending.result()
        except ENGINE_ERRORS as e:
            raise engine_error(e) from e
        if any(d.finish_reason == "queue_timeout" for d in first[1].deltas):
            await updates.aclose()  # aborts the request's other prompts and samples
            raise queue_timeout_error()
        return prepend(first, updates)
