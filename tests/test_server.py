"""The OpenAI-compatible REST server, started for real (uvicorn on a loopback port, the default
model in float32, its engine in its own process) and driven by the official `openai` client;
raw HTTP for what the client cannot send. Greedy and seeded outputs are checked against the
offline API, an independent path to the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import logging
import socket
import time
from typing import Any

import grpc
import openai
import pytest
from frontends import start_frontends, stop_frontends, wait_started
from prometheus_client.parser import text_string_to_metric_families

from treadle.config import AsyncEngineConfig, ServerConfig, build_config
from treadle.core.sampling_params import SamplingParams
from treadle.errors import InvalidField
from treadle.frontend.async_engine import AsyncEngine
from treadle.llm import LLM
from treadle.server.auth import parse_api_keys
from treadle.server.grpc import treadle_pb2 as pb
from treadle.server.grpc import treadle_pb2_grpc as pb_grpc
from treadle.server.openai.protocol import CompletionResponse
from treadle.server.openai.serving import sse

pytestmark = pytest.mark.default_model

MAX_MODEL_LEN = 1024
PROMPT = "The capital of France is"
QUESTION = "Write a haiku about the sea."
KEY = "sekrit"
ORIGIN = "http://allowed.example"
MAX_REQUEST_BYTES = 1 << 16
IDLE = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}


@pytest.fixture(scope="module")
def offline():
    """What the offline API produces for the requests below."""
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    prompt_ids = llm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    chat_ids = llm.chat_prompt(QUESTION)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    completion, chat, sampled = llm.generate([prompt_ids, chat_ids, prompt_ids],
                                             [greedy, greedy, seeded], use_tqdm=False)
    return {"prompt_ids": prompt_ids, "chat_ids": chat_ids, "completion": completion.outputs[0],
            "chat": chat.outputs[0], "seeded": sampled.outputs[0]}


@pytest.fixture(scope="module")
def server(request):
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20,
        max_model_len=MAX_MODEL_LEN)))
    keys = tuple(parse_api_keys(["other-key", KEY]))
    config = ServerConfig(port=0, grpc_port=0, api_keys=keys, allowed_origins=(ORIGIN,),
                          max_request_bytes=MAX_REQUEST_BYTES, enable_debug_endpoints=True)
    frontends, thread = start_frontends(engine, config)
    request.getfixturevalue("offline")  # while the engine process loads the model
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
def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def model(engine):
    return engine.model_name


def post(port: int, path: str, body: bytes | dict | list | str | None,
         headers: dict | None = None, method: str = "POST") -> tuple[int, Any, dict]:
    """Raw HTTP, with the API key unless `headers` say otherwise: status, JSON body, headers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
        **(headers or {})})
    response = conn.getresponse()
    data, headers = response.read(), {k.lower(): v for k, v in response.getheaders()}
    conn.close()
    payload = json.loads(data) if headers.get("content-type") == "application/json" else data
    return response.status, payload, headers


def get(port: int, path: str, headers: dict | None = None) -> tuple[int, Any, dict]:
    return post(port, path, None, headers, method="GET")


def test_models_health_and_openapi(client, port, model):
    assert get(port, "/health", {"Authorization": ""})[0] == 200  # no key needed
    assert [m.id for m in client.models.list().data] == [model]
    card = client.models.retrieve(model)
    assert card.id == model and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert get(port, "/health")[0] == 200
    status, body, _ = get(port, "/ready")
    assert status == 200 and body["ready"] is True
    status, schema, _ = get(port, "/openapi.json")
    assert status == 200
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
            "/detokenize", "/health"} <= set(schema["paths"])


