"""Nothing silently ignored: every request field of /v1/completions and /v1/chat/completions is
honoured or refused with a 400 naming it.

The fields come from OpenAI's own request schemas in the installed `openai` package and from our
pydantic models; the tables below say how each is treated, so a field the client gains (or one
we add) fails the walk until it is given a row. Each row's cases run against a real server over a
tiny random-weight model: a 200 whose body shows the field's effect where that is easy to see,
else a 200, or a 400 in OpenAI's shape whose `param` names the field.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from frontends import start_frontends, stop_frontends, wait_started
from model_utils import TINY
from openai.types import completion_create_params as openai_completion
from openai.types.chat import completion_create_params as openai_chat

from treadle.config import AsyncEngineConfig, ServerConfig, build_config
from treadle.frontend.async_engine import AsyncEngine
from treadle.server.openai.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "<served model>"  # a case value replaced by the served model's name
Check = Callable[[dict, dict], None]  # (response body, request body)


@dataclass(frozen=True)
class Case:
    value: Any
    check: Check | None = None  # a 200 whose body shows the effect; None: any 200
    refused: bool = False  # a 400 naming the field
    also: dict = field(default_factory=dict)  # other fields the case needs


def refused(value: Any, **also: Any) -> Case:
    return Case(value, refused=True, also=also)


def tokens(n: int) -> Check:
    def check(body: dict, _: dict) -> None:
        assert body["usage"]["completion_tokens"] == n
    return check


def choices(n: int) -> Check:
    def check(body: dict, _: dict) -> None:
        assert len(body["choices"]) == n
    return check


def event_stream(body: dict, _: dict) -> None:
    assert body["stream"][-1] == "[DONE]"


def last_chunk_usage(body: dict, _: dict) -> None:
    assert body["stream"][-2]["usage"]["completion_tokens"] == 4


def breakdown(body: dict, _: dict) -> None:
    assert body["timings"]["e2e_ms"] > 0


def served_model(body: dict, sent: dict) -> None:
    assert body["model"] == sent["model"]


def completion_top_logprobs(body: dict, _: dict) -> None:
    top = body["choices"][0]["logprobs"]["top_logprobs"]
    assert len(top) == 4 and all(len(entry) == 2 for entry in top)


def one_token_repeated(body: dict, _: dict) -> None:
    logprobs = body["choices"][0]["logprobs"]
    chosen = logprobs["tokens"] if "tokens" in logprobs else [e["token"] for e in
                                                               logprobs["content"]]
    assert len(chosen) == 4 and len(set(chosen)) == 1


def echoed(body: dict, sent: dict) -> None:
    assert body["choices"][0]["text"].startswith(sent["prompt"])


def prompt_logprobs(body: dict, _: dict) -> None:
    assert body["choices"][0]["prompt_logprobs"]


def chat_logprobs(body: dict, _: dict) -> None:
    assert len(body["choices"][0]["logprobs"]["content"]) == 4


def chat_top_logprobs(body: dict, _: dict) -> None:
    assert all(len(e["top_logprobs"]) == 3 for e in body["choices"][0]["logprobs"]["content"])


def text_of(body: dict) -> str:
    message = body["choices"][0].get("message")
    return message["content"] if message else body["choices"][0]["text"]


def json_start(body: dict, _: dict) -> None:
    assert text_of(body).startswith("{")


def text_is(expected: str) -> Check:
    def check(body: dict, _: dict) -> None:
        assert text_of(body) == expected
    return check


def prompt_of_ids(body: dict, sent: dict) -> None:
    assert body["usage"]["prompt_tokens"] == len(sent["prompt"])


# ignore_eos: a random model may end early; every case's length is then its max_tokens.
COMPLETION = {"prompt": "The sea is", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0.0,
        "ignore_eos": True}
BIAS = {"logit_bias": {"1000": 100.0}}  # a greedy request of that token only

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"],
    "additionalProperties": False}}}]


def tool_called(body: dict, _: dict) -> None:
    assert body["choices"][0]["message"]["tool_calls"][0]["function"] == {
        "name": "f", "arguments": '{"a": 1}'}


# How both endpoints treat the fields they share (OpenAI's and vLLM's sampling extras).
SHARED = {
    "model": [Case(MODEL, served_model)],
    "n": [Case(2, choices(2), also={"temperature": 1.0})],
    "temperature": [Case(1.0)],
    "top_p": [Case(0.5)],
    "top_k": [Case(1)],
    "min_p": [Case(0.1)],
    "presence_penalty": [Case(1.0)],
    "frequency_penalty": [Case(1.0)],
    "repetition_penalty": [Case(1.2)],
    "seed": [Case(7, also={"temperature": 1.0})],
    "min_tokens": [Case(2)],
    "stop": [Case(["\n"])],
    "stop_token_ids": [Case([0])],
    "include_stop_str_in_output": [Case(True)],
    "ignore_eos": [Case(False)],
    "skip_special_tokens": [Case(False)],
    "speculate": [Case(False), refused("no")],
    "prompt_logprobs": [Case(1, prompt_logprobs)],
    "stream": [Case(True, event_stream)],
    "stream_options": [Case({"include_usage": True}, last_chunk_usage, also={"stream": True}),
                       refused({"include_usage": True}),  # without stream, as OpenAI
                       refused({"include_obfuscation": True}, stream=True)],
    "user": [Case("alice")],
    "safety_identifier": [Case("bob"), refused(" padded ")],
    "response_format": [Case({"type": "text"}), Case({"type": "json_object"}, json_start),
                        Case({"type": "json_schema", "json_schema": {"name": "x"}}, json_start),
                        refused({"type": "json_schema", "json_schema": {
                            "name": "x", "schema": {"type": "nonsense"}}}),
                        refused({"type": "xml"})],
    "structured_outputs": [Case({"choice": ["a b c d"]}, text_is("a b c d")),
                           refused({"regex": "[a-"})],
    "guided_json": [Case({"type": "object"}, json_start), refused({"type": "nonsense"})],
    "guided_regex": [Case("abc", text_is("abc")), refused("(")],
    "guided_choice": [Case(["x y z w"], text_is("x y z w")), refused([])],
    "guided_grammar": [Case('start: "hello"', text_is("hello")), refused("start: nowhere")],
    "priority": [Case(1)],
    "cache_salt": [Case("salt")],
    "ttft_ms": [Case(60_000.0)],
    "tpot_ms": [Case(60_000.0)],
    "return_timings": [Case(True, breakdown)],
}

COMPLETION_FIELDS = {
    **SHARED,
    "logit_bias": [Case(BIAS["logit_bias"], one_token_repeated, also={"logprobs": 0})],
    "prompt": [Case([1, 2, 3], prompt_of_ids)],
    "max_tokens": [Case(2, tokens(2))],
    "echo": [Case(True, echoed)],
    "logprobs": [Case(2, completion_top_logprobs)],
    "add_special_tokens": [Case(False)],
    "best_of": [Case(1), Case(2, choices(2), also={"n": 2, "temperature": 1.0}), refused(2)],
    "suffix": [Case(""), refused(" and the end.")],
}

CHAT_FIELDS = {
    **SHARED,
    "logit_bias": [Case(BIAS["logit_bias"], one_token_repeated, also={"logprobs": True})],
    "messages": [Case([{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Hi"}])],
    "max_tokens": [Case(2, tokens(2))],
    "max_completion_tokens": [Case(3, tokens(3))],
    "logprobs": [Case(True, chat_logprobs)],
    "top_logprobs": [Case(3, chat_top_logprobs, also={"logprobs": True}), refused(3)],
    "metadata": [Case({"k": "v"})],
    "prompt_cache_key": [Case("key")],
    "parallel_tool_calls": [Case(False)],
    "tools": [Case([]), Case(TOOLS), refused([{"type": "function", "function": {"name": "a b"}}])],
    "tool_choice": [Case("none"), Case("auto"), refused("required"),
                    Case("required", tool_called, also={
                        "tools": TOOLS, "parallel_tool_calls": False, "max_tokens": 32}),
                    refused({"type": "function", "function": {"name": "f"}})],
    "functions": [Case([]), refused([{"name": "f", "parameters": {}}])],
    "function_call": [Case("none"), refused({"name": "f"})],
    "audio": [refused({"voice": "alloy", "format": "wav"})],
    "modalities": [Case(["text"]), refused(["text", "audio"])],
    "moderation": [refused({"model": "omni-moderation-latest"})],
    "prediction": [refused({"type": "content", "content": "Hello"})],
    "prompt_cache_options": [Case({"mode": "implicit"}), refused({"mode": "explicit"}),
                             refused({"ttl": "30m"})],
    "prompt_cache_retention": [Case("in_memory"), refused("24h")],
    "reasoning_effort": [refused("low")],
    "service_tier": [Case("auto"), Case("default"), refused("flex")],
    "store": [Case(False), refused(True)],
    "verbosity": [refused("low")],
    "web_search_options": [refused({})],
}


def openai_fields(module: Any) -> set[str]:
    """Every field of an endpoint's request in the installed client, streamed or not."""
    return {name for params in (module.CompletionCreateParamsStreaming,
                                module.CompletionCreateParamsNonStreaming)
            for name in params.__required_keys__ | params.__optional_keys__}


