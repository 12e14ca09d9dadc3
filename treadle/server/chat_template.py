"""Chat prompts for both frontends: a conversation rendered by the model's chat template, or by
the one `treadle serve --chat-template` gives instead (ServerConfig.chat_template). A model with
neither (a base model) cannot chat: both frontends refuse chat requests with a message saying so,
and completions still work."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from treadle.errors import InvalidField
from treadle.server.validation import chat_conversation
from treadle.tokenizer import ChatTemplateError, compile_template

if TYPE_CHECKING:
    from treadle.tokenizer import Tokenizer

NO_CHAT_TEMPLATE = ("messages: this model has no chat template (it is a base model): send a "
                    "plain prompt (completions) instead, or start the server with "
                    "--chat-template (a Jinja chat template, or a file holding one)")
JINJA_MARKERS = ("{{", "{%")


def load_chat_template(setting: str) -> str:
    """--chat-template's value: the text of the file it names, else the template itself (it has
    Jinja in it). ValueError for neither, or a template that does not parse: at startup, not at
    the first chat request."""
    path = Path(setting)
    if "\n" not in setting and path.is_file():
        template = path.read_text()
    elif any(marker in setting for marker in JINJA_MARKERS):
        template = setting
    else:
        raise ValueError(f"chat_template must be a Jinja chat template or a file holding one; "
                         f"{setting[:200]!r} is neither")
    compile_template(template)  # ChatTemplateError, a ValueError, names the syntax error
    return template


def chat_tokenizer(tokenizer: Tokenizer, chat_template: str | None) -> Tokenizer:
    """The tokenizer chat requests use: the engine's, with `chat_template` (the setting: a
    template or its file; None: the model's own) in place of its own."""
    if chat_template is None:
        return tokenizer
    chat = copy.copy(tokenizer)  # shares the vocabulary; only the template differs
    chat.chat_template = load_chat_template(chat_template)
    return chat


def apply_chat_template(tokenizer: Tokenizer,
                        messages: Sequence[tuple[str, str] | tuple[str, str, str | None]],
                        max_model_len: int, add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None,
                        message_fields: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """A chat's prompt token ids. `tools`: the template's tools argument; `message_fields`:
    more fields per message (tool_calls, tool_call_id), as transformers passes them.
    InvalidField (messages) for invalid messages, a tokenizer without a chat template, or a
    template that refuses the messages (roles out of order, say). Blocking: run it in a
    thread."""
    conversation = chat_conversation(messages, max_model_len)
    for message, fields in zip(conversation, message_fields or (), strict=False):
        message.update(fields)
    if tokenizer.chat_template is None:
        raise InvalidField("messages", NO_CHAT_TEMPLATE)
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=True,
                                             add_generation_prompt=add_generation_prompt,
                                             tools=tools)
    except (TemplateError, ChatTemplateError) as e:
        raise InvalidField("messages", f"messages: {e}") from e
