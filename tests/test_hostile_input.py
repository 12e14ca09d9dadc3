"""Hostile but fair input against a real server (uvicorn and gRPC on loopback, the engine in its
own process) over a tiny random-weight model with the default model's tokenizer: a bad-input
table over both frontends that must get 4xx / INVALID_ARGUMENT in OpenAI's shape and leave the
server healthy and idle; bounded work for client-chosen sizes (the 1 MB stop string); surrogates;
auth on every route; and the gRPC edge cases REST already refused."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import http.client
import json
import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import openai
import pytest
import transformers
from frontends import start_frontends, stop_frontends, wait_started
from model_utils import TINY
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from treadle.cli import build_parser
from treadle.config import AsyncEngineConfig, ServerConfig, build_config
from treadle.core.sampling_params import (
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_N_STOP_CHARS,
    MAX_PROMPT_CHARS_PER_TOKEN,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from treadle.frontend.async_engine import AsyncEngine
from treadle.frontend.detokenizer import IncrementalDetokenizer
from treadle.model.source import resolve_model
from treadle.server.auth import bearer_token, parse_api_keys
from treadle.server.grpc import treadle_pb2 as pb
from treadle.server.grpc import treadle_pb2_grpc as pb_grpc
from treadle.server.openai.middleware import APIKeyMiddleware

KEY = "sekrit"
# Keys of two tenants and the admin (who sees every tenant's records), beside KEY (key-1).
TENANT_KEYS = {"alice": "alice-key", "bob": "bob-key", "admin": "admin-key"}
MAX_MODEL_LEN = TINY["max_position_embeddings"]
MAX_PROMPT_CHARS = MAX_MODEL_LEN * MAX_PROMPT_CHARS_PER_TOKEN
IDLE = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}
AUTH = (("authorization", f"Bearer {KEY}"),)


@pytest.fixture(scope="module")
def server(tiny_folder):
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        model=str(tiny_folder), dtype="float32", kv_cache_memory_bytes=16 << 20,
        max_model_len=MAX_MODEL_LEN)))
    keys = parse_api_keys([KEY], [f"{name}:{key}" for name, key in TENANT_KEYS.items()])
    config = ServerConfig(port=0, grpc_port=0, api_keys=tuple(keys), enable_debug_endpoints=True)
    frontends, thread = start_frontends(engine, config)
    wait_started(frontends, thread)
    yield frontends.port, engine, frontends.grpc_port
    stop_frontends(frontends, thread)


@pytest.fixture(scope="module")
def port(server):
    return server[0]


@pytest.fixture(scope="module")
def engine(server):
    return server[1]


@pytest.fixture(scope="module")
def grpc_port(server):
    return server[2]


def request(port: int, method: str, path: str, body: bytes | None = None,
            headers: dict | None = None, timeout: float = 30) -> tuple[int, Any]:
    """Raw HTTP with the key unless `headers` say otherwise: status and the parsed body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, body=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {})})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    is_json = response.getheader("content-type", "").startswith("application/json")
    return response.status, json.loads(data) if is_json else data


def post(port: int, path: str, body: Any, **kwargs) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(port, "POST", path, data, **kwargs)


def assert_openai_error(status: int, body: Any, expected: int = 400) -> dict:
    assert status == expected, (status, body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while engine.load() != IDLE and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.load()


def assert_healthy_and_idle(port: int, engine: AsyncEngine) -> None:
    assert request(port, "GET", "/health", headers={"Authorization": ""})[0] == 200
    status, body = request(port, "GET", "/ready", headers={"Authorization": ""})
    assert status == 200 and body["ready"] is True
    assert wait_idle(engine) == IDLE


# The bad-input table. Each case: (path, raw body or JSON value, what the error must mention).

COMPLETION = {"prompt": "Hi", "max_tokens": 1}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
NUMERIC_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "seed", "max_tokens", "min_tokens")
# JSON that Python's parser reads as floats no field accepts, ints past every range, wrong types.
BAD_NUMBERS = ("NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" + "0" * 400, "-1",
               '"1"', "true", "[]", "{}")


def raw_with(base: dict, field: str, literal: str) -> bytes:
    """`base` as JSON with `field` set to a raw JSON literal (NaN is no json.dumps output)."""
    return json.dumps({**base, field: "@@"}).replace('"@@"', literal).encode()


