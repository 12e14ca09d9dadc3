"""SamplingParams: how one request samples and when it stops, validated when built.

Field names, defaults and ranges follow vLLM's `SamplingParams` (vllm/sampling_params.py,
`_verify_args`), so that a client of either engine means the same thing. Every error is a
`InvalidField` (treadle/errors.py) naming the field, worded "<field> must be <range>, got <value>";
the frontends answer it with a 400 or INVALID_ARGUMENT.

The MAX_* constants bound what one request may ask for (README, "Limits"): each is a size a
client chooses and the server pays for, on the event loop, in the engine loop or in memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

from treadle.errors import InvalidField

MAX_N = 128  # OpenAI's limit; each sample is an engine request, so n must stay bounded
MAX_LOGIT_BIAS = 100.0  # OpenAI: each bias in [-100, 100]
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes at most a 64-bit value
# vLLM (vllm/sampling_params.py, _MAX_TEMP) raises temperatures in (0, 0.01) to 0.01: a tinier one
# drives logits / temperature toward float32 overflow, and an inf logit turns the softmax to NaN.
MIN_TEMPERATURE = 1e-2
# Stop strings are searched in every sample's text after every token: their number and length
# (times n, the samples searching them) bound that work. vLLM sets no bound; OpenAI allows 4.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # all stop strings together
MAX_N_STOP_CHARS = 32768  # n x MAX_STOP_CHARS would be 512K characters searched per token
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit; the sampler applies every entry at every step
# A prompt's characters are checked before it is tokenized: more than this many per token of the
# context cannot fit it (natural text has about 4), so the tokenizer never sees a huge body.
MAX_PROMPT_CHARS_PER_TOKEN = 32
# A grammar (schema, regex, choices, Lark/EBNF text) is compiled for each new one, off the engine
# loop but still in its process: its size bounds that work and the compiled grammar's memory.
MAX_GRAMMAR_CHARS = 65536
MAX_CHOICES = 1024
# Each sample of a response carries its prompt's logprobs (the top prompt_logprobs of every
# prompt token, and its own): entries a response may hold in all, a few tens of megabytes of
# JSON. One sample over a full 8K context at the most logprobs (172K entries) stays within.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 19


@dataclass
class SamplingParams:
    """Sampling and stopping for one request.

    `top_k` is off at -1. vLLM also reads 0 as off; Treadle rejects 0 so that "keep no tokens"
    cannot be mistaken for "keep all". `stop` may be given as one string; it is stored as a
    list. `logit_bias` keys may be ints or decimal strings (JSON object keys are strings); they
    are stored as ints. Whether bias and stop token ids lie inside the vocabulary is checked by
    the engine, which knows the model.
    """

    n: int = 1
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop tokens cannot end the request before this many outputs
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each output token (plus the chosen one)
    prompt_logprobs: int | None = None  # top-N logprobs of each prompt token
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output's text
    speculate: bool = True  # False: no proposed tokens for this request (speculative decoding)

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n, 1, MAX_N, f"in [1, {MAX_N}]")
        self.temperature = _check_float("temperature", self.temperature, 0.0, None,
                                        ">= 0 (0: greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if self.n > 1 and self.temperature == 0:  # vLLM too: n greedy copies would be equal
            raise InvalidField("n", f"n must be 1 when temperature is 0 (greedy), got {self.n}")
        self.top_p = _check_float("top_p", self.top_p, 0.0, 1.0, "in (0, 1]", open_low=True)
        if not (_is_int(self.top_k) and self.top_k == -1):
            self.top_k = _check_int("top_k", self.top_k, 1, None, "-1 (off) or >= 1")
        self.min_p = _check_float("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty,
                                             -2.0, 2.0, "in [-2, 2]")
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty,
                                              -2.0, 2.0, "in [-2, 2]")
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty,
                                               0.0, None, "> 0", open_low=True)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, 0, MAX_SEED,
                                   "None or an int in [0, 2**64 - 1]")
        self.max_tokens = _check_int("max_tokens", self.max_tokens, 1, None, ">= 1")
        self.min_tokens = _check_int("min_tokens", self.min_tokens, 0, self.max_tokens,
                                     f"in [0, max_tokens={self.max_tokens}]")
        self.stop = _check_stop(self.stop)
        stop_chars = sum(len(s) for s in self.stop)
        if self.n * stop_chars > MAX_N_STOP_CHARS:
            raise InvalidField("stop", f"stop must be at most {MAX_N_STOP_CHARS} characters times "
                               f"n, got {stop_chars} characters and n={self.n}")
        self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidField("stop_token_ids", f"stop_token_ids must be at most "
                               f"{MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "speculate"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidField(name, f"{name} must be a bool, got "
                                   f"{_short(getattr(self, name))}")
        # Their upper bound is the engine's max_logprobs setting: check_max_logprobs.
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _check_int(name, getattr(self, name), 0, None,
                                               "None or an int >= 0"))
        self.logit_bias = _check_logit_bias(self.logit_bias)
        if not isinstance(self.structured_outputs, StructuredOutputsParams | None):
            raise _structured(f"structured_outputs must be a StructuredOutputsParams, got "
                              f"{_short(self.structured_outputs)}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's `StructuredOutputsParams`): exactly one of a JSON
    schema (`json`, a dict or its JSON text), any JSON object (`json_object`), a regular
    expression, one of several strings (`choice`), or a Lark / GBNF grammar. Checked for shape
    and size here; whether it compiles, by engine/structured_output.py."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])
        if len(given) != 1:
            raise _structured(f"structured_outputs must set exactly one of json, regex, choice, "
                              f"grammar and json_object, got {given or 'none'}")
        if not isinstance(self.json_object, bool):
            raise _structured(f"structured_outputs.json_object must be a bool, got "
                              f"{_short(self.json_object)}")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise _structured(f"structured_outputs.json must be a JSON schema (an object or its "
                              f"JSON text), got {_short(self.json)}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise _structured(f"structured_outputs.{name} must be a string, got "
                                  f"{_short(getattr(self, name))}")
        if self.choice is not None:
            if not (isinstance(self.choice, list | tuple) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise _structured(f"structured_outputs.choice must be a list of non-empty "
                                  f"strings, got {_short(self.choice)}")
            if len(self.choice) > MAX_CHOICES:
                raise _structured(f"structured_outputs.choice must have at most {MAX_CHOICES} "
                                  f"strings, got {len(self.choice)}")
        size = len(self.spec)
        if size > MAX_GRAMMAR_CHARS:
            raise _structured(f"structured_outputs must be at most {MAX_GRAMMAR_CHARS} "
                              f"characters, got {size}")

    @property
    def kind(self) -> str:
        """Which constraint: json, json_object, regex, choice or grammar."""
        return next(name for name in ("json", "regex", "choice", "grammar")
                    if getattr(self, name) is not None) if not self.json_object else "json_object"

    @property
    def spec(self) -> str:
        """The constraint as text: the key its compiled grammar is cached under."""
        value = {"json": self.json, "regex": self.regex, "choice": self.choice,
                 "grammar": self.grammar, "json_object": None}[self.kind]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def check_max_logprobs(params: SamplingParams, max_logprobs: int) -> None:
    """InvalidField naming the field if `params` asks for more logprobs per token than the
    engine's `max_logprobs` setting allows."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise InvalidField(name, f"{name} must be at most max_logprobs={max_logprobs} (the "
                             f"server's --max-logprobs), got {value}")


