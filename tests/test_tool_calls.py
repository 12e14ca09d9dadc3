"""Tool calling: the parsers on outputs of each format, then the official `openai` client's round
trip (call, tool result, final answer) against a live server on the default model, streamed and
not, with `tool_choice` required and named enforced by structured output."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from frontends import start_frontends, stop_frontends, wait_started

from treadle.config import AsyncEngineConfig, ServerConfig, build_config
from treadle.frontend.async_engine import AsyncEngine
from treadle.server.openai.protocol import ChatMessage
from treadle.server.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ParsedToolCall,
    tool_parser,
)
from treadle.server.openai.tools import chat_tools, template_inputs

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description":
                                      "The current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 24}},
                                          "required": ["city"], "additionalProperties": False}}},
]


# Parsers.

def test_hermes_parses_calls_after_content() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    parsed = HermesToolParser().parse(text)
    assert parsed.content == "Let me check."
    assert parsed.tool_calls == [ParsedToolCall("get_weather", '{"city": "Paris"}'),
                                 ParsedToolCall("get_time", "{}")]


def test_hermes_leaves_text_without_a_valid_call_as_content() -> None:
    parser = HermesToolParser()
    for text in ("no calls here", "<tool_call>{not json}</tool_call>",
                 '<tool_call>{"arguments": {}}</tool_call>'):
        assert parser.parse(text).tool_calls == [] and parser.parse(text).content == text
    # Cut short by max_tokens after a whole JSON object: still a call.
    assert parser.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}').tool_calls == [
        ParsedToolCall("f", '{"a": 1}')]


def test_hermes_stream_holds_back_a_possible_marker() -> None:
    parser = HermesToolParser()
    assert parser.tool_start("Hello") == 5
    assert parser.tool_start("Hello <tool") == 6
    assert parser.tool_start("Hello <tool_call>{") == 6
    assert parser.tool_start("a < b") == 5


def test_llama3_json_parses_one_or_several_calls() -> None:
    parser = Llama3JsonToolParser()
    parsed = parser.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
                          '; {"name": "get_time", "parameters": {"city": "Oslo"}}')
    assert parsed.content is None
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.tool_calls[1].arguments) == {"city": "Oslo"}
    assert parser.parse("The weather is fine.").tool_calls == []
    assert parser.parse('{"name": "f", "parameters": {').tool_calls == []  # cut short
    assert parser.tool_start("  {") == 2 and parser.tool_start("Sure") == 4
    assert parser.tool_start("<|python") == 0


def test_unknown_parser_is_named() -> None:
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        tool_parser("pythonic")


def test_tool_choice_checks() -> None:
    assert chat_tools(TOOLS, "none", None) is None and chat_tools(None, None, None) is None
    with pytest.raises(ValueError, match="^tool_choice names 'nope'"):
        chat_tools(TOOLS, {"type": "function", "function": {"name": "nope"}}, None)
    with pytest.raises(ValueError, match=r"^tools\[0\].function.name"):
        chat_tools([{"type": "function", "function": {"name": "a b"}}], None, None)
    with pytest.raises(ValueError, match="^tool_choice needs tools"):
        chat_tools(None, "required", None)
    required = chat_tools(TOOLS, "required", False)
    schema = json.loads(required.constraint().spec)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    jsonschema.validate([{"name": "get_time", "arguments": {"city": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"town": "Oslo"}},
                             {"name": "get_time", "arguments": {"city": "Oslo"}}], schema)


def test_tool_turns_without_a_tool_template_are_written_in_the_parsers_format() -> None:
    messages = [ChatMessage(role="user", content="Weather in Oslo?"),
                ChatMessage(role="assistant", tool_calls=[{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]),
                ChatMessage(role="tool", tool_call_id="call_1", content="3 C")]
    turns, fields, template_tools = template_inputs(messages, chat_tools(TOOLS, None, None),
                                                    HermesToolParser(), native=False)
    assert template_tools is None and len(fields) == len(turns) == 4
    assert turns[0][0] == "system" and '"name": "get_time"' in turns[0][1]
    assert turns[2] == ("assistant", '<tool_call>\n{"name": "get_weather", "arguments": '
                        '{"city": "Oslo"}}\n</tool_call>', None)
    assert turns[3] == ("user", "<tool_response>\n3 C\n</tool_response>", None)
    turns, fields, template_tools = template_inputs(messages, chat_tools(TOOLS, None, None),
                                                    HermesToolParser(), native=True)
    assert [t["function"]["name"] for t in template_tools] == ["get_weather", "get_time"]
    assert fields[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert fields[2] == {"tool_call_id": "call_1"}


# The round trip on the default model.

@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20,
        max_model_len=2048)))
    frontends, thread = start_frontends(engine, ServerConfig(port=0))
    try:
        wait_started(frontends, thread, timeout=300)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{frontends.port}/v1", api_key="none",
                            max_retries=0, timeout=300)
    finally:
        stop_frontends(frontends, thread)


def streamed(client: openai.OpenAI, **request) -> tuple[str, list[dict], str]:
    """A streamed chat's content, its tool calls assembled from their deltas, and its
    finish_reason, as a client accumulates them."""
    content, calls, finish_reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    return content, [calls[i] for i in sorted(calls)], finish_reason


@pytest.mark.default_model
@pytest.mark.parametrize("stream", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["whole", "streamed"])  # whole: 60 s, run with -m slow
def test_round_trip(client: openai.OpenAI, stream: bool) -> None:
    """required: a valid call, even from a 135M model; its result goes back as a tool message
    with the assistant's call; the model then answers in text."""
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    request = dict(model=client.models.list().data[0].id, tools=TOOLS, temperature=0,
                   max_tokens=64)
    if stream:
        _, calls, finish_reason = streamed(client, messages=messages, tool_choice="required",
                                           **request)
    else:
        response = client.chat.completions.create(messages=messages, tool_choice="required",
                                                  **request)
        message, finish_reason = response.choices[0].message, response.choices[0].finish_reason
        assert message.content is None
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in message.tool_calls]
    assert finish_reason == "tool_calls" and len(calls) >= 1
    call = calls[0]
    function = next(t["function"] for t in TOOLS if t["function"]["name"] == call["name"])
    jsonschema.validate(json.loads(call["arguments"]), function["parameters"])
    assert call["id"].startswith("call_")

    messages += [{"role": "assistant", "tool_calls": [
                     {"id": c["id"], "type": "function",
                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                     for c in calls]},
                 *[{"role": "tool", "tool_call_id": c["id"], "content": "18 C, sunny"}
                   for c in calls]]
    request["max_tokens"] = 16  # the answer's start is enough
    if stream:
        content, calls, finish_reason = streamed(client, messages=messages, tool_choice="none",
                                                 **request)
    else:
        response = client.chat.completions.create(messages=messages, tool_choice="none",
                                                  **request)
        content = response.choices[0].message.content
        calls, finish_reason = response.choices[0].message.tool_calls, \
            response.choices[0].finish_reason
    assert content and not calls and finish_reason in ("stop", "length")


@pytest.mark.default_model
def test_named_choice_gives_that_functions_arguments(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=client.models.list().data[0].id, tools=TOOLS, temperature=0.8, seed=3,
        max_tokens=32, n=2, messages=[{"role": "user", "content": "Time in Tokyo?"}],
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in response.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_time" and choice.finish_reason == "stop"
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])


@pytest.mark.default_model
def test_bad_tools_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Hi"}]
    for tools, choice, param in (
            (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
            ([{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}}}}],
             "required", "tools")):
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=model, messages=messages, tools=tools,
                                           tool_choice=choice, max_tokens=4)
        assert raised.value.body["param"] == param, raised.value.body