def cases() -> list[tuple[str, Any, str]]:
    table: list[tuple[str, Any, str]] = []
    for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        for field in NUMERIC_FIELDS:
            for literal in BAD_NUMBERS:
                if (literal == "-1" and field in ("top_k", "presence_penalty",
                                                  "frequency_penalty")
                        or field == "top_k" and literal.startswith("1")):
                    continue  # in range (top_k: -1 is off, a huge one keeps every token)
                table.append((path, raw_with(base, field, literal), ""))
        table += [
            (path, b"", ""), (path, b"null", ""), (path, b"[]", ""), (path, b"123", ""),
            (path, b'"a string"', ""), (path, b"{", "JSON"), (path, b"\xff\xfe{}", ""),
            (path, b'{"prompt": "\xed\xa0\x80"}', ""),  # a surrogate encoded as UTF-8 bytes
            (path, b"[" * 100_000 + b"]" * 100_000, ""),  # nesting deeper than any parser
            (path, b'{"a":' * 50_000 + b"1" + b"}" * 50_000, ""),
            (path, {**base, "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, str(MAX_STOP_STRINGS)),
            (path, {**base, "stop": "x" * (MAX_STOP_CHARS + 1)}, str(MAX_STOP_CHARS)),
            (path, {**base, "stop": ["x" * 100] * 41 + ["y" * 1]}, str(MAX_STOP_CHARS)),
            (path, {**base, "n": 9, "temperature": 1.0, "stop": "x" * MAX_STOP_CHARS},
             str(MAX_N_STOP_CHARS)),
            (path, {**base, "stop": [""]}, "stop"), (path, {**base, "stop": [1]}, "stop"),
            (path, {**base, "stop": "a\ud800"}, "surrogate"),
            (path, {**base, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}},
             str(MAX_LOGIT_BIAS_ENTRIES)),
            (path, {**base, "logit_bias": {"x": 1}}, "logit_bias"),
            (path, {**base, "logit_bias": {"1": 101}}, "logit_bias"),
            (path, {**base, "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
             str(MAX_STOP_TOKEN_IDS)),
            (path, {**base, "stop_token_ids": [-1]}, "stop_token_ids"),
            (path, {**base, "stop_token_ids": [10**30]}, "stop_token_ids"),
            (path, {**base, "model": "a\ud800"}, "surrogate"),
            (path, {**base, "model": "gpt-4"}, "gpt-4"),
            (path, {**base, "n": 2, "temperature": 0}, "n"),
            (path, {**base, "stream_options": {"include_usage": True}}, "stream"),
            (path, {**base, "priority": 1.5}, "priority"),
            (path, {**base, "stream": "yes"}, "stream"),
        ]
    p = "/v1/completions"
    table += [
        (p, {"max_tokens": 1}, "prompt"), (p, {**COMPLETION, "prompt": ""}, "prompt"),
        (p, {**COMPLETION, "prompt": []}, "prompt"), (p, {**COMPLETION, "prompt": [[]]}, "prompt"),
        (p, {**COMPLETION, "prompt": "a\ud800b"}, "surrogate"),
        (p, {**COMPLETION, "prompt": ["ok", "\udfff"]}, "surrogate"),
        (p, {**COMPLETION, "prompt": "x" * (MAX_PROMPT_CHARS + 1)}, str(MAX_PROMPT_CHARS)),
        (p, {**COMPLETION, "prompt": "ab " * (MAX_PROMPT_CHARS // 3)}, "context length"),
        (p, {**COMPLETION, "prompt": [-1]}, "prompt"), (p, {**COMPLETION, "prompt": [10**9]}, ""),
        (p, {**COMPLETION, "prompt": [10**30]}, ""), (p, {**COMPLETION, "prompt": [1.5]}, ""),
        (p, {**COMPLETION, "prompt": [1] * 200_000}, "context length"),
        (p, {**COMPLETION, "prompt": [[1], "a"]}, ""), (p, {**COMPLETION, "prompt": {"a": 1}}, ""),
        (p, {**COMPLETION, "max_tokens": MAX_MODEL_LEN}, "context length"),
        (p, {**COMPLETION, "prompt": ["a"] * (MAX_N + 1)}, str(MAX_N)),
        (p, {**COMPLETION, "prompt": ["a"] * 500_000}, str(MAX_N)),
        (p, {**COMPLETION, "prompt": [[1]] * 65, "n": 2, "temperature": 1.0}, str(MAX_N)),
        (p, {**COMPLETION, "prompt": ["a", "b"], "n": 8, "temperature": 1.0,
             "stop": "x" * MAX_STOP_CHARS}, str(MAX_N_STOP_CHARS)),
        (p, {**COMPLETION, "logprobs": 21}, "logprobs"), (p, {**COMPLETION, "echo": 1}, "echo"),
        (p, raw_with(COMPLETION, "prompt", '"\\ud800"'), "surrogate"),
        (p, raw_with(COMPLETION, "prompt", '"\\udc00\\ud800"'), "surrogate"),
    ]
    c = "/v1/chat/completions"
    message = CHAT["messages"][0]
    table += [
        (c, {"max_tokens": 1}, "messages"), (c, {**CHAT, "messages": []}, "messages"),
        (c, {**CHAT, "messages": {}}, "messages"), (c, {**CHAT, "messages": ["hi"]}, "messages"),
        (c, {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        (c, {**CHAT, "messages": [{"content": "hi"}]}, "role"),
        (c, {**CHAT, "messages": [{**message, "content": "a\ud800"}]}, "surrogate"),
        (c, {**CHAT, "messages": [{**message, "content": [{"type": "text", "text": "\ud800"}]}]},
         "messages"),
        (c, {**CHAT, "messages": [{**message, "content": [{"type": "image", "text": "x"}]}]},
         "messages"),
        (c, {**CHAT, "messages": [{**message, "content": 5}]}, "messages"),
        (c, {**CHAT, "messages": [{**message, "name": "\udfff"}]}, "surrogate"),
        (c, {**CHAT, "messages": [{**message, "content": "x" * (MAX_PROMPT_CHARS + 1)}]},
         str(MAX_PROMPT_CHARS)),
        (c, {**CHAT, "messages": [message] * (MAX_MODEL_LEN + 1)}, str(MAX_MODEL_LEN)),
        (c, {**CHAT, "messages": [message] * 100}, "context length"),
        (c, {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        (c, {**CHAT, "logprobs": True, "top_logprobs": 21}, "logprobs"),
        (c, {**CHAT, "max_completion_tokens": 0}, "max_tokens"),
    ]
    t = "/tokenize"
    table += [
        (t, {}, "prompt"), (t, {"prompt": "a", "messages": [message]}, "prompt"),
        (t, {"prompt": "a\ud800b"}, "surrogate"), (t, {"prompt": 5}, "prompt"),
        (t, {"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, str(MAX_PROMPT_CHARS)),
        (t, {"messages": []}, "messages"),
        (t, {"messages": [{"role": "wizard", "content": "a"}]}, "role"),
        (t, {"messages": [{**message, "content": "\ud800"}]}, "surrogate"),
        (t, b"\xc3\x28", ""), (t, b"[" * 100_000, ""),
        ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]
    return table


CASES = cases()


def test_the_table_is_big_enough():
    assert len(CASES) >= 100


def test_bad_input_table_is_4xx_in_openai_shape(port, engine):
    failures = []
    for i, (path, body, mention) in enumerate(CASES):
        status, reply = post(port, path, body)
        try:
            error = assert_openai_error(status, reply, 404 if mention == "gpt-4" else 400)
            assert mention.lower() in error["message"].lower(), error
        except AssertionError as e:
            failures.append(f"case {i} {path} {str(body)[:80]!r}: {e}"[:400])
    assert not failures, "\n".join(failures)
    assert_healthy_and_idle(port, engine)


def test_wrong_content_types_are_4xx(port, engine):
    body = json.dumps(COMPLETION).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                         "application/xml", ""):
        status, reply = request(port, "POST", "/v1/completions", body,
                                headers={"Content-Type": content_type})
        assert 400 <= status < 500, (content_type, status, reply)
        assert_openai_error(status, reply, status)
    status, reply = request(port, "GET", "/v1/completions")
    assert_openai_error(status, reply, 405)
    assert_healthy_and_idle(port, engine)


def test_sizes_at_each_limit_are_served(port, engine):
    """The limits are limits, not bugs: a request at each one runs."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0,
                           timeout=60)
    model = engine.model_name
    at_limits = [
        {"stop": ["s" * (MAX_STOP_CHARS // MAX_STOP_STRINGS)] * MAX_STOP_STRINGS},
        {"extra_body": {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))}},
        {"logit_bias": {str(i): 0.5 for i in range(MAX_LOGIT_BIAS_ENTRIES)}},
    ]
    for kwargs in at_limits:
        out = client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0,
                                        **kwargs)
        assert out.choices[0].finish_reason in ("stop", "length")
    # The chat endpoint and n x stop length at their limits too.
    n = MAX_N_STOP_CHARS // MAX_STOP_CHARS
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=2, n=n, temperature=1.0,
                                         stop=["z" * (MAX_STOP_CHARS - 1) + "q"])
    assert len(out.choices) == n
    # As many samples as a batch may have.
    out = client.completions.create(model=model, prompt=["a", "b"], n=MAX_N // 2, max_tokens=1,
                                    temperature=1.0)
    assert len(out.choices) == MAX_N
    # The longest prompt text allowed reaches the tokenizer (and then the context check).
    status, reply = post(port, "/tokenize", {"prompt": "x" * MAX_PROMPT_CHARS})
    assert status == 200 and reply["count"] > 0
    assert_healthy_and_idle(port, engine)


def test_a_megabyte_stop_string_is_refused_at_once(port, engine):
    """It used to run for minutes building every prefix of the stop string on the event loop,
    until the kernel killed the server for its memory."""
    for body in ({"prompt": "Hi", "max_tokens": 4, "stop": "x" * 1_000_000},
                 {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                  "stop": ["x" * 1_000_000]}):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        start = time.monotonic()
        status, reply = post(port, path, body, timeout=10)
        assert time.monotonic() - start < 5
        error = assert_openai_error(status, reply)
        assert error["param"] == "stop" and str(MAX_STOP_CHARS) in error["message"]
    assert_healthy_and_idle(port, engine)


def test_long_allowed_stop_strings_do_not_stall_health(port, engine):
    """n samples with the longest stop strings allowed, streaming: /health keeps answering
    at once (20,000 characters used to freeze it for 2 s)."""
    n = MAX_N_STOP_CHARS // MAX_STOP_CHARS
    body = {"prompt": "Hi", "max_tokens": 32, "n": n, "temperature": 1.0, "seed": 0,
            "ignore_eos": True, "stream": True,
            "stop": ["a" * (MAX_STOP_CHARS // 2 - 1) + "b", "ab" * (MAX_STOP_CHARS // 4)]}

    def health_latencies(stop: threading.Event) -> list[float]:
        latencies = []
        while not stop.is_set():
            start = time.monotonic()
            assert request(port, "GET", "/health", headers={"Authorization": ""})[0] == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.01)
        return latencies

    with ThreadPoolExecutor(4) as pool:
        stop = threading.Event()
        probe = pool.submit(health_latencies, stop)
        runs = [pool.submit(post, port, "/v1/completions", body) for _ in range(2)]
        statuses = [run.result()[0] for run in runs]
        stop.set()
        latencies = probe.result()
    assert statuses == [200, 200]
    assert latencies and max(latencies) < 1.0, max(latencies)
    assert_healthy_and_idle(port, engine)


def test_detokenizer_work_is_linear_in_the_stop_length(tiny_folder):
    """The matcher itself, past any limit: a 1 MB stop string is set up and searched in about
    the time it takes to read it (building its prefixes took minutes and 20 GB)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_folder))
    start = time.monotonic()
    detok = IncrementalDetokenizer(tok, [], stop=["x" * 1_000_000])
    ids = tok("x" * 3000 + " done")["input_ids"]
    for token in ids:
        detok.add_tokens([token])
    assert detok.output_text == "x" * 3000 + " done"
    assert time.monotonic() - start < 5


def test_surrogates_are_400_over_rest_and_invalid_argument_over_grpc(port, grpc_port):
    for path, body in (("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [
                           {"role": "user", "content": "a\ud800b"}], "max_tokens": 1}),
                       ("/tokenize", {"prompt": "a\ud800b"}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "a\ud800b"}]})):
        error = assert_openai_error(*post(port, path, body))
        assert "surrogate" in error["message"]

    async def grpc_cases():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            # The UTF-8-style encoding of U+D800: no valid protobuf string holds it.
            for method in ("Generate", "Tokenize"):
                codes = []
                for raw in (b"\x1a\x05a\xed\xa0\x80b", b"\x2a\x07\x0a\x05\x12\x03\xed\xa0\x80"):
                    call = (channel.unary_stream if method == "Generate"
                            else channel.unary_unary)(f"/treadle.v1.Generation/{method}")
                    try:
                        reply = call(raw, metadata=AUTH, timeout=10)
                        if method == "Generate":
                            async for _ in reply:
                                pass
                        else:
                            await reply
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
                assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 2, (method, codes)

    asyncio.run(grpc_cases())


async def grpc_code(call) -> grpc.StatusCode:
    """The status a call ends with (OK if it ends well)."""
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def grpc_bad_requests() -> list[tuple[str, Any]]:
    """(method, request or raw bytes) that must end INVALID_ARGUMENT."""
    chat = pb.ChatMessages
    message = pb.ChatMessage
    text = "Hi"
    bad_sampling = [pb.SamplingParameters(temperature=float("nan")),
                    pb.SamplingParameters(temperature=float("inf")),
                    pb.SamplingParameters(top_p=0), pb.SamplingParameters(top_p=float("nan")),
                    pb.SamplingParameters(min_p=2), pb.SamplingParameters(top_k=0),
                    pb.SamplingParameters(repetition_penalty=0),
                    pb.SamplingParameters(presence_penalty=float("-inf")),
                    pb.SamplingParameters(logit_bias={1: float("nan")}),
                    pb.SamplingParameters(logit_bias={i: 1 for i in
                                                      range(MAX_LOGIT_BIAS_ENTRIES + 1)})]
    bad_stop = [pb.StopCriteria(max_tokens=0), pb.StopCriteria(max_tokens=10**6),
                pb.StopCriteria(stop=["x"] * (MAX_STOP_STRINGS + 1)),
                pb.StopCriteria(stop=["x" * (MAX_STOP_CHARS + 1)]),
                pb.StopCriteria(stop=["x" * 1_000_000]), pb.StopCriteria(stop=[""]),
                pb.StopCriteria(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))),
                pb.StopCriteria(max_tokens=4, min_tokens=5)]
    table: list[tuple[str, Any]] = [("Generate", pb.GenerateRequest(text=text, sampling=s))
                                    for s in bad_sampling]
    table += [("Generate", pb.GenerateRequest(text=text, stop=s)) for s in bad_stop]
    table += [
        ("Generate", pb.GenerateRequest()),
        ("Generate", pb.GenerateRequest(text=text, n=0)),
        ("Generate", pb.GenerateRequest(text=text, n=2, sampling=pb.SamplingParameters(
            temperature=0))),
        ("Generate", pb.GenerateRequest(text=text, n=9, stop=pb.StopCriteria(
            stop=["x" * MAX_STOP_CHARS]))),
        ("Generate", pb.GenerateRequest(text=text, logprobs=21)),
        ("Generate", pb.GenerateRequest(text="")),
        ("Generate", pb.GenerateRequest(text="x" * (MAX_PROMPT_CHARS + 1))),
        ("Generate", pb.GenerateRequest(text="ab " * (MAX_PROMPT_CHARS // 3))),
        ("Generate", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**9]))),
        ("Generate", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]))),
        ("Generate", pb.GenerateRequest(chat=chat(messages=[]))),
        ("Generate", pb.GenerateRequest(chat=chat(messages=[message(role="wizard",
                                                                    content="hi")]))),
        ("Generate", pb.GenerateRequest(chat=chat(messages=[message(role="", content="hi")]))),
        ("Generate", pb.GenerateRequest(chat=chat(
            messages=[message(role="user", content="x" * (MAX_PROMPT_CHARS + 1))]))),
        ("Generate", pb.GenerateRequest(chat=chat(
            messages=[message(role="user", content="")] * (MAX_MODEL_LEN + 1)))),
        ("Tokenize", pb.TokenizeRequest()),
        ("Tokenize", pb.TokenizeRequest(chat=chat(messages=[]))),
        ("Tokenize", pb.TokenizeRequest(chat=chat(messages=[message(role="wizard")]))),
        ("Tokenize", pb.TokenizeRequest(text="x" * (MAX_PROMPT_CHARS + 1))),
        ("Detokenize", pb.DetokenizeRequest(token_ids=[10**9])),
    ]
    for method in ("Generate", "Tokenize", "Detokenize", "GetModelInfo", "GetLoad", "Abort"):
        table += [(method, b"\xff\xff\xff"), (method, b"\x0a"), (method, b"\x0a\x05ab")]
    return table


