"""What both `bench serve` clients share: the timing of one streamed request and the backend
interface (REST in `serve`, gRPC in `grpc_client`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from treadle.bench.metrics import RequestRecord

Clock = Callable[[], float]
Send = Callable[[int, float], Awaitable[RequestRecord]]  # (request index, start) -> record


class Backend(Protocol):
    def connect(self, max_connections: int | None) -> AbstractAsyncContextManager[Send]: ...


class StreamTimer:
    """Times one streamed request: TTFT at the first token-carrying chunk, one ITL per later
    chunk, E2E at the last one."""

    def __init__(self, record: RequestRecord, clock: Clock) -> None:
        self.record, self.clock = record, clock
        self.sent = self.last = clock()
        self.chunks = 0

    def token_chunk(self) -> None:
        now = self.clock()
        if self.chunks == 0:
            self.record.ttft = now - self.sent
        else:
            self.record.itl.append(now - self.last)
        self.last = now
        self.chunks += 1

    def finish(self, completion_tokens: int | None, prompt_tokens: int | None
               ) -> RequestRecord:
        """The record of a stream that ended well, with the server's usage where it sent it
        (else its chunks are counted as tokens)."""
        record = self.record
        if self.chunks == 0:
            record.error = "the stream carried no token"
            return record
        record.success = True
        record.e2e = self.last - self.sent
        record.output_tokens = completion_tokens or self.chunks
        record.prompt_tokens = prompt_tokens or record.prompt_tokens
        return record
