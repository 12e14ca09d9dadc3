"""Incremental detokenization: token ids in, text deltas out, stop strings cut across tokens.

Two hold-backs keep what a client sees final:
- bytes: a token can end inside a UTF-8 character (an emoji is 4 bytes, often split over several
  byte tokens). While the decoded window ends with U+FFFD, what an incomplete sequence decodes
  to, its text is held; the next tokens complete the character, or `flush()` releases it as is.
- stop strings: the longest tail of the text that is a prefix of some stop string is held until
  later text completes a stop (cut there) or rules it out (released), so no fragment of a stop
  string ever reaches the stream. That tail is tracked per stop string as a Knuth-Morris-Pratt
  matcher state, advanced over new text only: work linear in the stop strings' total length
  (once per request: the tables are cached) and in the output, never in their product.

Decoding keeps a short window of ids (vLLM's prefix/read offsets): the ids since the last release
plus the new ones are decoded, and the text past the window's old part is new: one decode of a
few ids in the Rust `tokenizers.Tokenizer` per call, plus one when text is released. Not
`tokenizers.decoders.DecodeStream`: it hides its window, which `flush()` needs to decode the held
bytes at the end, and streams a prompt's trailing partial character; not `Tokenizer.decode`
alone: its clean-up of spaces does not commute with splitting the text (docs/decisions.md has
the timings).

The deltas, concatenated with `flush()`, equal the decode of the output ids whenever the decoder
is context-free, as SmolLM2's byte-level BPE is (tests/test_detokenizer.py checks it with prompts).
The prompt's last tokens are decoded ahead of the outputs anyway: SentencePiece decoders drop the
leading space of the first token of a text, which after a prompt is no first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from treadle.tokenizer import Tokenizer

# What an incomplete (or invalid) UTF-8 sequence decodes to.
REPLACEMENT_CHAR = "\ufffd"
# Enough to span a word and its leading space, so the first output decodes as it reads after the
# prompt.
PROMPT_CONTEXT_TOKENS = 5


@dataclass
class DetokenizerDelta:
    text: str  # new text, final: safe to stream now
    stopped: bool = False  # a stop string matched; the request is finished with reason "stop"
    stop_reason: str | None = None  # which stop string


class IncrementalDetokenizer:
    """One request's output text, built token by token.

    Only output text is searched for stop strings: a stop in the prompt, or one that starts in the
    prompt and ends in the outputs, does not match. When several stop strings match, the one that
    is complete first in the text wins (the smallest end; on a tie, the longer one): the result
    does not depend on how the tokens were grouped into calls.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._matchers = [_matcher(s) for s in self.stop]
        self._stop_chars = frozenset().union(*(chars for chars, _ in self._matchers))
        # Per stop string: the length of the longest tail of the text that is a prefix of it.
        self._matched = self._unmatched = (0,) * len(self.stop)
        self._held = 0  # the longest of them: how much of the text to hold back

        # The decode window: _ids[:_read] decoded last time (to _prefix_text), _ids[_read:] not yet.
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: the outputs cannot complete it in the output
            # text, so they decode on their own.
            self._ids, self._prefix_text = [], ""
        self._read = len(self._ids)

        self._pending = ""  # decoded text held back for stop strings
        self._emitted: list[str] = []  # joined on demand: += on a long str copies it each token
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """Everything emitted so far."""
        text = "".join(self._emitted)
        self._emitted = [text]
        return text

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Append output tokens; return the text that became final. After a stop, a no-op."""
        if self.stopped:
            return DetokenizerDelta("", True, self.stop_reason)
        self._ids.extend(token_ids)
        return self._release(self._decode_window(final=False), final=False)

    def flush(self) -> DetokenizerDelta:
        """The request ends for another reason (length, EOS, stop token): release what is held.

        Held bytes come out as they decode (U+FFFD for an incomplete character); held text that
        was the start of a stop string is released, as it never became one. Text the held bytes
        release can still complete a stop string, so this too may report a stop."""
        if self.stopped:
            return DetokenizerDelta("", True, self.stop_reason)
        return self._release(self._decode_window(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_window(self, final: bool) -> str:
        """The text the window's unread ids add, or "" while it ends inside a character."""
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or (text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        new_text = text[len(self._prefix_text):]
        # The ids just read become the next window's context; older ones are no longer needed.
        del self._ids[:self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text

    def _release(self, new_text: str, final: bool) -> DetokenizerDelta:
        # Emitted text never ends in a stop prefix (it is held), so a stop string can only start
        # in the pending text: searching it alone catches stops that span tokens.
        pending = self._pending + new_text
        match = self._first_stop(pending)
        if match is not None:
            start, stop = match
            end = start + len(stop) if self.include_stop_str_in_output else start
            text, self._pending = pending[:end], ""
            self.stopped, self.stop_reason = True, stop
        else:
            if new_text:
                self._advance(new_text)
            cut = len(pending) - (0 if final else self._held)
            text, self._pending = pending[:cut], pending[cut:]
        if text:
            self._emitted.append(text)
        return DetokenizerDelta(text, self.stopped, self.stop_reason)

    def _advance(self, new_text: str) -> None:
        """Advance each stop string's matcher over text in which no stop is complete: no state
        reaches a whole stop string, and the held tail lies in the pending text."""
        if new_text[-1] not in self._stop_chars:  # most tokens: nothing can be held
            self._matched, self._held = self._unmatched, 0
            return
        self._matched = tuple(
            _advance_matcher(stop, matcher, matched, new_text) if new_text[-1] in matcher[0] else 0
            for stop, matcher, matched in zip(self.stop, self._matchers, self._matched,
                                              strict=True))
        self._held = max(self._matched)

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop that is complete first in the text."""
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key < best:
                    best = key
        return None if best is None else (best[1], best[2])


@lru_cache(maxsize=256)  # 256 stop strings of at most MAX_STOP_CHARS characters each
def _matcher(stop: str) -> tuple[frozenset[str], tuple[int, ...]]:
    """A stop string's characters and KMP failure table: fail[i] is the length of the longest
    proper prefix of stop[:i + 1] that is also its suffix. Cached: n samples share one."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return frozenset(stop), tuple(fail)


def _advance_matcher(stop: str, matcher: tuple[frozenset[str], tuple[int, ...]], matched: int,
             text: str) -> int:
    """The matcher state after `text`: the length of the longest tail of (the text so far, whose
    state was `matched`) + `text` that is a prefix of `stop`. The caller knows that no whole
    stop string occurs there."""
    chars, fail = matcher
    # A tail that is a prefix of the stop consists of its characters: start past the last other
    # character (usually at once: text seldom ends in a run of a stop string's characters).
    start = len(text)
    while start and text[start - 1] in chars:
        start -= 1
    if start:
        matched = 0
    for c in text[start:]:
        while matched and stop[matched] != c:
            matched = fail[matched - 1]
        if stop[matched] == c:
            matched += 1
    return matched