def test_grpc_bad_requests_are_invalid_argument(port, engine, grpc_port):
    async def scenario() -> list[str]:
        failures = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            for i, (method, body) in enumerate(grpc_bad_requests()):
                if isinstance(body, bytes):
                    kind = channel.unary_stream if method == "Generate" else channel.unary_unary
                    call = kind(f"/treadle.v1.Generation/{method}")(body, metadata=AUTH,
                                                                    timeout=30)
                else:
                    call = getattr(stub, method)(body, metadata=AUTH, timeout=30)
                code = await grpc_code(call)
                if code != grpc.StatusCode.INVALID_ARGUMENT:
                    failures.append(f"case {i} {method} {str(body)[:80]!r}: {code}")
        return failures

    failures = asyncio.run(scenario())
    assert not failures, "\n".join(failures)
    assert_healthy_and_idle(port, engine)


def test_grpc_chat_checks_are_the_rest_ones(port, grpc_port):
    """Empty chats and unknown roles: refused alike, with the same message."""
    async def grpc_details(messages) -> str:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=[
                    pb.ChatMessage(**m) for m in messages])), metadata=AUTH)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            return err.value.details()

    for messages in ([], [{"role": "wizard", "content": "hi"}]):
        error = assert_openai_error(*post(port, "/tokenize", {"messages": messages}))
        if messages:  # REST's schema names the roles before the shared check can
            assert "wizard" in asyncio.run(grpc_details(messages))
        else:
            assert error["message"] == asyncio.run(grpc_details(messages))
    # A role REST accepts, gRPC accepts.
    async def developer_ok() -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            reply = await stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=[
                pb.ChatMessage(role="developer", content="be brief"),
                pb.ChatMessage(role="user", content="hi")])), metadata=AUTH)
            return reply.count

    status, reply = post(port, "/tokenize", {"messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    assert status == 200 and reply["count"] == asyncio.run(developer_ok())


# Auth.

PROTECTED_ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"),
                    ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                    ("POST", "/detokenize"), ("GET", "/debug/requests/anything"),
                    ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/redoc"),
                    ("GET", "/openapi.json"), ("GET", "/no-such-route")]


@pytest.mark.parametrize("method,path", PROTECTED_ROUTES)
@pytest.mark.parametrize("authorization", ["", KEY, f"Basic {KEY}", "Bearer wrong",
                                           f"Bearer{KEY}", "Bearer "])
def test_every_route_but_the_probes_needs_a_key(port, method, path, authorization):
    status, reply = request(port, method, path, b"{}" if method == "POST" else None,
                            headers={"Authorization": authorization})
    assert_openai_error(status, reply, 401)


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_scheme_is_case_insensitive_on_both_frontends(port, grpc_port, scheme):
    assert request(port, "GET", "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})[0] \
        == 200
    assert request(port, "GET", "/openapi.json",
                   headers={"Authorization": f"{scheme} {KEY}"})[0] == 200
    for path in ("/health", "/ready"):
        assert request(port, "GET", path, headers={"Authorization": ""})[0] == 200

    async def grpc_codes() -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            codes = []
            for header in (f"{scheme} {KEY}", KEY, f"Basic {KEY}", f"{scheme} wrong"):
                codes.append(await grpc_code(stub.GetLoad(
                    pb.GetLoadRequest(), metadata=(("authorization", header),))))
            return codes

    assert asyncio.run(grpc_codes()) == [grpc.StatusCode.OK] + [
        grpc.StatusCode.UNAUTHENTICATED] * 3


def test_bearer_token_parsing():
    assert bearer_token(f"Bearer {KEY}") == KEY and bearer_token(f"bearer  {KEY} ") == KEY
    for header in (None, "", KEY, f"Basic {KEY}", "Bearer", "Bearer ", f"Bearer{KEY}"):
        assert bearer_token(header) is None


def test_metrics_without_auth_opens_metrics_only():
    async def ok(_):
        return PlainTextResponse("ok")

    inner = Starlette(routes=[Route(path, ok) for path in ("/metrics", "/v1/models", "/health")])

    async def statuses(metrics_without_auth: bool) -> list[int]:
        app = APIKeyMiddleware(inner, [KEY], metrics_without_auth=metrics_without_auth)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            return [(await client.get(path)).status_code
                    for path in ("/metrics", "/v1/models", "/health")]

    assert asyncio.run(statuses(False)) == [401, 401, 200]
    assert asyncio.run(statuses(True)) == [200, 401, 200]
    assert build_parser().parse_args(["serve", "--metrics-without-auth"]).metrics_without_auth


# Round three (issue 33).

def as_tenant(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANT_KEYS[name]}"}


def prefill_tokens_since(engine: AsyncEngine, cursor: int) -> int:
    """Prompt tokens the engine computed in the steps after `cursor` (LiveFeed's step count)."""
    with engine.live.lock:
        return sum(step.num_prefill_tokens for seq, step in engine.live.steps if seq > cursor)


def test_prompt_logprobs_prefill_the_prompt_once_for_all_samples(port, engine):
    """Only one sample computes the prompt's logprobs (a request asking for them gets no prefix
    hit); the others share its KV through the prefix cache, and every choice carries them."""
    prompt = list(range(1000, 1200))
    cursor = engine.live.num_steps
    status, reply = post(port, "/v1/completions", {
        "prompt": prompt, "n": 8, "temperature": 1.0, "max_tokens": 1, "prompt_logprobs": 2})
    assert status == 200, reply
    assert prefill_tokens_since(engine, cursor) < 2 * len(prompt)
    first = reply["choices"][0]["prompt_logprobs"]
    assert len(first) == len(prompt) and first[0] is None and len(first[1]) >= 2
    assert all(choice["prompt_logprobs"] == first for choice in reply["choices"])
    # Streamed with echo, each sample's first chunk carries the prompt's logprobs.
    status, events = post(port, "/v1/completions", {
        "prompt": prompt, "n": 8, "temperature": 1.0, "max_tokens": 2, "echo": True,
        "logprobs": 1, "stream": True})
    assert status == 200
    chunks = [json.loads(line[6:]) for line in events.decode().splitlines()
              if line.startswith("data: {")]
    firsts = {}
    for chunk in chunks:
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            firsts.setdefault(choice["index"], choice)
    assert sorted(firsts) == list(range(8))
    assert all(len(c["logprobs"]["tokens"]) >= len(prompt) for c in firsts.values())
    assert_healthy_and_idle(port, engine)


@pytest.mark.parametrize("prompt_logprobs", [2, None])
def test_n_samples_prefill_a_long_prompt_once(tmp_path, prompt_logprobs):
    """n=8 on a 1,000-token prompt, prefilled in chunks, with and without prompt_logprobs: the
    step trace's prefill tokens are the prompt once, plus each later sample's last partial
    block (each sample computed it whole before; then, beside sample 0, sample 1 its own
    chunks; without prompt logprobs, each sample past the blocks of sample 0's first chunk)."""
    folder = tmp_path / "tiny-2k"
    source = resolve_model(None).folder
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        **TINY, "vocab_size": vocab, "tie_word_embeddings": True,
        "max_position_embeddings": 2048})).save_pretrained(folder)
    shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")
    shutil.copy(source / "tokenizer_config.json", folder / "tokenizer_config.json")
    trace = tmp_path / "trace.json"
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        model=str(folder), dtype="float32", kv_cache_memory_bytes=32 << 20, trace_file=str(trace))))
    frontends, thread = start_frontends(engine, ServerConfig(port=0))
    try:
        wait_started(frontends, thread)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{frontends.port}/v1", api_key="x",
                               max_retries=0, timeout=120)
        prompt, n = [1000 + i % 3000 for i in range(1000)], 8
        out = client.completions.create(model=engine.model_name, prompt=prompt, n=n,
                                        max_tokens=1, temperature=1.0,
                                        extra_body={"prompt_logprobs": prompt_logprobs})
    finally:
        stop_frontends(frontends, thread)
    assert sorted(c.index for c in out.choices) == list(range(n))
    assert out.usage.completion_tokens == n
    if prompt_logprobs:
        first = out.choices[0].prompt_logprobs
        assert len(first) == len(prompt) and first[0] is None and len(first[1]) >= 2
        assert all(c.prompt_logprobs == first for c in out.choices)
    block_size = engine.config.engine.cache.block_size
    prefill = sum(e["args"]["prefill_tokens"] for e in json.loads(trace.read_text()))
    assert len(prompt) <= prefill <= len(prompt) + (n - 1) * block_size


