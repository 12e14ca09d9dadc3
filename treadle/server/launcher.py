"""`treadle serve`: one engine, the REST frontend (HTTPS with ssl_keyfile and ssl_certfile) and,
when grpc_port is set, the gRPC frontend over it, started and stopped together.

Start: the engine (its process loads the model), then gRPC, then REST (uvicorn). A model that
fails to load ends the server with status 1.

Stop, on SIGTERM or SIGINT: both frontends refuse new work at once (REST closes its listener,
gRPC refuses new calls, the engine new requests); requests still running when shutdown_timeout
ends get a last error of their own (an SSE `server_shutdown` event and `[DONE]`, gRPC
UNAVAILABLE), so no stream is cut off; then the engine stops, and `serve` returns 0. An engine
dead for good (no restarts left) stops the server the same way with status 1, so that whatever
runs it starts a new one.

The access log writes paths without their query values: no route takes a query parameter, and
a key may come in one (the dashboard's link, `/dashboard?key=...`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import grpc
import uvicorn

from treadle.config import ServerConfig
from treadle.frontend.async_engine import AsyncEngine
from treadle.frontend.supervisor import UNAVAILABLE, EngineUnavailable
from treadle.server.grpc.servicer import start_grpc_server
from treadle.server.openai.app import build_app
from treadle.server.openai.lora_adapters import LoraAdapters

logger = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RedactQueryValues(logging.Filter):
    """Uvicorn's access log line, each query value (or nameless item) in its path replaced by
    `[redacted]`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(arg) if isinstance(arg, str) else arg
                                for arg in record.args)
        return True


def redact_query(path: str) -> str:
    path, mark, query = path.partition("?")
    return path + mark + "&".join(f"{name}=[redacted]" if equals else "[redacted]" if name else ""
                                  for name, equals, _ in (item.partition("=")
                                                          for item in query.split("&")))


REDACT_QUERY_VALUES = RedactQueryValues()


class GracefulServer(uvicorn.Server):
    """uvicorn whose shutdown also stops the gRPC frontend from taking calls, ends the requests
    still running at the grace period's end with a last error of their own, and that stops by
    itself once the engine is dead for good. Signals are the launcher's (`Frontends`)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace: float,
                 grpc_server: grpc.aio.Server | None) -> None:
        super().__init__(config)
        self.engine, self.grace, self.grpc_server = engine, grace, grpc_server
        self.engine_dead = False
        self.signalled: float | None = None  # when SIGTERM or SIGINT came: the grace starts
        self.grpc_stopping: asyncio.Task | None = None
        engine.add_listener(self.on_engine_status)

    def on_engine_status(self, status: str) -> None:
        if status == "dead":  # exit, so that whatever runs the server starts a new one
            self.engine_dead = self.should_exit = True

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's would re-raise the signal once it has served, before the launcher has
        # stopped gRPC and the engine: the launcher installs its own handlers instead.
        yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.signalled is None:
            self.signalled = time.monotonic()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list | None = None) -> None:
        self.engine.drain()
        if self.grpc_server is not None:  # refuses new calls now; cancels what our ending missed
            self.grpc_stopping = asyncio.create_task(self.grpc_server.stop(grace=self.grace + 1))
        # uvicorn notices the signal on its next tick (0.1 s): count the grace from the signal.
        elapsed = 0.0 if self.signalled is None else time.monotonic() - self.signalled
        ending = asyncio.get_running_loop().call_later(
            max(self.grace - elapsed, 0.0), self.engine.fail_all,
            EngineUnavailable(UNAVAILABLE["stopping"], "server_shutdown"))
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()


class Frontends:
    """Both frontends over `engine`, configured by `config`; `serve` runs them (in a thread too,
    as the tests do: signals are then the caller's, and `stop` stands in for them)."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        """ValueError for a chat template that is neither a file nor a template that parses;
        OSError (ssl.SSLError) for an unreadable or bad SSL key or certificate."""
        self.engine, self.config = engine, config
        # One set of adapters for both frontends: one loaded over REST is one gRPC can name.
        self.loras = LoraAdapters.served(config, engine.config.engine.model)
        self.app = build_app(engine, config, self.loras)
        # uvicorn's own cancelling of the requests still running is the backstop: by then ours
        # have ended with their last event.
        self.uvicorn_config = uvicorn.Config(
            self.app, host=config.host, port=config.port,
            timeout_graceful_shutdown=config.shutdown_timeout + 0.5,
            log_level=config.uvicorn_log_level, access_log=not config.disable_uvicorn_access_log,
            root_path=config.root_path, ssl_keyfile=config.ssl_keyfile,
            ssl_certfile=config.ssl_certfile)
        if config.ssl_certfile is not None:  # a bad key or certificate: an error before starting
            self.uvicorn_config.load()
        # After uvicorn.Config, which configures its loggers; one filter, however many servers.
        logging.getLogger("uvicorn.access").addFilter(REDACT_QUERY_VALUES)
        self.rest: GracefulServer | None = None
        self.grpc_server: grpc.aio.Server | None = None
        self.grpc_port: int | None = None  # the port bound, once started
        self.starting: asyncio.Task | None = None
        self.stopped = False

    @property
    def started(self) -> bool:
        """Both frontends take requests."""
        return self.rest is not None and self.rest.started

    @property
    def port(self) -> int:
        """The REST port bound (config.port 0: a free one), once started."""
        assert self.rest is not None and self.rest.started, "not started"
        return self.rest.servers[0].sockets[0].getsockname()[1]

    def stop(self, sig: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        """Stop as on SIGTERM: at once while the model loads, else gracefully."""
        self.stopped = True
        if self.rest is not None:
            self.rest.handle_exit(sig, frame)
        elif self.starting is not None:
            self.starting.get_loop().call_soon_threadsafe(self.starting.cancel)

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT (0), or until the engine is dead for good or fails to
        start (1)."""
        with asyncio.Runner(loop_factory=self.uvicorn_config.get_loop_factory()) as runner:
            return runner.run(self.serve())

    async def serve(self) -> int:
        with self.signals_stop():
            self.starting = asyncio.create_task(self.engine.start())
            try:
                await self.starting
            except asyncio.CancelledError:  # stopped while the model loaded
                await self.engine.shutdown()
                return 0
            except RuntimeError as e:  # the model did not load
                logger.error("%s", e)
                await self.engine.shutdown()
                return 1
            try:
                if self.config.grpc_port is not None:
                    self.grpc_server, self.grpc_port = await start_grpc_server(
                        self.engine, self.config, self.loras)
                self.rest = GracefulServer(self.uvicorn_config, self.engine,
                                           self.config.shutdown_timeout, self.grpc_server)
                if self.stopped:  # a signal came while gRPC started
                    self.rest.handle_exit(signal.SIGTERM, None)
                await self.rest.serve()
            finally:
                if self.grpc_server is not None:
                    await self.grpc_server.stop(grace=None)
                await self.engine.shutdown()
        return 1 if self.rest.engine_dead else 0

    @contextmanager
    def signals_stop(self) -> Iterator[None]:
        """SIGTERM and SIGINT call `stop` while serving (signals reach the main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.stop) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(engine: AsyncEngine, config: ServerConfig) -> int:
    """`treadle serve`: run both frontends over `engine` (not yet started) until SIGTERM or
    SIGINT (0), or until the engine is dead for good or fails to start (1); 2 for a bad chat
    template or SSL file, before anything starts."""
    try:
        frontends = Frontends(engine, config)
    except (ValueError, OSError) as e:
        print(f"treadle: {e}", file=sys.stderr)
        return 2
    return frontends.run()
