"""gRPC frontend (grpc.aio) over the AsyncEngine: streaming Generate, standard health, reflection.

Status codes: INVALID_ARGUMENT for a request the client got wrong (the message names the field;
the checks are the REST frontend's, in treadle.server.validation), or one that does not parse,
RESOURCE_EXHAUSTED when the queue is full, the tenant is over a limit or (deadline policy) its
TTFT objective cannot be met (the message names the limit; trailing metadata `treadle-reason`
says which: queue_full, queued_tokens_full, tenant_requests, tenant_queued_tokens, deadline),
DEADLINE_EXCEEDED when it waited past the server's --max-queue-wait without being scheduled,
NOT_FOUND for another model (or an adapter the call's key may not use: the same message, as
REST's 404), UNAUTHENTICATED without a valid key when keys are set, UNAVAILABLE
when the engine is down or dies (it restarts; retry) or the server is shutting down.

A cancelled call or one past its deadline cancels the handler, which closes the engine stream:
that aborts the request and frees its blocks.

Models: `model` is REST's: empty or a served name is the base model, an adapter's name (from
--lora-modules or loaded over REST: both frontends share the adapters) that adapter, if the
call's key may use it (server/auth.py).

Tenants: a call's tenant is its API key's name, else its `user` field, else "default"; its
`cache_salt`, `ttft_ms` and `tpot_ms` are the REST fields'.

Chat input goes through the same chat template as REST chat (the model's own, or the server's
--chat-template); a model with neither refuses it with INVALID_ARGUMENT.

Ids: a client's `request_id` is a label, unique among its calls in flight on its connection
(peer) with its API key; the engine request gets an id of the server's own. `Abort` finds the
caller's request by (peer, key, label) only, so no client can abort or collide with another's,
nor with a REST request. (The key counts too because a proxy multiplexes many clients onto one
connection.)

An aborted Generate ends at once and cleanly: a Complete with FINISH_REASON_ABORT for each
unfinished sample (with the usage so far), then OK, as a finish_reason "abort" ends an aborted
request in vLLM. The caller asked for it, so it is not an error status; and a client that reads
the stream to its end needs no special case.

Health: grpc.health.v1 says SERVING while the engine's status is ok, NOT_SERVING otherwise
(stalled, restarting, dead, stopping).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from treadle.config import APIKey, ServerConfig
from treadle.core.lora_request import LoRARequest
from treadle.core.sampling_params import SamplingParams
from treadle.frontend.admission import EngineOverloaded
from treadle.frontend.async_engine import AsyncEngine
from treadle.frontend.supervisor import EngineUnavailable
from treadle.server.auth import APIKeys, bearer_token
from treadle.server.chat_template import apply_chat_template, chat_tokenizer
from treadle.server.grpc import treadle_pb2 as pb
from treadle.server.grpc import treadle_pb2_grpc as pb_grpc
from treadle.server.openai.lora_adapters import LoraAdapters
from treadle.server.validation import check_prompt_text

if TYPE_CHECKING:
    from treadle.tokenizer import Tokenizer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "abort": pb.FINISH_REASON_ABORT, "error": pb.FINISH_REASON_ERROR}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed")


def sampling_params(request: pb.GenerateRequest, defaults: dict) -> SamplingParams:
    """SamplingParams from the request's set fields, else `defaults` (the model's generation
    config); ValueError names the bad field."""
    kwargs: dict = {**defaults, **{name: getattr(request.sampling, name)
                                   for name in SAMPLING_FIELDS
                                   if request.sampling.HasField(name)}}
    stop = request.stop
    if stop.HasField("max_tokens"):
        kwargs["max_tokens"] = stop.max_tokens
    if request.HasField("logprobs"):
        kwargs["logprobs"] = request.logprobs
    if request.HasField("n"):
        kwargs["n"] = request.n
    if request.HasField("skip_special_tokens"):
        kwargs["skip_special_tokens"] = request.skip_special_tokens
    return SamplingParams(
        **kwargs, min_tokens=stop.min_tokens, stop=list(stop.stop),
        stop_token_ids=list(stop.stop_token_ids),
        include_stop_str_in_output=stop.include_stop_str_in_output, ignore_eos=stop.ignore_eos,
        logit_bias=dict(request.sampling.logit_bias))


async def overloaded(context: grpc.aio.ServicerContext, error: EngineOverloaded) -> None:
    context.set_trailing_metadata((("treadle-reason", error.reason),))
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: AsyncEngine, chat_tokenizer: Tokenizer, loras: LoraAdapters,
                 api_keys: Sequence[APIKey] = (), model_names: Sequence[str] = ()) -> None:
        """`chat_tokenizer`: the engine's tokenizer, or a copy with the server's chat template;
        `loras`: the adapters served; `model_names`: those a request's `model` may be besides
        them (empty: the model's own name)."""
        self.engine = engine
        self.loras = loras
        self.model_names = tuple(model_names) or (engine.model_name,)
        self.chat_tokenizer = chat_tokenizer
        self.keys = APIKeys(api_keys) if api_keys else None
        # (peer, API key, client's request_id) -> the engine's request id, while the call runs.
        self.calls: dict[tuple[str, str, str], str] = {}

    async def prompt_token_ids(self, request: pb.GenerateRequest | pb.TokenizeRequest,
                               context: grpc.aio.ServicerContext) -> list[int]:
        tokenizer, max_model_len = self.engine.tokenizer, self.engine.max_model_len
        kind = request.WhichOneof("input")
        try:
            if kind == "text":
                check_prompt_text("text", request.text, max_model_len)
                # As REST's completions do: a model whose tokenizer adds <bos> (Gemma) needs it.
                encoded = await asyncio.to_thread(tokenizer, request.text)
                return encoded["input_ids"]
            if kind == "chat":
                messages = [(m.role, m.content) for m in request.chat.messages]
                return await asyncio.to_thread(apply_chat_template, self.chat_tokenizer,
                                               messages, max_model_len)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if kind == "token_ids":
            return list(request.token_ids.ids)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            "input: one of text, token_ids or chat is required")
        raise AssertionError("unreachable: abort raises")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            self.engine.check_available()  # first: a down engine answers at once
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        key = self.key(context)
        lora = await self.adapter(request.model, key, context)
        try:
            params = sampling_params(request, self.engine.sampling_defaults)
            admitted = self.engine.admit(
                None if key is None else key.name, request.user,
                ttft_ms=request.ttft_ms if request.HasField("ttft_ms") else None,
                tpot_ms=request.tpot_ms if request.HasField("tpot_ms") else None,
                cache_salt=request.cache_salt)
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineOverloaded as e:
            await overloaded(context, e)
        options = {"tenant": admitted.tenant, "cache_salt": admitted.cache_salt,
                   "ttft": admitted.ttft, "tpot": admitted.tpot, "lora_request": lora}
        label = caller(context, request.request_id)
        if request.request_id:
            if label in self.calls:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request_id {request.request_id!r} is already in use by a "
                                    f"call in flight on this connection")
            self.calls[label] = request_id = f"grpc-{uuid.uuid4().hex}"
        else:
            request_id = f"grpc-{uuid.uuid4().hex}"
        try:
            with self.loras.in_use(lora.lora_name) if lora is not None else nullcontext():
                async for response in self.generate(request, context, request_id, params,
                                                    options):
                    yield response
        finally:
            if request.request_id:
                self.calls.pop(label, None)

    def key(self, context: grpc.aio.ServicerContext) -> APIKey | None:
        """The caller's API key (the interceptor has let only valid ones in); None: no keys."""
        if self.keys is None:
            return None
        return self.keys.find(dict(context.invocation_metadata() or ()).get("authorization"))

    async def adapter(self, model: str, key: APIKey | None, context: grpc.aio.ServicerContext
                      ) -> LoRARequest | None:
        """The adapter `model` names, None for the base model; NOT_FOUND for a name that is
        neither, or an adapter `key` may not use (one message for both: no key learns of
        adapters not its own)."""
        if not model or model in self.model_names:
            return None
        lora = self.loras.get(model, key)
        if lora is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"the model {model!r} does not exist or you do not have access "
                                f"to it; this server serves {self.model_names[0]!r}")
        return lora

    async def generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       request_id: str, params: SamplingParams, options: dict
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Generate's stream, under the engine's request id."""
        prompt = await self.prompt_token_ids(request, context)
        stream = self.engine.generate(request_id, prompt, params, priority=request.priority,
                                      **options)
        timed_out = False
        try:
            async for update in stream:
                if any(d.finish_reason == "queue_timeout" for d in update.deltas):
                    timed_out = True
                    break
                for delta in update.deltas:
                    if delta.token_ids or delta.text:
                        yield pb.GenerateResponse(chunk=pb.Chunk(
                            index=delta.index, token_ids=delta.token_ids, text=delta.text,
                            logprobs=token_logprobs(delta.logprobs)))
                    if delta.finished:
                        sample = update.state.samples[delta.index]
                        yield pb.GenerateResponse(complete=complete(
                            delta.index, delta.finish_reason, delta.stop_reason,
                            len(prompt), len(sample.token_ids), update.state.num_cached_tokens))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineOverloaded as e:
            await overloaded(context, e)
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            await stream.aclose()  # on cancellation or a deadline: aborts the request
        if timed_out:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the request waited longer than the server's queue time limit "
                                "(max_queue_wait) without being scheduled; retry later")

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> pb.AbortResponse:
        """Abort the caller's own call with this request_id, on this connection."""
        request_id = self.calls.get(caller(context, request.request_id))
        aborted = request_id is not None and await self.engine.abort(request_id)
        return pb.AbortResponse(aborted=aborted)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
                       ) -> pb.TokenizeResponse:
        ids = await self.prompt_token_ids(request, context)
        return pb.TokenizeResponse(token_ids=ids, count=len(ids),
                                   max_model_len=self.engine.max_model_len)

    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
                         ) -> pb.DetokenizeResponse:
        bad = [t for t in request.token_ids if t >= self.engine.vocab_size]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_ids must be in [0, {self.engine.vocab_size}); "
                                f"got {bad[0]}")
        text = await asyncio.to_thread(self.engine.tokenizer.decode, list(request.token_ids))
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return pb.ModelInfo(model=self.model_names[0], max_model_len=self.engine.max_model_len,
                            vocab_size=self.engine.vocab_size)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
                      ) -> pb.Load:
        return pb.Load(**self.engine.load())


