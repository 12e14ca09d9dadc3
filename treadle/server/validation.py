"""Checks of client input that both frontends make, so that REST and gRPC accept and refuse the
same requests. Each raises a `ValueError` worded "<field> must be ...": REST answers it with a
400, gRPC with INVALID_ARGUMENT. Sizes are checked before any work proportional to them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from treadle.core.sampling_params import (
    MAX_N,
    MAX_N_STOP_CHARS,
    MAX_PROMPT_CHARS_PER_TOKEN,
    SamplingParams,
)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# JSON can carry a lone surrogate ("\ud800"), which is no text: the tokenizer raises TypeError on
# it and UTF-8 cannot encode it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(name: str, text: str) -> None:
    """ValueError if `text` holds a lone surrogate."""
    match = _SURROGATE.search(text)
    if match:
        raise ValueError(f"{name} must be valid Unicode text, got a lone surrogate at character "
                         f"{match.start()}")


def max_prompt_chars(max_model_len: int) -> int:
    """The most characters a prompt (or a chat's contents) may have: more cannot fit the
    context, and the tokenizer should not be made to find that out."""
    return max_model_len * MAX_PROMPT_CHARS_PER_TOKEN


def check_prompt_text(name: str, text: str, max_model_len: int) -> None:
    """A text prompt, before it is tokenized."""
    limit = max_prompt_chars(max_model_len)
    if len(text) > limit:
        raise ValueError(f"{name} must be at most {limit} characters "
                         f"({MAX_PROMPT_CHARS_PER_TOKEN} per token of the context), got "
                         f"{len(text)}")
    check_text(name, text)


def check_batch(num_prompts: int, params: SamplingParams) -> None:
    """A batch of prompts (REST completions) runs n samples of each: bound the samples as n
    alone is bounded, each being an engine request searching the stop strings."""
    samples = num_prompts * params.n
    if samples > MAX_N:
        raise ValueError(f"prompt must be at most {MAX_N} prompts times n, got {num_prompts} "
                         f"prompts and n={params.n}")
    stop_chars = sum(len(s) for s in params.stop)
    if samples * stop_chars > MAX_N_STOP_CHARS:
        raise ValueError(f"stop must be at most {MAX_N_STOP_CHARS} characters times the "
                         f"samples (prompts times n), got {stop_chars} characters and "
                         f"{samples} samples")


def chat_conversation(messages: Sequence[tuple[str, str] | tuple[str, str, str | None]],
                      max_model_len: int) -> list[dict[str, str]]:
    """The conversation a chat template takes, from (role, content) or (role, content, name)
    tuples; a name reaches the template as the message's `name`, as transformers passes it."""
    if not messages:
        raise ValueError("messages must be a non-empty list")
    if len(messages) > max_model_len:  # every message adds at least one token
        raise ValueError(f"messages must be at most {max_model_len} messages (the context's "
                         f"length), got {len(messages)}")
    limit = max_prompt_chars(max_model_len)
    if sum(len(content) + len(name[0] or "" if name else "")
           for _, content, *name in messages) > limit:
        raise ValueError(f"messages must have at most {limit} characters of content "
                         f"({MAX_PROMPT_CHARS_PER_TOKEN} per token of the context)")
    conversation = []
    for i, (role, content, *name) in enumerate(messages):
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got "
                             f"{role[:32]!r}")
        check_text(f"messages[{i}].content", content)
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
        message = {"role": "system" if role == "developer" else role, "content": content}
        if name and name[0] is not None:
            check_text(f"messages[{i}].name", name[0])
            message["name"] = name[0]
        conversation.append(message)
    return conversation
