"""Faults thrown at a real `treadle serve` (the CLI in a subprocess, the default model in float32,
REST and gRPC on loopback): gRPC aborts, client ids that look like engine ids, an engine killed
with SIGKILL or stopped with SIGSTOP mid-stream, SIGTERM under load. Clients are httpx (raw SSE,
to see each stream's last events as sent) and grpc.aio; every wait is bounded, so a hang fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from treadle.server.grpc import treadle_pb2 as pb
from treadle.server.grpc import treadle_pb2_grpc as pb_grpc

pytestmark = pytest.mark.default_model

MAX_MODEL_LEN = 256
STALL_TIMEOUT = 2.0
RESTART_TIME = 90  # a restart loads the model again: seconds on a busy 2-core machine
TIMEOUT = 120  # for what is only slow on a loaded machine; the fault reactions have their own
PROMPT = "The capital of France is"
LONG = "Count to a thousand:"
IDLE = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Channels in one process share connections by default; this one gets its own, as another
# client's would.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    grpc_target: str
    log: Path

    def engine_pid(self) -> int:
        """The engine process: the server's multiprocessing child (not its resource tracker)."""
        for children in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            for pid in children.read_text().split():
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"spawn_main" in f.read():
                        return int(pid)
        raise AssertionError(f"no engine process:\n{self.log.read_text()}")


@contextmanager
def serve(log: Path, *flags: str) -> Iterator[Server]:
    """The CLI server, once /health answers 200; killed, with its engine, if still alive."""
    port, grpc_port = free_port(), free_port()
    with log.open("wb") as out:
        # Its own session: the kill below reaches the engine child too, and nothing else.
        proc = subprocess.Popen(
            [sys.executable, "-m", "treadle.cli", "serve", "--dtype", "float32",
             "--port", str(port), "--grpc-port", str(grpc_port),
             "--max-model-len", str(MAX_MODEL_LEN), "--engine-stall-timeout", str(STALL_TIMEOUT),
             *flags], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", log)
    try:
        wait_healthy(server, 120)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert server.proc.poll() is None, f"the server exited:\n{server.log.read_text()}"
        assert time.monotonic() < deadline, f"the server is not healthy:\n{server.log.read_text()}"
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def wait_idle(server: Server, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = httpx.get(f"{server.url}/ready", timeout=5).json()
        load = {k: body[k] for k in IDLE}
        if load == IDLE or time.monotonic() > deadline:
            return load
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("faults") / "server.log") as server:
        yield server


@dataclass
class SSE:
    """One streaming completion: its data lines as they came, and when it ended."""

    events: list[str] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    ended: float | None = None

    async def read(self, http: httpx.AsyncClient, url: str, max_tokens: int,
                   prompt: str = LONG) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.started.set()
        finally:
            self.ended = time.monotonic()
            self.started.set()

    def error(self) -> dict:
        """The error event that ended the stream, checked to be followed by [DONE]."""
        assert self.events[-1] == "[DONE]", self.events[-3:]
        return json.loads(self.events[-2])["error"]

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events if e != "[DONE]"
                for c in json.loads(e).get("choices", ()) if c["finish_reason"]]


def generate(prompt: str, max_tokens: int, n: int = 1, **fields) -> pb.GenerateRequest:
    """Greedy, or seeded samples for n > 1."""
    sampling = pb.SamplingParameters(temperature=0) if n == 1 \
        else pb.SamplingParameters(temperature=0.8, seed=1)
    return pb.GenerateRequest(text=prompt, sampling=sampling, n=n,
                              stop=pb.StopCriteria(max_tokens=max_tokens, ignore_eos=True),
                              **fields)


async def drain(call) -> tuple[list[int], list[pb.Complete]]:
    tokens, completes = [], []
    while (response := await call.read()) is not grpc.aio.EOF:  # read(): as the caller began
        if response.HasField("chunk"):
            tokens += response.chunk.token_ids
        else:
            completes.append(response.complete)
    return tokens, completes


async def health_status(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=5)
    return reply.status


