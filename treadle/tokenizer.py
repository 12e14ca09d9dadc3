"""A model's tokenizer and chat template, over the `tokenizers` library and Jinja2 alone.

Torch-free, so the frontend process can tokenize, apply chat templates and detokenize:
transformers' `AutoTokenizer` imports torch (even with USE_TORCH=0) and takes seconds to load.

It reads the folder transformers' `save_pretrained` writes and behaves as transformers 5's
`TokenizersBackend` does on it (tests/test_tokenizer.py compares the two):
- tokenizer.json is the pipeline, as is; its post-processor alone adds BOS/EOS (transformers drops
  tokenizer_config.json's add_bos_token/add_eos_token when tokenizer.json exists).
- tokenizer_config.json names the special tokens (made special in the backend, as transformers
  does), and holds model_max_length, clean_up_tokenization_spaces, split_special_tokens and the
  chat template, unless chat_template.jinja (what transformers 5 writes) holds it.
- chat templates render in transformers' sandbox: trim_blocks, lstrip_blocks, loop controls,
  `raise_exception`, `strftime_now`, its `tojson`, the special tokens as variables.
A model-specific tokenizer class (tokenizer_class "LlamaTokenizer", say) is where this and
transformers can differ: transformers 5 rebuilds such a pipeline from its class's own settings,
not from tokenizer.json; this follows tokenizer.json, as the `tokenizers` library does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from treadle.model.source import ModelLoadError

# transformers' named special tokens, in its order (the order new ones get their ids).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(ValueError):
    """The chat template refused the messages (raise_exception, roles out of order), failed on
    them, or there is no chat template: the client's request cannot be served as a chat (400)."""


class Tokenizer:
    """Text to token ids and back, with transformers' method names where Treadle calls them."""

    def __init__(self, backend: BackendTokenizer, special_tokens: dict[str, str],
                 extra_special_tokens: list[str], chat_template: str | None,
                 model_max_length: int, clean_up_tokenization_spaces: bool) -> None:
        self.backend_tokenizer = backend
        self.special_tokens = special_tokens  # "eos_token" -> "<|im_end|>"; template variables
        self.chat_template = chat_template  # None: no chat (a base model)
        self.model_max_length = model_max_length
        self.bos_token_id = self._id_of("bos_token")
        self.eos_token_id = self._id_of("eos_token")
        self.pad_token_id = self._id_of("pad_token")
        tokens = dict.fromkeys([*special_tokens.values(), *extra_special_tokens])
        self.all_special_ids = [i for i in map(backend.token_to_id, tokens) if i is not None]
        # transformers skips the clean-up for BPE: it removes real spaces before punctuation.
        self._clean_up_spaces = (clean_up_tokenization_spaces
                                 and type(backend.model).__name__ != "BPE")

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        """The tokenizer saved in `folder` (ModelLoadError without a tokenizer.json)."""
        if not (folder / "tokenizer.json").is_file():
            raise ModelLoadError(f"{str(folder)!r} has no tokenizer.json")
        backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}

        # Named special tokens: the standard ones, and model-specific "*_token" ones (as
        # transformers reads them; add_bos_token and the like are booleans).
        named = {name: added_token(value) for name, value in config.items()
                 if name.endswith("_token") and isinstance(value, (str, dict))}
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        if isinstance(extra, dict):  # model-specific named tokens (image_token, ...)
            named.update({name: added_token(value) for name, value in extra.items()})
            extra = []
        extra = [added_token(value) for value in extra]
        named = {name: named[name] for name in sorted(named, key=special_token_order)}
        # As transformers does: each special token is (made) a special added token, so it is
        # matched whole in text and skipped by skip_special_tokens.
        backend.add_special_tokens([*named.values(), *extra])
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        # What padding or truncation tokenizer.json holds, transformers turns off for each call.
        backend.no_padding()
        backend.no_truncation()

        return cls(backend, {name: token.content for name, token in named.items()},
                   [token.content for token in extra],
                   read_chat_template(folder, config),
                   int(config.get("model_max_length", 10**30)),
                   bool(config.get("clean_up_tokenization_spaces", False)))

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    def __len__(self) -> int:
        """The vocabulary's size, added tokens included."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True
                 ) -> dict[str, list[int] | list[list[int]]]:
        """{"input_ids": ids} for one text, or a list of ids per text for a list of texts."""
        if isinstance(text, str):
            ids = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
            return {"input_ids": ids}
        encodings = self.backend_tokenizer.encode_batch(list(text),
                                                        add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(list(token_ids),
                                             skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._clean_up_spaces else text

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
                     ) -> list[str]:
        texts = self.backend_tokenizer.decode_batch([list(s) for s in sequences],
                                                    skip_special_tokens=skip_special_tokens)
        return [clean_up_tokenization(t) for t in texts] if self._clean_up_spaces else texts

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Each id's token as the vocabulary spells it (byte-level BPE: "Ġthe")."""
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            **template_kwargs: Any) -> str | list[int]:
        """The conversation rendered by the chat template: its text, or (tokenize) its token ids,
        encoded without adding special tokens (the template writes them). `template_kwargs` are
        further template variables; they override the special tokens of the same name.
        ChatTemplateError when there is no template or it fails on these messages."""
        if self.chat_template is None:
            raise ChatTemplateError("the model has no chat template (a base model); use "
                                    "completions, or give a chat template")
        # As transformers does: a None field (OpenAI's content=None) reads as absent.
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        try:
            text = compile_template(self.chat_template).render(
                messages=messages, tools=None if tools is None else list(tools),
                documents=None, add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **template_kwargs})
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from e
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


def added_token(value: str | dict) -> AddedToken:
    """A special token as tokenizer_config.json spells it: its text, or an AddedToken's fields."""
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    fields = ("single_word", "lstrip", "rstrip", "normalized")
    return AddedToken(value["content"], special=value.get("special", True),
                      **{k: value[k] for k in fields if k in value})


def special_token_order(name: str) -> int:
    """transformers' order: the standard names first, then model-specific ones as read."""
    return SPECIAL_TOKEN_NAMES.index(name) if name in SPECIAL_TOKEN_NAMES else len(
        SPECIAL_TOKEN_NAMES)


def read_chat_template(folder: Path, config: dict) -> str | None:
    """chat_template.jinja, else the config's (one template, or transformers' list of named
    ones: the "default"). transformers reads them in this order."""
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of the spaces WordPiece-style decoders leave before punctuation."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                           (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                           (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks in
    some templates; rendering, it is its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters ("<" becomes "\u003c"): prompts need them as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def template_environment() -> ImmutableSandboxedEnvironment:
    """transformers' environment: chat templates come from the Hub, so they run sandboxed."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    try:
        return template_environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}") from e
