"""Logprobs in each endpoint's OpenAI shape, from the sampler's TokenLogprobs.

Completions use the legacy shape ({tokens, token_logprobs, top_logprobs, text_offset}), chat the
newer one ({content: [{token, logprob, bytes, top_logprobs}]}); prompt_logprobs take vLLM's shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import decoders

from treadle.core.messages import TokenLogprobs
from treadle.server.openai.protocol import (
    CompletionLogprobs,
    PromptLogprob,
    TokenLogprob,
    TopLogprob,
)

if TYPE_CHECKING:
    from treadle.tokenizer import Tokenizer

# OpenAI reports a token too unlikely to represent this way (JSON has no -inf).
MIN_LOGPROB = -9999.0


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTable:
    """Each token's text and bytes, built once at startup so that formatting logprobs never
    detokenizes on the event loop. A token may hold part of a UTF-8 character: its bytes are
    exact (byte-level BPE), its text has U+FFFD for the missing part."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        ids = list(range(len(tokenizer)))
        if isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel):
            alphabet, added = byte_level_alphabet(), tokenizer.added_tokens_decoder
            self.bytes = [piece.encode() if i in added else bytes(alphabet[c] for c in piece)
                          for i, piece in enumerate(tokenizer.convert_ids_to_tokens(ids))]
            self.texts = [b.decode("utf-8", errors="replace") for b in self.bytes]
        else:
            self.texts = tokenizer.batch_decode([[i] for i in ids])
            self.bytes = [t.encode() for t in self.texts]

    def text(self, token_id: int) -> str:
        # The model's vocabulary may be padded past the tokenizer's: those ids have no text.
        return self.texts[token_id] if token_id < len(self.texts) else ""

    def byte_list(self, token_id: int) -> list[int] | None:
        return list(self.bytes[token_id]) if token_id < len(self.bytes) else None


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def chat_logprobs(table: TokenTable, entries: list[TokenLogprobs]) -> list[TokenLogprob]:
    def top(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=table.text(token_id), logprob=clamp(logprob),
                          bytes=table.byte_list(token_id))

    return [TokenLogprob(**top(e.token_id, e.logprob).model_dump(),
                         top_logprobs=[top(t, lp) for t, lp in zip(e.top_token_ids,
                                                                    e.top_logprobs, strict=True)])
            for e in entries]


def completion_logprobs(table: TokenTable, token_ids: list[int],
                        entries: list[TokenLogprobs | None], text_offset: int
                        ) -> CompletionLogprobs:
    """The legacy shape for `token_ids`, whose text starts at `text_offset` of the choice's
    text. An entry is None for a prompt's first token (echo): nothing precedes it. As in
    OpenAI's API, each top_logprobs dict holds the chosen token as well as the top N."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=True):
        out.tokens.append(table.text(token_id))
        out.text_offset.append(text_offset)
        text_offset += len(out.tokens[-1])
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(clamp(entry.logprob))
        top = {table.text(t): clamp(lp) for t, lp in zip(entry.top_token_ids, entry.top_logprobs,
                                                          strict=True)}
        top.setdefault(table.text(entry.token_id), clamp(entry.logprob))
        out.top_logprobs.append(top)
    return out


def prompt_logprobs(table: TokenTable, entries: list[TokenLogprobs | None]
                    ) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's shape: per prompt token, {token id: {logprob, rank, decoded_token}} for the prompt
    token and the top N (None for the first token)."""
    out: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {str(t): PromptLogprob(logprob=clamp(lp), rank=rank,
                                        decoded_token=table.text(t))
                  for rank, (t, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs,
                                                     strict=True), start=1)}
        ranked.setdefault(str(entry.token_id), PromptLogprob(
            logprob=clamp(entry.logprob), rank=entry.rank,
            decoded_token=table.text(entry.token_id)))
        out.append(ranked)
    return out