def test_a_prompt_logprobs_request_left_early_leaves_nothing_behind(port, engine):
    """Its later samples, sent once sample 0 has prefilled, are aborted with it."""
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={
            "prompt": [7] * 100, "n": 4, "max_tokens": 100, "ignore_eos": True,
            "prompt_logprobs": 1, "stream": True},
            headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: {"))
    assert_healthy_and_idle(port, engine)
    assert not engine.after_prefill and not engine.processor.requests


def test_prompt_logprobs_past_the_response_limit_are_refused(port, engine):
    """128 samples x 250 prompt tokens x 21 entries: a response of hundreds of megabytes."""
    error = assert_openai_error(*post(port, "/v1/completions", {
        "prompt": [7] * 250, "n": MAX_N, "temperature": 1.0, "max_tokens": 1,
        "prompt_logprobs": 20}))
    assert error["param"] == "prompt_logprobs" and "limit" in error["message"]
    error = assert_openai_error(*post(port, "/v1/completions", {
        "prompt": [7] * 250, "n": MAX_N, "temperature": 1.0, "max_tokens": 1, "echo": True,
        "logprobs": 20}))
    assert error["param"] == "logprobs" and "limit" in error["message"]
    assert_healthy_and_idle(port, engine)


def test_a_required_tool_choice_whose_constraint_is_too_large_is_400(port, engine):
    """The tools pass their own limit; the constraint built from them would not."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "description": "x" * (MAX_GRAMMAR_CHARS - 150)}}}]
    assert len(json.dumps(tools)) <= MAX_GRAMMAR_CHARS
    error = assert_openai_error(*post(port, "/v1/chat/completions", {
        **CHAT, "tools": tools, "tool_choice": "required"}))
    assert error["param"] == "tools" and str(MAX_GRAMMAR_CHARS) in error["message"]
    assert_healthy_and_idle(port, engine)


# Constraints llguidance compiles but cannot follow: its lexer gives up on the first token.
UNFOLLOWABLE = [("guided_regex", "(x{1000}){1000}"), ("guided_regex", "a{1000000}"),
                ("guided_json", {"$ref": "#"}),
                ("guided_json", {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})]


@pytest.mark.parametrize(("field", "value"), UNFOLLOWABLE)
def test_a_constraint_that_cannot_be_followed_is_refused_up_front(port, engine, field, value):
    error = assert_openai_error(*post(port, "/v1/completions", {
        **COMPLETION, "max_tokens": 8, field: value}))
    assert error["param"] == field, error
    assert_healthy_and_idle(port, engine)


def test_a_constraint_that_fails_midway_ends_with_an_error(port, engine):
    """The model's first choice hides the failure from any check before generation: the
    request ends with an error, never as a normal stop with output that breaks it."""
    body = {**COMPLETION, "max_tokens": 8, "guided_regex": "(a|b)(x{1000}){1000}"}
    status, reply = post(port, "/v1/completions", body)
    assert status != 200, reply
    assert_openai_error(status, reply, status)
    status, events = post(port, "/v1/completions", {**body, "stream": True})
    assert status == 200 and events.decode().rstrip().endswith("data: [DONE]")
    assert '"error"' in events.decode() and '"finish_reason":"stop"' not in events.decode()
    assert_healthy_and_idle(port, engine)


def test_many_embedding_inputs_are_one_request_in_the_queue(port, engine):
    """300 inputs (OpenAI allows 2,048) on an idle server with the default queue of 256."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0,
                           timeout=120)
    out = client.embeddings.create(model=engine.model_name, input=["a b"] * 300)
    assert len(out.data) == 300
    assert_healthy_and_idle(port, engine)