def test_grpc_abort_ends_its_stream_and_reaches_only_the_callers(server):
    async def scenario():
        async with grpc.aio.insecure_channel(server.grpc_target) as mine, \
                grpc.aio.insecure_channel(server.grpc_target, OWN_CONNECTION) as other, \
                httpx.AsyncClient(timeout=TIMEOUT) as http:
            rest = SSE()
            rest_task = asyncio.create_task(rest.read(http, server.url, 8))
            stub = pb_grpc.GenerationStub(mine)
            call = stub.Generate(generate(LONG, 200, request_id="victim", n=2), timeout=TIMEOUT)
            assert (await call.read()).HasField("chunk")
            await asyncio.wait_for(rest.started.wait(), TIMEOUT)
            rest_id = json.loads(rest.events[0])["id"]

            # Another connection cannot abort it; nobody can abort a REST request by its id.
            assert not (await pb_grpc.GenerationStub(other).Abort(
                pb.AbortRequest(request_id="victim"), timeout=5)).aborted
            assert not (await stub.Abort(pb.AbortRequest(request_id=rest_id), timeout=5)).aborted

            aborted_at = time.monotonic()
            assert (await stub.Abort(pb.AbortRequest(request_id="victim"), timeout=5)).aborted
            _, completes = await asyncio.wait_for(drain(call), 5)
            assert time.monotonic() - aborted_at < 1
            assert await call.code() == grpc.StatusCode.OK
            assert sorted(c.index for c in completes) == [0, 1]
            assert {c.finish_reason for c in completes} == {pb.FINISH_REASON_ABORT}
            assert all(c.usage.completion_tokens >= 1 for c in completes)
            # Done: the id is free again, and unknown to Abort.
            assert not (await stub.Abort(pb.AbortRequest(request_id="victim"), timeout=5)).aborted

            await asyncio.wait_for(rest_task, TIMEOUT)
            assert rest.events[-1] == "[DONE]" and rest.finish_reasons() == ["length"]

    asyncio.run(scenario())
    assert wait_idle(server) == IDLE


def test_client_ids_are_labels_never_engine_ids(server):
    async def scenario():
        async with grpc.aio.insecure_channel(server.grpc_target) as a_channel, \
                grpc.aio.insecure_channel(server.grpc_target, OWN_CONNECTION) as b_channel, \
                httpx.AsyncClient(timeout=TIMEOUT) as http:
            a, b = pb_grpc.GenerationStub(a_channel), pb_grpc.GenerationStub(b_channel)
            reference = (await http.post(f"{server.url}/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True})).json()["choices"][0]
            # Long enough to stay in flight while B runs and the client sends the duplicate:
            # with 8 tokens a loaded machine's slow client saw A finish first.
            a_call = a.Generate(generate(LONG, 64, request_id="victim", n=2), timeout=TIMEOUT)
            assert (await a_call.read()).HasField("chunk")

            # B names its request as A's first sample would be named: B gets its own tokens.
            b_text = ""
            async for response in b.Generate(generate(PROMPT, 4, request_id="victim-0"),
                                             timeout=TIMEOUT):
                if response.HasField("chunk"):
                    b_text += response.chunk.text
                else:
                    assert response.complete.finish_reason == pb.FINISH_REASON_LENGTH
            assert b_text == reference["text"]

            # The same label twice in flight on one connection is refused, A untouched.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await drain(a.Generate(generate(PROMPT, 8, request_id="victim"),
                                       timeout=TIMEOUT))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            _, completes = await asyncio.wait_for(drain(a_call), TIMEOUT)
            assert sorted(c.index for c in completes) == [0, 1]
            assert {c.finish_reason for c in completes} == {pb.FINISH_REASON_LENGTH}

    asyncio.run(scenario())
    assert wait_idle(server) == IDLE


