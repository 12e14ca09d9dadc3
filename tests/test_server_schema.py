"""Schemathesis over the live /openapi.json: no generated request, valid or not, gets a 5xx.

The server runs for real (uvicorn on a loopback port, the default model in float32, its engine in
its own process); schemathesis builds requests from the schema the server publishes, fuzzes each
operation (and covers its boundary values), and checks only that no response is a server error.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import schemathesis
import uvicorn
from schemathesis.checks import not_a_server_error

from treadle.engine.async_engine import AsyncEngine
from treadle.server.openai.app import build_app

pytestmark = pytest.mark.default_model

# A short context bounds what any case can cost: a larger max_tokens is a fast 400, and a
# request that fits generates at most what the prompt leaves. That matters: the coverage phase
# sends ~90 valid chat requests without max_tokens, which take the rest of the context (the
# model's default system prompt alone is ~30 tokens; at 256, the file ran for ~9 minutes).
MAX_MODEL_LEN = 40
CONFIG = schemathesis.Config.from_dict({
    "seed": 0,  # the same cases every run: a failure reproduces, the run time stays put
    "request-timeout": 30,  # a hung request fails its case instead of the whole session
    "generation": {"max-examples": 30, "database": "none"},
})


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    engine = AsyncEngine(dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20,
                         max_model_len=MAX_MODEL_LEN)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(build_app(engine), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    try:
        while not uv.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def api_schema(base_url: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json", config=CONFIG)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
def test_no_server_errors(case: schemathesis.Case, base_url: str) -> None:
    case.call_and_validate(base_url=base_url, checks=[not_a_server_error])