def test_greedy_completion_matches_offline(client, model, offline):
    expected = offline["completion"]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    choice = out.choices[0]
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(offline["prompt_ids"])
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens

    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=24,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_greedy_chat_matches_offline(client, model, offline):
    expected = offline["chat"]
    messages = [{"role": "user", "content": QUESTION}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                         temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(offline["chat_ids"])  # the chat template applied

    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == expected.text
    assert chunks[-2].choices[0].finish_reason == expected.finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_n_and_batched_prompts(client, model, engine):
    prompts = ["Once upon a time", PROMPT]
    out = client.completions.create(model=model, prompt=prompts, max_tokens=6, n=2,
                                    temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]  # prompt index * n + sample
    by_index = {c.index: c.text for c in out.choices}
    assert by_index[0] != by_index[1] and by_index[2] != by_index[3]
    assert out.usage.completion_tokens == 4 * 6
    assert out.usage.prompt_tokens == sum(len(engine.tokenizer(p)["input_ids"]) for p in prompts)
    chat = client.chat.completions.create(model=model, max_tokens=8, n=2, temperature=1.0,
                                          seed=5, messages=[{"role": "user", "content": "Hi"}])
    assert [c.index for c in chat.choices] == [0, 1]
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=model, max_tokens=8, n=2, temperature=1.0,
                                                seed=5, stream=True,
                                                messages=[{"role": "user", "content": "Hi"}]):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {c.index: c.message.content for c in chat.choices}


def test_grpc_streams_what_rest_returns_for_a_seeded_request(client, model, offline, server):
    """One engine, two frontends: the same seeded request gives the same sample."""
    async def through_grpc() -> tuple[list[int], str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server[2]}") as channel:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=offline["prompt_ids"]),
                sampling=pb.SamplingParameters(temperature=1.0, seed=1234),
                stop=pb.StopCriteria(max_tokens=12))
            chunks = [r.chunk async for r in pb_grpc.GenerationStub(channel).Generate(
                request, metadata=(("authorization", f"Bearer {KEY}"),)) if r.HasField("chunk")]
        return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)

    rest = client.completions.create(model=model, prompt=offline["prompt_ids"], max_tokens=12,
                                     temperature=1.0, seed=1234)
    tokens, text = asyncio.run(through_grpc())
    assert text == rest.choices[0].text
    assert tokens == offline["seeded"].token_ids


def test_metrics_count_a_known_workload_exactly(client, model, port, engine):
    def scrape() -> dict[str, float]:
        status, body, headers = get(port, "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        values: dict[str, float] = {}  # summed over tenants
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                if "le" not in s.labels:
                    name = s.name + "".join(f"|{v}" for k, v in sorted(s.labels.items())
                                            if k not in ("model_name", "le", "tenant"))
                    values[name] = values.get(name, 0.0) + s.value
        return values

    assert wait_idle(engine) == IDLE
    before = scrape()
    prompt = "Name the planets of the solar system, in order:"
    outs = [client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True}) for n in (5, 9)]
    after = scrape()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("treadle:generation_tokens_total") == sum(o.usage.completion_tokens
                                                           for o in outs) == 14
    assert delta("treadle:prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert delta("treadle:prefix_cache_hits_total") == sum(
        o.usage.prompt_tokens_details.cached_tokens for o in outs)
    assert delta("treadle:request_success_total|length") == 2
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time",
                 "request_prefill_time", "request_decode_time"):
        assert delta(f"treadle:{name}_seconds_count") == 2
    assert delta("treadle:inter_token_latency_seconds_count") == 14 - 2


def test_request_timeline_and_log_line(client, model, port, caplog):
    caplog.set_level(logging.INFO, logger="treadle.frontend.observer")
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    status, timeline, _ = get(port, f"/debug/requests/{out.id}")
    assert status == 200
    assert (timeline["output_tokens"], timeline["finish_reason"]) == (7, "length")
    assert timeline["prompt_tokens"] == out.usage.prompt_tokens
    events = [e["event"] for e in timeline["events"]]
    assert events[:4] == ["arrival", "queued", "scheduled", "first_token"]
    assert events[-2:] == ["scheduled", "finished"]
    # One chunk of the prompt's uncached tokens, then one per decode step.
    scheduled = [e.get("tokens") for e in timeline["events"] if e["event"] == "scheduled"]
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert scheduled == [out.usage.prompt_tokens - cached] + [1] * 6
    times = [e["t_s"] for e in timeline["events"]]
    assert times == sorted(times) and timeline["e2e_s"] >= timeline["ttft_s"] > 0
    assert get(port, "/debug/requests/cmpl-nope")[0] == 404
    # The log line names the id the request is keyed by: the response's, less its prefix.
    lines = [r.getMessage() for r in caplog.records
             if f"request {out.id.removeprefix('cmpl-')} finished" in r.getMessage()]
    assert len(lines) == 1 and "length" in lines[0] and "output 7 tokens" in lines[0]
    assert "prompt=" not in lines[0]  # prompt text only with --log-prompts