ENDPOINTS = {
    "/v1/completions": (COMPLETION, COMPLETION_FIELDS, CompletionRequest, openai_completion),
    "/v1/chat/completions": (CHAT, CHAT_FIELDS, ChatCompletionRequest, openai_chat),
}


@pytest.mark.parametrize("path", ENDPOINTS)
def test_every_field_has_a_row(path: str) -> None:
    """OpenAI's fields and ours are all in the table, and each of OpenAI's is declared by our
    model (an undeclared one would only be warned about)."""
    _, table, model, module = ENDPOINTS[path]
    theirs, ours = openai_fields(module), set(model.model_fields)
    assert theirs <= ours, f"OpenAI's fields our model lacks: {sorted(theirs - ours)}"
    assert set(table) == ours, (f"no row: {sorted(ours - set(table))}; "
                                f"not a field: {sorted(set(table) - ours)}")


@pytest.fixture(scope="module")
def server(tiny_folder) -> Iterator[tuple[str, str]]:
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        model=str(tiny_folder), dtype="float32", kv_cache_memory_bytes=16 << 20,
        max_model_len=TINY["max_position_embeddings"])))
    frontends, thread = start_frontends(engine, ServerConfig(port=0, grpc_port=None))
    try:
        wait_started(frontends, thread)
        yield f"http://127.0.0.1:{frontends.port}", engine.model_name
    finally:
        stop_frontends(frontends, thread)


