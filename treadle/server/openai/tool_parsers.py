"""Tool-call parsers, one per model family's output format (`--tool-call-parser`, as vLLM's):
what the model writes when it calls a function, read back into OpenAI's `tool_calls`.

A parser knows its format both ways: `parse` reads calls out of a finished output;
`tool_start` says where, in a partial output, a call begins or may begin, so that a stream
sends the text before it as content and holds the rest; `instructions` and `format_call`
describe the format to a model whose chat template cannot render tools (SmolLM2's), in a system
prompt and in earlier assistant turns.

- `hermes` (Hermes 2 Pro, Qwen 2.5 / 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, after optional content.
- `llama3_json` (Llama 3.1 / 3.2): the whole output is `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`), several separated by `;`.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @staticmethod
    def new_id() -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # the text outside the calls; None when there is none
    tool_calls: list[ParsedToolCall]


def call_from_json(value: Any, arguments_key: str) -> ParsedToolCall | None:
    """A call from its decoded JSON, or None if it is not shaped as one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`: text to hold back in a
    stream, as the marker may be arriving."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The calls in a finished output, and the content around them. Text that looks like a
        call but does not parse stays content."""

    @abstractmethod
    def tool_start(self, text: str) -> int:
        """Where in a partial output a call begins or may begin (len(text): no call so far)."""

    @abstractmethod
    def instructions(self, tools_json: list[str]) -> str:
        """A system prompt describing the tools (each a function's JSON) and the format."""

    @abstractmethod
    def format_call(self, name: str, arguments: Any) -> str:
        """An earlier assistant turn's call, as the model would have written it."""


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.START)
        if start < 0:
            return ParsedOutput(text, [])
        calls = []
        for match in self.CALL.finditer(text, start):
            try:
                call = call_from_json(json.loads(match.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        content = text[:start].strip()
        return ParsedOutput(content or None, calls)

    def tool_start(self, text: str) -> int:
        start = text.find(self.START)
        return start if start >= 0 else len(text) - held_prefix(text, self.START)

    def instructions(self, tools_json: list[str]) -> str:
        # Qwen 2.5's wording (its chat template), which Hermes-format models are tuned on.
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                "<tools>\n" + "\n".join(tools_json) + "\n</tools>\n\nFor each function call, "
                "return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}\n</tool_call>")

    def format_call(self, name: str, arguments: Any) -> str:
        return (f"{self.START}\n{json.dumps({'name': name, 'arguments': arguments})}\n"
                f"{self.END}")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix(self.PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return ParsedOutput(text, [])
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return ParsedOutput(text, [])
            call = call_from_json(value, "parameters")
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            position = end
            while position < len(body) and body[position] in "; \n\t":
                position += 1
        return ParsedOutput(None, calls)

    def tool_start(self, text: str) -> int:
        body = text.lstrip()
        start = len(text) - len(body)
        if body.startswith(("{", self.PYTHON_TAG)) or self.PYTHON_TAG.startswith(body):
            return start  # a call, or (all whitespace so far, or a tag arriving) maybe one
        return len(text)

    def instructions(self, tools_json: list[str]) -> str:
        # Llama 3.1's wording (its chat template's tool prompt).
        return ("Given the following functions, please respond with a JSON for a function call "
                "with its proper arguments that best answers the given prompt.\n\nRespond in the "
                "format {\"name\": function name, \"parameters\": dictionary of argument name and "
                "its value}. Do not use variables.\n\n" + "\n\n".join(tools_json))

    def format_call(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments})


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)}


def tool_parser(name: str) -> ToolParser:
    """ValueError naming the choices for an unknown parser."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got "
                         f"{name!r}")
    return TOOL_PARSERS[name]()
