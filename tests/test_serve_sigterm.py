"""`treadle serve` on SIGTERM, as a process manager stops it: the server stops accepting at once,
lets the in-flight stream run to its end within --shutdown-timeout (or, past it, ends it with a
server_shutdown error event and [DONE]), and exits 0 within the timeout and a second. Each case
starts the real CLI in a subprocess and streams over raw HTTP, so that the SSE stream's end is
seen as sent."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.default_model

MAX_MODEL_LEN = 256
PROMPT = "The capital of France is"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve(shutdown_timeout: float, log: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """The CLI server, once /health answers; killed, with its engine process, if still alive."""
    port = free_port()
    with log.open("wb") as out:
        # Its own session: the kill below reaches the engine child too, and nothing else.
        proc = subprocess.Popen(
            [sys.executable, "-m", "treadle.cli", "serve", "--dtype", "float32",
             "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN),
             "--shutdown-timeout", str(shutdown_timeout)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the server exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the server did not start:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class Stream:
    """One streaming completion, read in a thread: its SSE data lines, or the error that ended
    it."""

    url: str
    max_tokens: int
    events: list[str] = field(default_factory=list)
    error: Exception | None = None
    first: threading.Event = field(default_factory=threading.Event)

    def read(self) -> None:
        body = {"prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body,
                              timeout=60) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.first.set()
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.first.set()  # a stream that failed at once must not leave the test waiting

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for chunk in self.chunks() for c in chunk.get("choices", ())
                if c["finish_reason"] is not None]


def sigterm_mid_stream(proc: subprocess.Popen, url: str, max_tokens: int
                       ) -> tuple[Stream, threading.Thread, float]:
    """Start a stream, SIGTERM the server once its first token arrived, and return once a new
    connection is refused: the stream, its reader, when the signal was sent."""
    stream = Stream(url, max_tokens)
    reader = threading.Thread(target=stream.read, daemon=True)
    reader.start()
    assert stream.first.wait(60) and stream.error is None, stream.error
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    deadline = sent + 5
    while True:
        # uvicorn notices the signal on its next tick (0.1 s), then closes its listener.
        try:
            httpx.get(f"{url}/health", timeout=1)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            # Refused, or reset: a connection still in the closing listener's backlog (CI).
            return stream, reader, sent
        assert time.monotonic() < deadline, "new connections were still accepted after SIGTERM"
        time.sleep(0.05)


def test_sigterm_lets_the_in_flight_stream_finish(tmp_path: Path) -> None:
    max_tokens = 60
    # A generous timeout: on two loaded cores 60 tokens took over 10 s.
    with serve(shutdown_timeout=60, log=tmp_path / "server.log") as (proc, url):
        stream, reader, _ = sigterm_mid_stream(proc, url, max_tokens)
        assert reader.is_alive(), "the stream ended before the listener closed"
        reader.join(75)
        assert not reader.is_alive() and stream.error is None, stream.error
        assert stream.events[-1] == "[DONE]"
        assert stream.finish_reasons() == ["length"], stream.events[-3:]
        assert stream.chunks()[-1]["usage"]["completion_tokens"] == max_tokens
        assert proc.wait(75) == 0, (tmp_path / "server.log").read_text()


def test_sigterm_past_the_timeout_ends_the_stream_with_server_shutdown(tmp_path: Path) -> None:
    # Far more tokens than a second of decoding makes: still running when the timeout ends.
    max_tokens = MAX_MODEL_LEN - 16
    timeout = 1.0
    with serve(shutdown_timeout=timeout, log=tmp_path / "server.log") as (proc, url):
        stream, reader, sent = sigterm_mid_stream(proc, url, max_tokens)
        assert proc.wait(10) == 0, (tmp_path / "server.log").read_text()
        assert time.monotonic() - sent < timeout + 1, "exited past the timeout and a second"
        reader.join(15)
        assert not reader.is_alive() and stream.error is None, stream.error
        assert stream.events[-1] == "[DONE]" and "length" not in stream.finish_reasons()
        assert json.loads(stream.events[-2])["error"]["type"] == "server_shutdown"
