"""Pydantic models of the OpenAI-compatible API: requests in, responses and stream chunks out.

Field names follow OpenAI's API, plus vLLM's extras for the rest of SamplingParams (top_k, min_p,
repetition_penalty, min_tokens, stop_token_ids, ...). Requests check types only (strict: "0.5"
is not a number); ranges are SamplingParams' to check, so that each rule lives in one place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WrapValidator,
    model_serializer,
    model_validator,
)

from treadle.core.sampling_params import StructuredOutputsParams
from treadle.errors import InvalidField
from treadle.server.validation import CHAT_ROLES, check_text

logger = logging.getLogger(__name__)


def one_of(expected: str) -> WrapValidator:
    """Report a value that fits no member of a union as one error, not one per member."""
    def validate(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"must be {expected}") from None
    return WrapValidator(validate)


class APIRequest(BaseModel):
    # Unknown fields are ignored with a warning naming them, as vLLM does: clients send fields
    # of newer API versions. Every field of OpenAI's own request schemas is declared, so that
    # only fields OpenAI does not know reach this path (tests/test_request_fields.py).
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def null_means_default(cls, data: Any) -> Any:
        """As in OpenAI's API, a field sent as null takes its default. And a string field (or a
        list of strings) must be text: JSON's "\\ud800" is not, and would fail later, in the
        tokenizer or in encoding a reply. Nested models check their own fields."""
        if not isinstance(data, dict):
            return data
        unknown = [name for name in data if name not in cls.model_fields]
        if unknown:
            logger.warning("%s: ignoring unknown field(s) %s", cls.__name__,
                           ", ".join(repr(name[:64]) for name in unknown[:16]))
        for name, value in data.items():
            if isinstance(value, str):
                check_text(name, value)
            elif isinstance(value, list) and value and isinstance(value[0], str):
                for text in value:  # a list that is not all strings fails validation anyway
                    if isinstance(text, str):
                        check_text(name, text)
        return {k: v for k, v in data.items() if v is not None}


class StreamOptions(APIRequest):
    include_usage: bool = False
    include_obfuscation: bool = False  # OpenAI's random padding of chunks: not supported yet


# Fields of OpenAI's API that Treadle does not implement yet, each accepted only at values that
# ask for nothing beyond what it does (the default, an empty list); any other value is a 400
# naming the field. name -> (whether a value is accepted given the request, what is missing).
NotYet = dict[str, tuple[Callable[[Any, Any], bool], str]]
NOT_YET_SAMPLING: NotYet = {
    "stream_options": (lambda v, _: not v.include_obfuscation,
                       "include_obfuscation"),
}
NOT_YET_COMPLETION: NotYet = {
    **NOT_YET_SAMPLING,
    "best_of": (lambda v, r: v == (r.n or 1), "a value other than n"),
    "suffix": (lambda v, _: v == "", "insertion (a suffix)"),
}
NOT_YET_CHAT: NotYet = {
    **NOT_YET_SAMPLING,
    "functions": (lambda v, _: v == [], "the deprecated functions (send tools instead)"),
    "function_call": (lambda v, _: v in ("none", "auto"),
                      "the deprecated function_call (send tool_choice instead)"),
    "audio": (lambda v, _: False, "audio output"),
    "modalities": (lambda v, _: v == ["text"], "output other than text"),
    "moderation": (lambda v, _: False, "moderation"),
    "prediction": (lambda v, _: False, "predicted outputs"),
    "prompt_cache_options": (lambda v, _: v.get("mode", "implicit") == "implicit"
                             and "ttl" not in v, "explicit cache breakpoints or a ttl"),
    "prompt_cache_retention": (lambda v, _: v == "in_memory", "retention other than in_memory"),
    "reasoning_effort": (lambda v, _: False, "reasoning effort"),
    "service_tier": (lambda v, _: v in ("auto", "default"), "tiers other than auto and default"),
    "store": (lambda v, _: not v, "storing completions"),
    "verbosity": (lambda v, _: False, "verbosity"),
    "web_search_options": (lambda v, _: False, "web search"),
}


Stop = Annotated[str | list[str], one_of("a string or a list of strings")]


class SamplingRequest(APIRequest):
    """Fields common to both generation endpoints. A sampling field left out (None) takes
    SamplingParams' default."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    stop: Stop | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    speculate: bool | None = None  # Treadle's: false opts out of speculative decoding
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the tenant, when the request carries no named API key
    safety_identifier: str | None = None  # OpenAI's successor of `user`: the tenant after it
    # Structured output (vLLM takes response_format on completions too), from one of: OpenAI's
    # response_format, vLLM's structured_outputs, or vLLM's older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # {json|regex|choice|grammar|json_object}
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: int = 0  # lower runs first under --policy priority
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared under one salt only
    # Objectives in milliseconds (else the X-Treadle-TTFT-Ms / X-Treadle-TPOT-Ms headers, else
    # the server's defaults): time to first token, time per output token after the first.
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    # Treadle's: the response's (a stream's last chunk's) `timings`, where its time went in ms
    # (frontend, queue, prefill, preemption, decode, stream), as llama.cpp's server returns them.
    return_timings: bool = False

    NOT_YET: ClassVar[NotYet] = NOT_YET_SAMPLING

    def unsupported(self) -> tuple[str, str] | None:
        """The first field set to a value that needs what Treadle does not support yet: its
        name and a message saying what."""
        for name, (accepts, what) in self.NOT_YET.items():
            value = getattr(self, name)
            if value is not None and not accepts(value, self):
                return name, f"{name}: {what} is not supported yet"
        return None

    def structured_output(self) -> tuple[str, StructuredOutputsParams] | None:
        """The constraint the request asks for and the field that asks it (None: none).
        InvalidField naming that field, its message starting with the name, for a malformed one
        or for two fields."""
        given = [(name, getattr(self, name)) for name in STRUCTURED_OUTPUT_FIELDS
                 if getattr(self, name) is not None
                 and not (name == "response_format" and getattr(self, name).get("type") == "text")]
        if not given:
            return None
        if len(given) > 1:
            fields = ", ".join(STRUCTURED_OUTPUT_FIELDS)
            raise InvalidField(given[1][0], f"{given[1][0]}: give at most one of {fields}; "
                               f"{given[0][0]} is given too")
        name, value = given[0]
        try:
            return name, structured_outputs_params(name, value)
        except InvalidField as e:  # StructuredOutputsParams' own, for a guided_* field
            raise (e if e.param == name else InvalidField(name, f"{name}: {e}")) from None

    def sampling_fields(self) -> dict[str, Any]:
        """The SamplingParams fields the client set."""
        names = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed", "min_tokens", "stop",
                 "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "logit_bias",
                 "skip_special_tokens", "prompt_logprobs", "speculate")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", "guided_json",
                            "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs_params(name: str, value: Any) -> StructuredOutputsParams:
    """One structured-output field's value as SamplingParams' constraint (InvalidField naming
    `name`, or structured_outputs, for a malformed one)."""
    if name == "response_format":
        kind = value.get("type")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind != "json_schema":
            raise InvalidField(name, f"response_format.type must be text, json_object or "
                               f"json_schema, got {str(kind)[:64]!r}")
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidField(name, 'response_format.json_schema must be an object {"name", '
                               '"schema", "strict"}')
        schema = spec.get("schema")
        # OpenAI's schema is optional: without one, any JSON object.
        try:
            return (StructuredOutputsParams(json_object=True) if schema is None
                    else StructuredOutputsParams(json=schema))
        except InvalidField as e:
            raise InvalidField(name, f"{name}: {e}") from None
    if name == "structured_outputs":
        unknown = [k for k in value if k not in STRUCTURED_OUTPUT_KEYS]
        if unknown:
            raise InvalidField(name, f"structured_outputs: unsupported key "
                               f"{str(unknown[0])[:64]!r} (one of "
                               f"{', '.join(STRUCTURED_OUTPUT_KEYS)})")
        return StructuredOutputsParams(**value)
    return StructuredOutputsParams(**{name.removeprefix("guided_"): value})