def test_seed_repeats(client, model, offline):
    def sample(seed: int) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(1234) == sample(1234) == offline["seeded"].text
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_completion_logprobs_legacy_shape(client, model, offline):
    expected = offline["completion"]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text == expected.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for i, ref in enumerate(expected.logprobs):
        assert lp.token_logprobs[i] == pytest.approx(ref.logprob, abs=1e-4)
        top = lp.top_logprobs[i]
        assert 2 <= len(top) <= 3 and lp.tokens[i] in top  # the top 2 and the chosen token
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(ref.top_logprobs, abs=1e-4)

    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                       logprobs=1, echo=True).choices[0]
    num_prompt = len(offline["prompt_ids"])
    assert echoed.text == PROMPT + "".join(echoed.logprobs.tokens[num_prompt:])
    assert echoed.logprobs.token_logprobs[0] is None and echoed.logprobs.top_logprobs[0] is None
    assert all(x is not None for x in echoed.logprobs.token_logprobs[1:])
    assert len(echoed.logprobs.tokens) == num_prompt + 3

    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=24,
                                            temperature=0, logprobs=2, stream=True))
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs_shape(client, model, offline):
    expected = offline["chat"]
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=24,
        temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == len(expected.token_ids)
    assert bytes(b for entry in content for b in entry.bytes).decode() == expected.text
    for entry, ref in zip(content, expected.logprobs, strict=True):
        assert entry.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(ref.top_logprobs,
                                                                        abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely

    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=24,
        temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = [e.token for c in chunks if c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


def test_stop_string(client, model, offline):
    text = offline["completion"].text
    stop = " ".join(text.split()[2:4])
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                    stop=[stop]).choices[0]
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop" and out.model_extra["stop_reason"] == stop


def test_cached_prompt_tokens(client, model):
    messages = [{"role": "user", "content": "Tell me about the history of cached tokens " * 4}]
    usages = [client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                             temperature=0).usage for _ in range(2)]
    assert usages[1].prompt_tokens_details.cached_tokens > 0
    assert usages[1].prompt_tokens_details.cached_tokens < usages[1].prompt_tokens


def test_tokenize_detokenize_and_request_id(port, offline):
    status, body, headers = post(port, "/tokenize", {"prompt": PROMPT},
                                 headers={"X-Request-Id": "abc-123"})
    assert status == 200 and headers["x-request-id"] == "abc-123"
    assert body == {"count": len(offline["prompt_ids"]), "max_model_len": MAX_MODEL_LEN,
                    "tokens": offline["prompt_ids"]}
    status, body, _ = post(port, "/tokenize",
                           {"messages": [{"role": "user", "content": QUESTION}]})
    assert status == 200 and body["tokens"] == offline["chat_ids"]
    status, body, headers = post(port, "/detokenize", {"tokens": offline["prompt_ids"]})
    assert status == 200 and body == {"prompt": PROMPT}
    assert len(headers["x-request-id"]) == 32  # a fresh id when the client sent none


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"prompt": "hi",', None),  # invalid JSON
    ("/v1/completions", [1, 2], None),  # not an object
    ("/v1/chat/completions", "hello", None),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": [[1, 99999999]]}, "prompt"),  # refused by the engine
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/tokenize", {"prompt": "hi", "messages": []}, None),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_bad_requests_are_400_with_param(port, path, body, param):
    status, payload, _ = post(port, path, body)
    assert status == 400, payload
    error = payload["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_out_of_range_param_through_the_client(client, model):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=PROMPT, temperature=-1)
    assert err.value.param == "temperature" and "temperature" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                       n=2, temperature=0, stream=True)
    assert err.value.param == "n"