def caller(context: grpc.aio.ServicerContext, label: str) -> tuple[str, str, str]:
    """A client's request_id, qualified by who sent it: its connection and its API key."""
    metadata = dict(context.invocation_metadata() or ())
    # The key, not the header's spelling: `Bearer k` and `bearer k` are one caller.
    return context.peer(), bearer_token(metadata.get("authorization")) or "", label


def token_logprobs(logprobs) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top=[
        pb.TopLogprob(token_id=t, logprob=v)
        for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)])
        for lp in logprobs or ()]


def complete(index: int, finish_reason: str | None, stop_reason: str | int | None,
             prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> pb.Complete:
    message = pb.Complete(index=index, finish_reason=FINISH_REASONS.get(
        finish_reason or "", pb.FINISH_REASON_UNSPECIFIED), usage=pb.Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        cached_tokens=cached_tokens))
    if isinstance(stop_reason, str):
        message.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        message.stop_token_id = stop_reason
    return message


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <key>` on the Generation service when keys are set, checked as
    the REST frontend checks it; health and reflection stay open."""

    def __init__(self, api_keys: Sequence[APIKey]) -> None:
        self.keys = APIKeys(api_keys)

    async def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.keys.authorized(metadata.get("authorization")):
            return await continuation(handler_call_details)
        return unauthenticated_handler(await continuation(handler_call_details))


class ParseErrorInterceptor(grpc.aio.ServerInterceptor):
    """A Generation request that does not parse (corrupt bytes, a string that is not UTF-8) is
    INVALID_ARGUMENT; grpc answers UNKNOWN when the deserializer raises. So the handler gets the
    raw bytes and parses them itself."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        parse = handler.request_deserializer

        async def parsed(raw: bytes, context: grpc.aio.ServicerContext):
            try:
                return parse(raw)
            except DecodeError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request does not parse: {e}")

        if handler.response_streaming:
            async def stream(raw, context):
                async for response in handler.unary_stream(await parsed(raw, context), context):
                    yield response
            return grpc.unary_stream_rpc_method_handler(stream, None,
                                                        handler.response_serializer)

        async def unary(raw, context):
            return await handler.unary_unary(await parsed(raw, context), context)
        return grpc.unary_unary_rpc_method_handler(unary, None, handler.response_serializer)


def unauthenticated_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required")

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required")
        yield  # pragma: no cover - makes this an async generator, as the stream handler is

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            deny_stream, handler.request_deserializer, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer,
                                               handler.response_serializer)


async def start_grpc_server(engine: AsyncEngine, config: ServerConfig,
                            loras: LoraAdapters | None = None) -> tuple[grpc.aio.Server, int]:
    """Serve Generation, grpc.health.v1 and reflection on config.host:config.grpc_port (0: a
    free port) over `engine`, which the caller starts; returns the server and its port. From
    `config` too: api_keys, chat_template, served_model_name. `loras`: the adapters served,
    shared with the REST frontend (None: lora_modules's, this server's own). ValueError for a
    chat template that is neither a file nor a template that parses."""
    assert config.grpc_port is not None, "no gRPC port configured"
    tokenizer = chat_tokenizer(engine.tokenizer, config.chat_template)
    # The key first: without one, the request is not even parsed.
    interceptors = [ApiKeyInterceptor(config.api_keys)] if config.api_keys else []
    interceptors.append(ParseErrorInterceptor())
    server = grpc.aio.server(interceptors=interceptors)
    if loras is None:
        loras = LoraAdapters.served(config, engine.config.engine.model)
    pb_grpc.add_GenerationServicer_to_server(
        GenerationServicer(engine, tokenizer, loras, config.api_keys, config.served_model_name),
        server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    async def set_health(status: str) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING if status == "ok" \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, serving)

    await set_health(engine.status)
    updates: set[asyncio.Task] = set()  # referenced until done

    def on_status(status: str) -> None:
        task = asyncio.create_task(set_health(status))
        updates.add(task)
        task.add_done_callback(updates.discard)

    engine.add_listener(on_status)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.grpc_port}"
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    return server, bound