def test_a_batch_larger_than_a_tenant_may_have_in_flight_is_400(port, engine):
    config = engine.admission.config
    engine.admission.config = dataclasses.replace(config, max_requests_per_tenant=4)
    try:
        for path, body, field in (("/v1/completions", {**COMPLETION, "prompt": ["a"] * 8},
                                   "prompt"),
                                  ("/v1/embeddings", {"input": ["a"] * 8}, "input")):
            error = assert_openai_error(*post(port, path, body))
            assert error["param"] == field and "max_requests_per_tenant" in error["message"]
        status, _ = post(port, "/v1/completions", {**COMPLETION, "prompt": ["a"] * 4})
        assert status == 200  # at the limit
    finally:
        engine.admission.config = config
    assert_healthy_and_idle(port, engine)


def test_request_records_are_scoped_to_the_tenant(port, engine):
    """explain, debug and the dashboard's request panel: a key sees its tenant's requests, the
    admin key every tenant's; a finished request's id reused by another tenant stays its own."""
    headers = {**as_tenant("alice"), "X-Request-Id": "alice-1"}
    assert post(port, "/v1/completions", COMPLETION, headers=headers)[0] == 200
    paths = ("/v1/requests/alice-1/explain", "/debug/requests/alice-1",
             "/dashboard/requests/alice-1")
    for path in paths:
        assert request(port, "GET", path, headers=as_tenant("alice"))[0] == 200, path
        assert request(port, "GET", path, headers=as_tenant("admin"))[0] == 200, path
        error = assert_openai_error(*request(port, "GET", path, headers=as_tenant("bob")), 404)
        assert error["code"] == "request_not_found"
    status, _ = post(port, "/v1/completions", {**COMPLETION, "max_tokens": 2},
                     headers={**as_tenant("bob"), "X-Request-Id": "alice-1"})
    assert status == 200
    status, timeline = request(port, "GET", "/debug/requests/alice-1", headers=as_tenant("alice"))
    assert status == 200 and timeline["tenant"] == "alice" and timeline["output_tokens"] == 1