def test_context_length_exceeded(client, model):
    long_text = "word " * (MAX_MODEL_LEN + 10)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "user",
                                                               "content": long_text}])
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    assert str(MAX_MODEL_LEN) in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
    assert err.value.code == "context_length_exceeded"
    num_prompt = client.completions.create(model=model, prompt=PROMPT,
                                           max_tokens=1).usage.prompt_tokens
    assert f"{num_prompt + MAX_MODEL_LEN} tokens ({num_prompt} in the prompt, " \
           f"{MAX_MODEL_LEN} in the completion)" in err.value.message


def test_unknown_model_and_route(client, port):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-nope", prompt=PROMPT)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-nope")
    status, payload, _ = get(port, "/v1/nothing")
    assert status == 404 and payload["error"]["type"] == "invalid_request_error"


def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while engine.load() != IDLE and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.load()


def test_full_queue_is_429_with_retry_after(port, engine):
    config = engine.admission.config
    engine.admission.config = dataclasses.replace(config, max_queued_requests=0)
    try:
        status, payload, headers = post(port, "/v1/completions", {"prompt": PROMPT})
    finally:
        engine.admission.config = config
    assert status == 429 and int(headers["retry-after"]) >= 1
    assert payload["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/tokenize"])
@pytest.mark.parametrize("auth", ["", "Bearer nope", "Basic sekrit", f"Bearer {KEY}x"])
def test_api_key_is_required(port, path, auth):
    status, payload, headers = post(port, path, {"prompt": "hi"}, {"Authorization": auth},
                                    method="GET" if path == "/v1/models" else "POST")
    assert status == 401 and payload["error"]["code"] == "invalid_api_key"
    assert headers["www-authenticate"] == "Bearer"


def test_cors_allows_only_the_given_origins(port):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    status, _, headers = post(port, "/v1/completions", None, preflight, method="OPTIONS")
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, _, headers = post(port, "/v1/completions", None,
                              {**preflight, "Origin": "http://evil.example"}, method="OPTIONS")
    assert status == 400 and "access-control-allow-origin" not in headers
    _, _, headers = get(port, "/v1/models", {"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in headers


def test_body_over_the_limit_is_413(port):
    big = {"prompt": "x" * MAX_REQUEST_BYTES}
    status, payload, _ = post(port, "/v1/completions", big)
    assert status == 413 and payload["error"]["message"]
    # Without Content-Length (chunked), cut off once the bytes read pass the limit.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = json.dumps(big).encode()
    conn.request("POST", "/v1/completions", body=iter([data[:1000], data[1000:]]),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
                 encode_chunked=True)
    assert conn.getresponse().status == 413
    conn.close()


def test_disconnect_aborts_the_request(port, engine, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
    for stream in (True, False):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": stream}),
                     headers={"Authorization": f"Bearer {KEY}",
                              "Content-Type": "application/json"})
        if stream:
            response = conn.getresponse()
            assert response.status == 200 and response.readline().startswith(b"data: ")
        else:
            deadline = time.monotonic() + 10
            while engine.load()["running"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.load()["running"] == 1
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        started = time.monotonic()
        assert wait_idle(engine) == IDLE  # far before 500 tokens could have been generated
        assert time.monotonic() - started < 5


def test_an_error_after_the_stream_began_is_its_last_event_before_done():
    async def chunks():
        yield CompletionResponse(id="cmpl-1", model="m", choices=[])
        raise InvalidField("stop_token_ids", "stop_token_ids must be in [0, 10); got 12")

    async def events():
        return [e async for e in sse(chunks(), keepalive=15.0)]

    *first, last, done = asyncio.run(events())
    assert len(first) == 1 and json.loads(first[0].removeprefix("data: "))["id"] == "cmpl-1"
    assert done == "data: [DONE]\n\n"  # the stream's end, as a client reading to it expects
    error = json.loads(last.removeprefix("data: "))["error"]
    assert error["param"] == "stop_token_ids" and error["type"] == "invalid_request_error"
