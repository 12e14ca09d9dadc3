"""The gRPC frontend with a real grpc.aio client on loopback, over the default model (float32)
with its engine in its own process."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from treadle.config import AsyncEngineConfig, ServerConfig, build_config
from treadle.core.sampling_params import SamplingParams
from treadle.frontend.async_engine import AsyncEngine
from treadle.llm import LLM
from treadle.server.auth import parse_api_keys
from treadle.server.grpc import treadle_pb2 as pb
from treadle.server.grpc import treadle_pb2_grpc as pb_grpc
from treadle.server.grpc.servicer import SERVICE_NAME, start_grpc_server

pytestmark = pytest.mark.default_model

IDLE = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}
QUESTION = "Write a haiku about the sea."


async def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while engine.load() != IDLE and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return engine.load()


def chat(question: str) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=question)])


@pytest.fixture(scope="module")
def offline_sample():
    """The same seeded request through the offline API: an independent path to the engine."""
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=1234, ignore_eos=True)
    return llm.generate([llm.chat_prompt(QUESTION)], params, use_tqdm=False)[0].outputs[0]


def test_grpc_frontend(offline_sample):
    async def scenario():
        engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
            dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20)))
        await engine.start()
        config = ServerConfig(grpc_port=0, api_keys=tuple(parse_api_keys(["sekrit"])))
        server, port = await start_grpc_server(engine, config)
        auth = (("authorization", "Bearer sekrit"),)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)

                # A seeded request streams what the offline API samples.
                request = pb.GenerateRequest(
                    chat=chat(QUESTION), sampling=pb.SamplingParameters(temperature=0.8,
                                                                        seed=1234),
                    stop=pb.StopCriteria(max_tokens=24, ignore_eos=True), logprobs=2)
                tokens, text, completes = [], "", []
                async for response in stub.Generate(request, metadata=auth):
                    if response.HasField("chunk"):
                        tokens += response.chunk.token_ids
                        text += response.chunk.text
                        assert len(response.chunk.logprobs) == len(response.chunk.token_ids)
                    else:
                        completes.append(response.complete)
                assert tokens == offline_sample.token_ids and text == offline_sample.text
                assert len(completes) == 1
                assert completes[0].finish_reason == pb.FINISH_REASON_LENGTH
                assert completes[0].usage.completion_tokens == 24

                # No key, a wrong key: UNAUTHENTICATED.
                for metadata in ((), (("authorization", "Bearer nope"),)):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.GetLoad(pb.GetLoadRequest(), metadata=metadata)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

                # Bad arguments name the field; another model is NOT_FOUND.
                for bad, field in ((pb.SamplingParameters(temperature=-1), "temperature"),
                                   (pb.SamplingParameters(top_p=0), "top_p")):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in stub.Generate(pb.GenerateRequest(
                                text="hi", sampling=bad), metadata=auth):
                            pass
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert field in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(pb.GenerateRequest(
                            text="hi", stop=pb.StopCriteria(max_tokens=10**6)), metadata=auth):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "max_model_len" in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(pb.GenerateRequest(text="hi", model="gpt-4"),
                                                 metadata=auth):
                        pass
                assert err.value.code() == grpc.StatusCode.NOT_FOUND

                # Cancel mid-stream: the request is aborted and its blocks freed.
                long = pb.GenerateRequest(text="Count to a thousand:",
                                          stop=pb.StopCriteria(max_tokens=1000, ignore_eos=True))
                call = stub.Generate(long, metadata=auth)
                async for _ in call:
                    break
                call.cancel()
                assert await wait_idle(engine) == IDLE

                # A short deadline: DEADLINE_EXCEEDED, and the blocks come back too.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(long, metadata=auth, timeout=0.5):
                        pass
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert await wait_idle(engine) == IDLE

                # Tokenize / Detokenize / model info round-trip.
                tokenized = await stub.Tokenize(pb.TokenizeRequest(text="Hello world"),
                                                metadata=auth)
                assert tokenized.token_ids == engine.tokenizer("Hello world")["input_ids"]
                detok = await stub.Detokenize(
                    pb.DetokenizeRequest(token_ids=tokenized.token_ids), metadata=auth)
                assert detok.text == "Hello world"
                info = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=auth)
                assert info.model == engine.model_name and info.max_model_len > 0

                # The standard health service answers SERVING without a key.
                health = health_pb2_grpc.HealthStub(channel)
                for service in ("", SERVICE_NAME):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING

                # Reflection lists the service.
                reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
                services = []
                async for reply in reflect.ServerReflectionInfo(iter(
                        [reflection_pb2.ServerReflectionRequest(list_services="")])):
                    services += [s.name for s in reply.list_services_response.service]
                assert SERVICE_NAME in services
        finally:
            await server.stop(grace=None)
            await engine.shutdown()

    asyncio.run(scenario())
