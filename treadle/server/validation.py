"""Checks of client input that both frontends make, so that REST and gRPC accept and refuse the
same requests. Each raises an `InvalidField` naming the field, worded "<field> must be ...":
REST answers it with a 400, gRPC with INVALID_ARGUMENT. Sizes are checked before any work
proportional to them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from treadle.core.sampling_params import (
    MAX_N,
    MAX_N_STOP_CHARS,
    MAX_PROMPT_CHARS_PER_TOKEN,
    MAX_PROMPT_LOGPROB_ENTRIES,
    SamplingParams,
)
from treadle.errors import PROMPT, InvalidField

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# JSON can carry a lone surrogate ("\ud800"), which is no text: the tokenizer raises TypeError on
# it and UTF-8 cannot encode it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(name: str, text: str, param: str | None = None) -> None:
    """InvalidField if `text` holds a lone surrogate; `param`: the field it is part of (None:
    `name` is the field)."""
    match = _SURROGATE.search(text)
    if match:
        raise InvalidField(param or name, f"{name} must be valid Unicode text, got a lone "
                           f"surrogate at character {match.start()}")


def max_prompt_chars(max_model_len: int) -> int:
    """The most characters a prompt (or a chat's contents) may have: more cannot fit the
    context, and the tokenizer should not be made to find that out."""
    return max_model_len * MAX_PROMPT_CHARS_PER_TOKEN


def check_prompt_text(name: str, text: str, max_model_len: int) -> None:
    """A text prompt, before it is tokenized."""
    limit = max_prompt_chars(max_model_len)
    if len(text) > limit:
        raise InvalidField(name, f"{name} must be at most {limit} characters "
                           f"({MAX_PROMPT_CHARS_PER_TOKEN} per token of the context), got "
                           f"{len(text)}")
    check_text(name, text)


def check_batch(num_prompts: int, params: SamplingParams) -> None:
    """A batch of prompts (REST completions) runs n samples of each: bound the samples as n
    alone is bounded, each being an engine request searching the stop strings."""
    samples = num_prompts * params.n
    if samples > MAX_N:
        raise InvalidField(PROMPT, f"prompt must be at most {MAX_N} prompts times n, got "
                           f"{num_prompts} prompts and n={params.n}")
    stop_chars = sum(len(s) for s in params.stop)
    if samples * stop_chars > MAX_N_STOP_CHARS:
        raise InvalidField("stop", f"stop must be at most {MAX_N_STOP_CHARS} characters times "
                           f"the samples (prompts times n), got {stop_chars} characters and "
                           f"{samples} samples")


def check_prompt_logprobs(num_prompt_tokens: int, params: SamplingParams, param: str) -> None:
    """The prompt logprobs a response would carry (each sample its prompt's: the top
    `prompt_logprobs` of each token and the token's own), `num_prompt_tokens` the prompts' in
    all, bounded: InvalidField naming `param`, the field that asked for them, past the limit."""
    if params.prompt_logprobs is None:
        return
    per_token = params.prompt_logprobs + 1
    entries = params.n * num_prompt_tokens * per_token
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise InvalidField(param, f"{param}: the response would carry {entries} prompt logprob "
                           f"entries ({params.n} samples x {num_prompt_tokens} prompt tokens x "
                           f"{per_token}), past the limit of {MAX_PROMPT_LOGPROB_ENTRIES} "
                           f"(MAX_PROMPT_LOGPROB_ENTRIES): ask for fewer samples or logprobs, "
                           f"or a shorter prompt")


def chat_conversation(messages: Sequence[tuple[str, str] | tuple[str, str, str | None]],
                      max_model_len: int) -> list[dict[str, str]]:
    """The conversation a chat template takes, from (role, content) or (role, content, name)
    tuples; a name reaches the template as the message's `name`, as transformers passes it."""
    if not messages:
        raise InvalidField("messages", "messages must be a non-empty list")
    if len(messages) > max_model_len:  # every message adds at least one token
        raise InvalidField("messages", f"messages must be at most {max_model_len} messages (the "
                           f"context's length), got {len(messages)}")
    limit = max_prompt_chars(max_model_len)
    if sum(len(content) + len(name[0] or "" if name else "")
           for _, content, *name in messages) > limit:
        raise InvalidField("messages", f"messages must have at most {limit} characters of "
                           f"content ({MAX_PROMPT_CHARS_PER_TOKEN} per token of the context)")
    conversation = []
    for i, (role, content, *name) in enumerate(messages):
        if role not in CHAT_ROLES:
            raise InvalidField("messages", f"messages[{i}].role must be one of "
                               f"{', '.join(CHAT_ROLES)}; got {role[:32]!r}")
        check_text(f"messages[{i}].content", content, "messages")
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
        message = {"role": "system" if role == "developer" else role, "content": content}
        if name and name[0] is not None:
            check_text(f"messages[{i}].name", name[0], "messages")
            message["name"] = name[0]
        conversation.append(message)
    return conversation