Prompt = Annotated[str | list[str] | list[int] | list[list[int]],
                   one_of("a string, a list of strings, a list of token ids, or a list of "
                          "lists of token ids")]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int = 16
    echo: bool = False
    logprobs: int | None = None  # top-N alternatives per token, in the legacy shape
    add_special_tokens: bool = True
    best_of: int | None = None
    suffix: str | None = None

    NOT_YET: ClassVar[NotYet] = NOT_YET_COMPLETION


class TextPart(APIRequest):
    type: Literal["text"]
    text: str


Content = Annotated[str | list[TextPart],
                    one_of('a string or a list of {"type": "text", "text": ...} parts')]


class FunctionCall(APIRequest):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(APIRequest):
    """A call in an earlier assistant message, sent back with the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(APIRequest):
    role: Literal[CHAT_ROLES]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Accepted for what they ask of OpenAI: nothing here. metadata is kept only with store (a
    # 400); one engine's prefix cache matches every prompt, so prompt_cache_key routes nowhere.
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    # Tool calling (tools.py): none, auto, required or a named function.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Not supported yet beyond their defaults: see NOT_YET_CHAT.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    moderation: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None

    NOT_YET: ClassVar[NotYet] = NOT_YET_CHAT


class TokenizeRequest(APIRequest):
    """vLLM's /tokenize: a `prompt` as completions take it, or `messages` as chat does."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only
    add_generation_prompt: bool = True  # messages only

    @model_validator(mode="after")
    def prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(APIRequest):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(APIRequest):
    """OpenAI's embeddings request (every field of its schema), plus vLLM's `priority` and
    `add_special_tokens`."""

    input: Prompt
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only for Matryoshka-trained models: refused, as vLLM does
    user: str | None = None  # the tenant, when the request carries no named API key
    priority: int = 0
    add_special_tokens: bool = True


# Responses. Built by the server, so not strict.


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class PromptLogprob(BaseModel):
    """vLLM's shape of one prompt_logprobs entry."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: one entry per token in each list."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None for a prompt's first token (echo)
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


# In a response only when the request set return_timings (a sample's, the slowest of several).
Timings = Annotated[dict[str, float] | None, Field(exclude_if=lambda value: value is None)]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that matched
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    """A completion, and also each chunk of a streamed one (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = []


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def drop_unset(self, handler: Any) -> dict:
        # OpenAI's chunks carry only what changed: the role once, then content.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    timings: Timings = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "treadle"
    max_model_len: int
    dtype: str  # what --dtype resolved to on this CPU
    platform: dict[str, str | bool]  # why that dtype, the CPU's level, which fast paths run
    # weights_bytes, and kv_cache: blocks, tokens, bytes per token, max concurrency at full
    # context, dtype (float32, bfloat16, int8)
    memory: dict[str, int | dict[str, int | float | str]]
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a base64 string of little-endian float32 with base64


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
