"""`treadle bench serve --backend grpc`: the same requests over Treadle's gRPC API (streaming
Generate, treadle.v1), timed as the REST client times them. Only the generated message stubs
are shared with the server: the client speaks to it over the network.

A Chunk names its token ids, so the token count falls back to them when a Complete carries no
usage; each Chunk still gives one ITL, whatever its token count, as over REST.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from treadle.bench.metrics import RequestRecord
from treadle.bench.streaming import Clock, Send, StreamTimer
from treadle.bench.workloads import BenchRequest
from treadle.server.grpc import treadle_pb2 as pb
from treadle.server.grpc import treadle_pb2_grpc as pb_grpc

FAILED = (pb.FINISH_REASON_ABORT, pb.FINISH_REASON_ERROR)


async def send_grpc_request(stub: pb_grpc.GenerationStub, message: pb.GenerateRequest,
                            prompt_len: int, start: float, metadata: tuple = (),
                            clock: Clock = time.perf_counter, tenant: str = "") -> RequestRecord:
    record = RequestRecord(start=start, prompt_tokens=prompt_len, tenant=tenant)
    timer = StreamTimer(record, clock)
    tokens = 0
    usage: pb.Usage | None = None
    try:
        async for response in stub.Generate(message, metadata=metadata):
            if response.WhichOneof("response") == "chunk":
                timer.token_chunk()
                tokens += len(response.chunk.token_ids)
                continue
            done = response.complete
            if done.finish_reason in FAILED:
                record.error = f"finished with {pb.FinishReason.Name(done.finish_reason)}"
                return record
            usage = done.usage if done.HasField("usage") else None
    except grpc.aio.AioRpcError as e:
        record.error = f"gRPC {e.code().name}: {e.details()}"
        return record
    return timer.finish(usage.completion_tokens if usage else tokens,
                        usage.prompt_tokens if usage else None)


class GrpcBackend:
    """Streaming Generate on `target` (host:port; a scheme before it is dropped)."""

    def __init__(self, target: str, model: str, requests: list[BenchRequest],
                 prompt_format: str, ignore_eos: bool, api_key: str | None = None,
                 tenants: list[str] | None = None, tenant_keys: dict[str, str] | None = None,
                 objectives: dict[str, float] | None = None) -> None:
        self.target = target.split("://", 1)[-1].rstrip("/")
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.tenants = tenants or [""] * len(requests)
        tenant_keys = tenant_keys or {}
        self.metadata = [(("authorization", f"Bearer {tenant_keys[t]}"),) if t in tenant_keys
                         else metadata for t in self.tenants]
        self.prompt_lens = [r.prompt_len for r in requests]
        extra = {f"{name}_ms": ms for name, ms in (objectives or {}).items()}
        self.messages = [pb.GenerateRequest(
            model=model, sampling=pb.SamplingParameters(temperature=0.0),
            stop=pb.StopCriteria(max_tokens=r.output_len, ignore_eos=ignore_eos),
            user=tenant if tenant not in tenant_keys else "", **extra,
            **({"token_ids": pb.TokenIds(ids=r.prompt_token_ids)} if prompt_format == "ids"
               else {"text": r.prompt})) for r, tenant in zip(requests, self.tenants, strict=True)]

    @asynccontextmanager
    async def connect(self, max_connections: int | None) -> AsyncIterator[Send]:
        # One HTTP/2 channel multiplexes every stream, as a gRPC client usually does.
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            yield lambda i, start: send_grpc_request(stub, self.messages[i],
                                                     self.prompt_lens[i], start,
                                                     self.metadata[i], tenant=self.tenants[i])
