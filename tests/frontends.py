"""Both frontends of `treadle serve` (treadle.server.launcher.Frontends: the engine, gRPC, REST)
run in a thread over a test's engine, on free loopback ports, as the CLI runs them."""

from __future__ import annotations

import threading
import time

from treadle.config import ServerConfig
from treadle.frontend.async_engine import AsyncEngine
from treadle.server.launcher import Frontends


def start_frontends(engine: AsyncEngine, config: ServerConfig
                    ) -> tuple[Frontends, threading.Thread]:
    """Start them (the engine's model loads meanwhile); `wait_started` waits for them. Ports 0
    are free ones (`frontends.port`, `frontends.grpc_port`); gRPC only with a grpc_port, as
    `treadle serve` opens it only with --grpc-port."""
    frontends = Frontends(engine, config)
    thread = threading.Thread(target=frontends.run, daemon=True)
    thread.start()
    return frontends, thread


def wait_started(frontends: Frontends, thread: threading.Thread, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not frontends.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)


def stop_frontends(frontends: Frontends, thread: threading.Thread) -> None:
    """As on SIGTERM; then the engine has stopped."""
    frontends.stop()
    thread.join(60)
    assert not thread.is_alive(), "the server did not stop"
