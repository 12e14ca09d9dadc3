"""Tool calling on chat completions: `tools`, `tool_choice`, `parallel_tool_calls`, and the
tool turns of a conversation (assistant `tool_calls`, `tool` results) into the chat template.

- `tool_choice` "none" (or no tools): the tools are not shown and nothing is parsed;
- "auto" (the default with tools): the model may call; its output is read by the server's
  `--tool-call-parser` (tool_parsers.py);
- "required" and a named function are enforced by structured output, as vLLM does: "required"
  constrains the output to a JSON array of calls `[{"name": ..., "arguments": {...}}]` (at most
  one without `parallel_tool_calls`), a named function to its arguments' JSON object, so even a
  135M model returns a valid call.

Templates that render tools themselves (their text uses `tools`) get them, and tool turns, as
transformers passes them. Others (SmolLM2's) get the parser's own tool prompt as (the start of)
the system message, earlier calls written in the parser's format and tool results as user turns
in `<tool_response>` tags (as Qwen 2.5's template renders them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from treadle.core.sampling_params import MAX_GRAMMAR_CHARS, StructuredOutputsParams
from treadle.errors import InvalidField
from treadle.server.openai.protocol import (
    AssistantMessage,
    ChatMessage,
    Delta,
    FunctionCallOut,
    ToolCall,
    ToolCallDelta,
    ToolCallMessage,
)
from treadle.server.openai.tool_parsers import ParsedToolCall, ToolParser

MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule for function names
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ChatTools:
    """A request's tools as functions ({"name", "description", "parameters"}) and its choice:
    "auto", "required", or the name of the function it must call."""

    functions: list[dict[str, Any]]
    choice: str
    named: str | None
    parallel: bool

    @property
    def constrained(self) -> bool:
        return self.choice != "auto"

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output that enforces "required" or a named function; InvalidField
        (tools) when it is past the structured-output limit, as tools within their own limit
        may make it."""
        if self.named is not None:
            function = next(f for f in self.functions if f["name"] == self.named)
            return tool_constraint(function.get("parameters") or ANY_OBJECT)
        if self.choice != "required":
            return None
        calls = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": f["name"]}, "arguments": f.get("parameters") or ANY_OBJECT},
            "required": ["name", "arguments"], "additionalProperties": False}
            for f in self.functions]}
        array: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return tool_constraint(array)

    def constrained_calls(self, text: str) -> list[ParsedToolCall]:
        """The calls in an output made under `constraint()` (one cut short by max_tokens: what
        parses of it, possibly nothing)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return ([ParsedToolCall(self.named, text)] if self.named is not None else [])
        if self.named is not None:
            return [ParsedToolCall(self.named, json.dumps(value, ensure_ascii=False))]
        return [ParsedToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                for c in value]


def tool_constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except InvalidField as e:
        raise InvalidField("tools", f"tools: the constraint enforcing the tool choice: {e}") \
            from None


def chat_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel_tool_calls: bool | None) -> ChatTools | None:
    """The request's tools, or None when it offers none or chose "none". InvalidField naming the
    field (tools, tool_choice) for a malformed one."""
    if not tools and tool_choice not in (None, "none", "auto"):
        raise InvalidField("tool_choice", "tool_choice needs tools")
    if not tools or tool_choice == "none":
        return None
    functions = check_tools(tools)
    choice, named = "auto" if tool_choice is None else tool_choice, None
    if isinstance(choice, dict):
        function = choice.get("function")
        named = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(named, str):
            raise InvalidField("tool_choice", 'tool_choice must be "none", "auto", "required" '
                               'or {"type": "function", "function": {"name": ...}}')
        if named not in {f["name"] for f in functions}:
            raise InvalidField("tool_choice", f"tool_choice names {named[:64]!r}, which is not "
                               f"among the tools")
        choice = "function"
    elif choice not in ("auto", "required"):
        raise InvalidField("tool_choice", f'tool_choice must be "none", "auto", "required" or a '
                           f"function, got {str(choice)[:64]!r}")
    return ChatTools(functions, choice, named, parallel_tool_calls is not False)


def check_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each tool's function, checked: a name as OpenAI allows, parameters a JSON schema object."""
    if len(tools) > MAX_TOOLS:
        raise InvalidField("tools", f"tools must be at most {MAX_TOOLS} tools, got {len(tools)}")
    size = len(json.dumps(tools))
    if size > MAX_GRAMMAR_CHARS:
        raise InvalidField("tools", f"tools must be at most {MAX_GRAMMAR_CHARS} characters of "
                           f"JSON, got {size}")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise InvalidField("tools", f'tools[{i}] must be {{"type": "function", "function": '
                               f'{{...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise InvalidField("tools", f"tools[{i}].function.name must be 1 to 64 letters, "
                               f"digits, _, . or -, got {str(name)[:80]!r}")
        if name in names:
            raise InvalidField("tools", f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidField("tools", f"tools[{i}].function.parameters must be a JSON schema "
                               f"object")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidField("tools", f"tools[{i}].function.description must be a string")
        functions.append({k: function[k] for k in ("name", "description", "parameters")
                          if function.get(k) is not None})
    return functions


def check_tool_results(messages: list[ChatMessage]) -> None:
    """As OpenAI: each tool message answers a call of an earlier assistant message, named by
    its `tool_call_id` (a template renders a result beside its call; one that answers nothing
    would reach the model silently). InvalidField naming the message's field otherwise."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        calls.update(call.id for call in message.tool_calls or () if call.id)
        if message.role != "tool":
            continue
        param = f"messages[{i}].tool_call_id"
        if message.tool_call_id is None:
            raise InvalidField(param, f"{param} is required: a tool message answers a call of "
                               f"an earlier assistant message")
        if message.tool_call_id not in calls:
            raise InvalidField(param, f"{param} {message.tool_call_id[:64]!r} names no call of "
                               f"an earlier assistant message")


def template_inputs(messages: list[ChatMessage], tools: ChatTools | None, parser: ToolParser,
                    native: bool) -> tuple[list[tuple[str, str, str | None]],
                                           list[dict[str, Any]], list[dict[str, Any]] | None]:
    """What the chat template gets: (role, content, name) per message, extra fields per message
    (tool_calls, tool_call_id) for a `native` template, and its `tools` argument."""
    turns: list[tuple[str, str, str | None]] = []
    fields: list[dict[str, Any]] = []
    for message in messages:
        text, calls = message.text(), message.tool_calls or []
        if native:
            turns.append((message.role, text, message.name))
            fields.append({k: v for k, v in (
                ("tool_calls", [template_call(c) for c in calls] or None),
                ("tool_call_id", message.tool_call_id)) if v is not None})
            continue
        if message.role == "tool":
            turns.append(("user", f"<tool_response>\n{text}\n</tool_response>", None))
        else:
            written = [parser.format_call(c.function.name, arguments_value(c)) for c in calls]
            turns.append((message.role, "\n".join(filter(None, [text, *written])),
                          message.name))
        fields.append({})
    if tools is None or native:
        return turns, fields, (None if tools is None else
                               [{"type": "function", "function": f} for f in tools.functions])
    prompt = parser.instructions([json.dumps({"type": "function", "function": f})
                                  for f in tools.functions])
    if turns and turns[0][0] in ("system", "developer"):
        role, text, name = turns[0]
        turns[0] = (role, f"{text}\n\n{prompt}" if text else prompt, name)
    else:
        turns.insert(0, ("system", prompt, None))
        fields.insert(0, {})
    return turns, fields, None


def arguments_value(call: ToolCallMessage) -> Any:
    """A call's arguments as the template or format wants them: the decoded JSON object when
    they are one, else the text as sent."""
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments


def template_call(call: ToolCallMessage) -> dict[str, Any]:
    """An earlier call as transformers passes it to templates: arguments decoded."""
    return {"id": call.id, "type": "function", "function": {
        "name": call.function.name, "arguments": arguments_value(call)}}


def tool_message(tools: ChatTools | None, parser: ToolParser, text: str,
                 finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
    """A finished sample as OpenAI's assistant message: its tool calls read out of the text, and
    finish_reason tool_calls when it called any ("stop" for a named choice, as OpenAI)."""
    if tools is None:
        return AssistantMessage(content=text), finish_reason
    if tools.constrained:
        calls, content = tools.constrained_calls(text), None
    else:
        parsed = parser.parse(text)
        calls, content = parsed.tool_calls, parsed.content
        if not tools.parallel:
            calls = calls[:1]
    if not calls:
        return AssistantMessage(content=text), finish_reason
    message = AssistantMessage(content=content, tool_calls=[
        ToolCall(id=ParsedToolCall.new_id(),
                 function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls])
    return message, (finish_reason if finish_reason != "stop" or tools.named is not None
                     else "tool_calls")


class ToolCallStream:
    """One streamed sample's text split into content deltas and, at its end, tool-call deltas:
    content streams until a call may begin (or, under a required or named choice, never: the
    whole output is the call); the rest is held and parsed when the sample finishes."""

    def __init__(self, tools: ChatTools, parser: ToolParser) -> None:
        self.tools, self.parser = tools, parser
        self.text, self.sent = "", 0

    def delta(self, text: str, finish_reason: str | None) -> tuple[Delta | None, str | None]:
        """The delta to send for the sample's next text (None: nothing yet) and its
        finish_reason."""
        self.text += text
        if finish_reason is None:
            if self.tools.constrained:
                return None, None
            start = max(self.sent, self.parser.tool_start(self.text))
            content, self.sent = self.text[self.sent:start], start
            return (Delta(content=content) if content else None), None
        message, finish_reason = tool_message(self.tools, self.parser, self.text, finish_reason)
        if not message.tool_calls:
            return Delta(content=self.text[self.sent:]), finish_reason
        return Delta(tool_calls=[
            ToolCallDelta(index=i, id=call.id, type="function", function=call.function)
            for i, call in enumerate(message.tool_calls)]), finish_reason