def test_the_dashboard_feed_shows_a_tenant_only_its_own_requests(port, engine):
    for tenant in ("alice", "bob"):
        assert post(port, "/v1/completions", COMPLETION, headers=as_tenant(tenant))[0] == 200

    def tenants_in_feed(tenant: str) -> set[str]:
        with httpx.stream("GET", f"http://127.0.0.1:{port}/dashboard/feed",
                          headers=as_tenant(tenant), timeout=10) as response:
            assert response.status_code == 200
            line = next(line for line in response.iter_lines() if line.startswith("data: "))
        snapshot = json.loads(line[6:])
        now = snapshot["now"]
        census = now["waiting_by"] + now["running_by"] + now["tenants"]
        return {row["tenant"] for row in snapshot["requests"] + census}

    assert tenants_in_feed("bob") == {"bob"}
    assert {"alice", "bob"} <= tenants_in_feed("admin")


def test_a_closed_dashboard_feed_frees_its_slot_at_once(port, engine):
    """Each feed is one of at most 16; a closed one's slot is free again without waiting for
    the garbage collector (off here, as between its passes)."""
    gc.disable()
    try:
        for _ in range(17):
            deadline = time.monotonic() + 10
            while True:
                with httpx.stream("GET", f"http://127.0.0.1:{port}/dashboard/feed",
                                  headers={"Authorization": f"Bearer {KEY}"},
                                  timeout=10) as response:
                    if response.status_code == 200:
                        next(line for line in response.iter_lines() if line.startswith("data: "))
                        break
                    response.read()
                assert response.status_code == 429 and time.monotonic() < deadline, \
                    "a closed feed still holds its slot"
                time.sleep(0.05)
    finally:
        gc.enable()