def _structured(message: str) -> InvalidField:
    return InvalidField("structured_outputs", message)


def _is_int(value: Any) -> bool:
    # bool is an Integral too, but True as a token count is a client's mistake.
    return isinstance(value, Integral) and not isinstance(value, bool)


def _short(value: Any, limit: int = 100) -> str:
    """repr(value), cut to `limit` characters."""
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python converts to a string
        return f"an int of about {int(value.bit_length() * 0.30103)} digits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _check_int(name: str, value: Any, low: int, high: int | None, allowed: str) -> int:
    """`value` as an int, which must lie in [low, high] (high None: no upper bound)."""
    if not _is_int(value) or value < low or (high is not None and value > high):
        raise InvalidField(name, f"{name} must be {allowed}, got {_short(value)}")
    return int(value)


def _check_float(name: str, value: Any, low: float, high: float | None, allowed: str,
                 open_low: bool = False, param: str | None = None) -> float:
    """`value` as a float, which must be finite and in [low, high] ((low, high] if open_low);
    `param`: the field it belongs to, when `name` is a part of it."""
    ok = (isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if open_low else value >= low) and (high is None or value <= high))
    if not ok:
        raise InvalidField(param or name, f"{name} must be {allowed}, got {_short(value)}")
    return float(value)


def _check_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        # Only the start of a huge value: the message must stay small.
        raise InvalidField("stop", f"stop must be a string or a list of non-empty strings, got "
                           f"{_short(stop)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidField("stop", f"stop must be at most {MAX_STOP_STRINGS} strings, got "
                           f"{len(stop)}")
    chars = sum(len(s) for s in stop)
    if chars > MAX_STOP_CHARS:
        raise InvalidField("stop", f"stop must be at most {MAX_STOP_CHARS} characters in all, "
                           f"got {chars}")
    return list(stop)


def _check_token_ids(name: str, ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, list | tuple) or not all(_is_int(t) and t >= 0 for t in ids):
        raise InvalidField(name, f"{name} must be a list of token ids (ints >= 0), got "
                           f"{_short(ids)}")
    return [int(t) for t in ids]


def _check_logit_bias(bias: Any) -> dict[int, float]:
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise InvalidField("logit_bias", f"logit_bias must be a dict of token id to bias, got "
                           f"{_short(bias)}")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidField("logit_bias", f"logit_bias must have at most {MAX_LOGIT_BIAS_ENTRIES} "
                           f"entries, got {len(bias)}")
    normalized: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdecimal() else key
        if not _is_int(token) or token < 0:
            raise InvalidField("logit_bias", f"logit_bias keys must be token ids (ints >= 0), got "
                               f"{_short(key)}")
        normalized[token] = _check_float(
            f"logit_bias[{token}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS,
            f"in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", param="logit_bias")
    return normalized