def test_a_stopped_engine_turns_not_ready_within_the_stall_timeout(server):
    async def scenario():
        async with grpc.aio.insecure_channel(server.grpc_target) as channel, \
                httpx.AsyncClient(timeout=TIMEOUT) as http:
            call = pb_grpc.GenerationStub(channel).Generate(generate(LONG, 12), timeout=TIMEOUT)
            assert (await call.read()).HasField("chunk")
            engine = server.engine_pid()
            os.kill(engine, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                while (ready := await http.get(f"{server.url}/ready")).status_code == 200:
                    assert time.monotonic() - stopped < STALL_TIMEOUT + 1.5
                    await asyncio.sleep(0.05)
                assert ready.json()["status"] == "stalled"
                health = await http.get(f"{server.url}/health")
                assert health.status_code == 503 and health.json() == {"status": "stalled"}
                assert await health_status(channel) == NOT_SERVING
            finally:
                os.kill(engine, signal.SIGCONT)
            # It resumes: ready again, and the stream runs to its end.
            _, completes = await asyncio.wait_for(drain(call), TIMEOUT)
            assert [c.finish_reason for c in completes] == [pb.FINISH_REASON_LENGTH]

    asyncio.run(scenario())
    wait_healthy(server, TIMEOUT)


def test_a_killed_engine_fails_requests_at_once_and_restarts(server):
    async def scenario():
        async with grpc.aio.insecure_channel(server.grpc_target) as channel, \
                httpx.AsyncClient(timeout=TIMEOUT) as http:
            streams = [SSE(), SSE()]
            tasks = [asyncio.create_task(s.read(http, server.url, 200)) for s in streams]
            whole = asyncio.create_task(http.post(f"{server.url}/v1/completions", json={
                "prompt": LONG, "max_tokens": 200, "ignore_eos": True}))
            call = pb_grpc.GenerationStub(channel).Generate(generate(LONG, 200), timeout=TIMEOUT)
            assert (await call.read()).HasField("chunk")
            for stream in streams:
                await asyncio.wait_for(stream.started.wait(), TIMEOUT)

            os.kill(server.engine_pid(), signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), 1.5)
            for stream in streams:
                assert stream.ended - killed < 1
                error = stream.error()
                assert error["type"] == "engine_error" and "died" in error["message"]
            response = await asyncio.wait_for(whole, 1)
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "engine_error"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(drain(call), 1)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - killed < 1.5

            # Down: unhealthy on both frontends, and new requests refused at once.
            health = await http.get(f"{server.url}/health")
            assert health.status_code == 503 and health.json() == {"status": "restarting"}
            assert await health_status(channel) == NOT_SERVING
            asked = time.monotonic()
            refused = await http.post(f"{server.url}/v1/completions",
                                      json={"prompt": PROMPT, "max_tokens": 4})
            assert refused.status_code == 503 and time.monotonic() - asked < 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await drain(pb_grpc.GenerationStub(channel).Generate(generate(PROMPT, 4),
                                                                      timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())
    # Back within the restart time, serving, with every block free.
    wait_healthy(server, RESTART_TIME)
    out = httpx.post(f"{server.url}/v1/completions", timeout=30,
                     json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 4
    assert wait_idle(server) == IDLE
    metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert 'treadle:num_requests_running{model_name="SmolLM2-135M-Instruct"} 0.0' in metrics


@pytest.mark.slow
def test_without_restarts_a_dead_engine_stops_the_server(tmp_path):
    async def scenario(server: Server):
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            stream = SSE()
            task = asyncio.create_task(stream.read(http, server.url, 200))
            await asyncio.wait_for(stream.started.wait(), TIMEOUT)
            os.kill(server.engine_pid(), signal.SIGKILL)
            await asyncio.wait_for(task, 1.5)
            assert stream.error()["type"] == "engine_error"

    with serve(tmp_path / "server.log", "--no-restart-engine") as server:
        asyncio.run(scenario(server))
        assert server.proc.wait(10) == 1  # for an orchestrator to start a new one


@pytest.mark.slow
def test_sigterm_under_load_ends_every_stream_with_server_shutdown(tmp_path):
    grace = 1.0

    async def scenario(server: Server):
        async with grpc.aio.insecure_channel(server.grpc_target) as channel, \
                httpx.AsyncClient(timeout=TIMEOUT) as http:
            streams = [SSE() for _ in range(6)]
            tasks = [asyncio.create_task(s.read(http, server.url, MAX_MODEL_LEN - 16))
                     for s in streams]
            call = pb_grpc.GenerationStub(channel).Generate(
                generate(LONG, MAX_MODEL_LEN - 16), timeout=TIMEOUT)
            assert (await call.read()).HasField("chunk")
            for stream in streams:
                await asyncio.wait_for(stream.started.wait(), TIMEOUT)
            server.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), grace + 2)
            for stream in streams:
                assert stream.error()["type"] == "server_shutdown"
                assert stream.ended - sent < grace + 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(drain(call), 2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            return sent

    with serve(tmp_path / "server.log", "--shutdown-timeout", str(grace)) as server:
        sent = asyncio.run(scenario(server))
        assert server.proc.wait(5) == 0
        assert time.monotonic() - sent < grace + 1.5  # the timeout and a second, and polling
