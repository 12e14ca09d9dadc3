"""Schemathesis over the live /openapi.json: no generated request, valid or not, gets a 5xx.

The server runs for real (uvicorn on a loopback port, the default model in float32, its engine in
its own process); schemathesis builds requests from the schema the server publishes, fuzzes each
operation (and covers its boundary values), and checks only that no response is a server error.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from frontends import start_frontends, stop_frontends, wait_started
from schemathesis.checks import not_a_server_error

from treadle.config import AsyncEngineConfig, ServerConfig, build_config
from treadle.frontend.async_engine import AsyncEngine

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
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20,
        max_model_len=MAX_MODEL_LEN)))
    frontends, thread = start_frontends(engine, ServerConfig(port=0, grpc_port=None))
    try:
        wait_started(frontends, thread)
        yield f"http://127.0.0.1:{frontends.port}"
    finally:
        stop_frontends(frontends, thread)


@pytest.fixture(scope="module")
def api_schema(base_url: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json", config=CONFIG)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
def test_no_server_errors(case: schemathesis.Case, base_url: str) -> None:
    case.call_and_validate(base_url=base_url, checks=[not_a_server_error])