def test_a_key_in_the_query_string_is_not_logged(port):
    """The dashboard's page link carries the key (?key=); the access log does not."""
    lines: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    access = logging.getLogger("uvicorn.access")
    handler = Capture()
    access.addHandler(handler)
    try:
        request(port, "GET", f"/dashboard?key={KEY}&x=1", headers={"Authorization": ""})
        request(port, "GET", f"/v1/models?api_key={KEY}")
    finally:
        access.removeHandler(handler)
    assert len(lines) == 2 and all(KEY not in line for line in lines), lines
    assert "/dashboard?key=" in lines[0]


def test_tool_results_must_answer_an_earlier_call(port, engine):
    """As OpenAI: a tool message needs a tool_call_id naming a call of an earlier assistant
    message."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": None, "tool_calls": [call]}]
    for result, param in (({"role": "tool", "content": "42"}, "messages[2].tool_call_id"),
                          ({"role": "tool", "content": "42", "tool_call_id": "call_9"},
                           "messages[2].tool_call_id")):
        error = assert_openai_error(*post(port, "/v1/chat/completions", {
            **CHAT, "messages": [*turns, result]}))
        assert error["param"] == param, error
    status, _ = post(port, "/v1/chat/completions", {
        **CHAT, "messages": [*turns, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]})
    assert status == 200
    assert_healthy_and_idle(port, engine)
