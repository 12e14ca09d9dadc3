"""gRPC frontend (grpc.aio) over the AsyncEngine: streaming Generate, standard health, reflection.

Status codes: INVALID_ARGUMENT for a request the client got wrong (the message names the field),
RESOURCE_EXHAUSTED when the queue is full, NOT_FOUND for another model, UNAUTHENTICATED without a
valid key when keys are set. A cancelled call or one past its deadline cancels the handler, which
closes the engine stream: that aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from treadle.engine.async_engine import AsyncEngine, EngineOverloaded
from treadle.engine.sampling_params import SamplingParams
from treadle.server.grpc import treadle_pb2 as pb
from treadle.server.grpc import treadle_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "abort": pb.FINISH_REASON_ABORT, "error": pb.FINISH_REASON_ERROR}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed")


def sampling_params(request: pb.GenerateRequest) -> SamplingParams:
    """SamplingParams from the request's set fields; ValueError names the bad field."""
    kwargs: dict = {name: getattr(request.sampling, name) for name in SAMPLING_FIELDS
                    if request.sampling.HasField(name)}
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


def chat_messages(chat: pb.ChatMessages) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in chat.messages]


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def prompt_token_ids(self, request: pb.GenerateRequest | pb.TokenizeRequest,
                               context: grpc.aio.ServicerContext) -> list[int]:
        tokenizer = self.engine.tokenizer
        kind = request.WhichOneof("input")
        if kind == "text":
            encoded = await asyncio.to_thread(tokenizer, request.text, add_special_tokens=False)
            return encoded["input_ids"]
        if kind == "chat":
            return await asyncio.to_thread(
                tokenizer.apply_chat_template, chat_messages(request.chat), tokenize=True,
                add_generation_prompt=True, return_dict=False)
        if kind == "token_ids":
            return list(request.token_ids.ids)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            "input: one of text, token_ids or chat is required")
        raise AssertionError("unreachable: abort raises")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        if request.model and request.model != self.engine.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model {request.model!r} is not served here; "
                                f"this server serves {self.engine.model_name!r}")
        try:
            params = sampling_params(request)
            self.engine.check_capacity()  # before tokenizing: refuse cheaply
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineOverloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        prompt = await self.prompt_token_ids(request, context)
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        stream = self.engine.generate(request_id, prompt, params, priority=request.priority)
        try:
            async for update in stream:
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
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        finally:
            await stream.aclose()  # on cancellation or a deadline: aborts the request

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> pb.AbortResponse:
        known = bool(self.engine.processor.engine_ids(request.request_id))
        await self.engine.abort(request.request_id)
        return pb.AbortResponse(aborted=known)

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
        return pb.ModelInfo(model=self.engine.model_name, max_model_len=self.engine.max_model_len,
                            vocab_size=self.engine.vocab_size)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
                      ) -> pb.Load:
        return pb.Load(**self.engine.load())


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
    """`authorization: Bearer <key>` on the Generation service when keys are set; health and
    reflection stay open. Keys are compared in constant time."""

    def __init__(self, api_keys: Sequence[str]) -> None:
        self.api_keys = [k.encode() for k in api_keys]

    async def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "").removeprefix("Bearer ").encode()
        if any(hmac.compare_digest(given, key) for key in self.api_keys):
            return await continuation(handler_call_details)
        return unauthenticated_handler(await continuation(handler_call_details))


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


async def start_grpc_server(engine: AsyncEngine, host: str = "127.0.0.1", port: int = 50051,
                            api_keys: Sequence[str] = ()) -> tuple[grpc.aio.Server, int]:
    """Serve Generation, grpc.health.v1 and reflection; returns the server and its port."""
    interceptors = [ApiKeyInterceptor(api_keys)] if api_keys else []
    server = grpc.aio.server(interceptors=interceptors)
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(engine), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    return server, bound