def send(base_url: str, path: str, body: dict) -> tuple[int, dict]:
    """Status and JSON body; a stream's events as {"stream": [chunk, ..., "[DONE]"]}."""
    response = httpx.post(base_url + path, json=body, timeout=60)
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
        return response.status_code, {"stream": [e if e == "[DONE]" else json.loads(e)
                                                 for e in events]}
    return response.status_code, response.json()


CASES = [pytest.param(path, name, case, id=f"{path.rsplit('/', 1)[1]}-{name}-{i}")
         for path, (_, table, _, _) in ENDPOINTS.items()
         for name, cases in table.items() for i, case in enumerate(cases)]


@pytest.mark.parametrize(("path", "name", "case"), CASES)
def test_field_is_honoured_or_refused(server: tuple[str, str], path: str, name: str,
                                      case: Case) -> None:
    base_url, model = server
    value = model if case.value == MODEL else case.value
    sent = {**ENDPOINTS[path][0], **case.also, name: value}
    status, body = send(base_url, path, sent)
    if case.refused:
        assert status == 400, (status, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["param"] == name, body
    else:
        assert status == 200, (status, body)
        if case.check is not None:
            case.check(body, sent)


def test_refusal_says_what_is_not_supported(server: tuple[str, str]) -> None:
    """Through the official client: the error names the field and says it is not supported."""
    base_url, model = server
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=model, messages=CHAT["messages"], max_tokens=4,
            functions=[{"name": "f", "parameters": {}}])
    error = raised.value.body
    assert error["param"] == "functions" and error["code"] == "unsupported_value"
    assert "the deprecated functions (send tools instead) is not supported yet" in error["message"]


def test_unknown_field_is_ignored_with_a_warning(server: tuple[str, str],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A field neither OpenAI nor we know: ignored as vLLM does, but never silently."""
    base_url, _ = server
    with caplog.at_level(logging.WARNING, logger="treadle.server.openai.protocol"):
        status, _ = send(base_url, "/v1/chat/completions", {
            **CHAT, "frobnicate": 1, "messages": [{"role": "user", "content": "Hi",
                                                   "colour": "blue"}]})
    assert status == 200
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("ChatCompletionRequest" in w and "'frobnicate'" in w for w in warnings), warnings
    assert any("ChatMessage" in w and "'colour'" in w for w in warnings), warnings
