"""Structured output: a request's constraint (JSON schema, regex, choice, Lark/GBNF grammar) as an
llguidance grammar, compiled off the engine loop, and each step's token bitmask.

llguidance (1.9.1) rather than xgrammar or outlines-core: it installs without torch (so the
frontend can check a grammar before admission), builds its tokenizer from our tokenizer.json,
compiles lazily (about 1 ms for a small JSON schema on the default model) and fills a batch of
masks in parallel (Rust, the GIL released).

Who does what:
- the frontend turns a request's fields into `StructuredOutputsParams` and checks them with its
  `ConstraintChecker` (torch-free, in a thread): a spec that does not compile, or fails before
  the model has chosen anything (on its first mask or the tokens it forces: llguidance compiles
  `(x{1000}){1000}` and a schema that only refers to itself, then cannot follow them), is a 400
  naming its field before the request is admitted;
- the engine's `StructuredOutputManager` compiles each spec once, in its own thread, into a
  template matcher kept in a bounded LRU by spec; each request gets a cheap copy (about 10 us);
- each step, `fill_bitmask` writes one int32 bitmask for the batch, only the rows of
  constrained requests (the others stay all ones); the sampler applies it. A speculating
  request's proposed tokens are cut to what its grammar takes (`grammar_drafts`) and each of
  its verified rows gets the mask after the tokens before it (`fill_draft_bitmasks`, one
  request at a time, on a copy of its matcher). The core advances each matcher with the
  request's sampled token (a speculating one's accepted tokens first) and ends the request
  when its grammar is complete, or with
  finish_reason "grammar_error" when its grammar fails later (after a choice of the model's):
  never as a normal stop with output that breaks it.

Torch-free: the bitmask is a numpy array the core wraps without copying.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from treadle.core.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse: a hit skips compilation; each entry is the grammar's lexer
# and parser tables, typically well under a megabyte.
GRAMMAR_CACHE_SIZE = 128
# Forced tokens a check follows before generation: a lexer that gives up does so at the first.
PROBE_TOKENS = 64
# llguidance's stop reasons that say its grammar gave up (a limit), not that it is complete.
GAVE_UP = frozenset({"ParserTooComplex", "LexerTooComplex", "InternalError"})
# JSON with one separator style and no free whitespace: a small model otherwise fills its
# max_tokens with newlines between keys (seen with SmolLM2-135M), leaving JSON unfinished.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked: see `check_structured_outputs`).
    ValueError when a JSON schema is not a JSON object or boolean."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("the JSON schema must be a JSON object or a boolean")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    return llguidance.grammar_from("grammar", params.grammar)


class ConstraintChecker:
    """The frontend's check of a constraint before admission: ValueError saying why it does not
    compile, or why it fails before the model has chosen anything (on its first mask, or on
    the first PROBE_TOKENS tokens it forces), which no generation could then get past. Blocking
    (about 1 ms for a small schema; a grammar whose lexer blows up, about a second): run it in
    a thread. The tokenizer is built at the first check (half a second for a 49K vocabulary)."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_id: int | None) -> None:
        """`vocab_size`: the width of the model's logits (may exceed the tokenizer's)."""
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.lock = threading.Lock()  # checks run in several threads; one tokenizer for all
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self.lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    str(self.tokenizer_file), n_vocab=self.vocab_size, eos_token=self.eos_token_id)
            return self._tokenizer

    def check(self, params: StructuredOutputsParams) -> None:
        grammar = grammar_text(params)
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"the {params.kind} constraint does not compile: {error.strip()}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        matcher.compute_bitmask()
        if not grammar_failed(matcher):
            matcher.consume_tokens(matcher.compute_ff_tokens()[:PROBE_TOKENS])
        if grammar_failed(matcher):
            raise ValueError(f"the {params.kind} constraint cannot be followed: its grammar "
                             f"fails before any output ({grammar_error(matcher)})")


def grammar_drafts(matcher: llguidance.LLMatcher, tokens: Sequence[int]) -> tuple[int, ...]:
    """The longest prefix of proposed tokens the grammar takes without ending: past a token
    that ended it a row could sample nothing (EOS alone, which ignore_eos forbids). Tried on a
    copy: a guess must never move (or break) the request's own matcher."""
    trial = matcher.deep_copy()
    taken = 0
    for token in tokens[:trial.validate_tokens(list(tokens))]:
        if not trial.consume_token(token) or trial.is_stopped():
            break
        taken += 1
    return tuple(tokens[:taken])


def grammar_failed(matcher: llguidance.LLMatcher) -> bool:
    """The matcher's grammar failed: an error (after which it still takes EOS), or a stop
    because it gave up."""
    return matcher.is_error() or matcher.stop_reason() in GAVE_UP


def grammar_error(matcher: llguidance.LLMatcher) -> str:
    """Why a matcher's grammar failed, in a line (its parser's state follows at length)."""
    return matcher.get_error().strip().partition("\n")[0] or matcher.stop_reason()


class StructuredOutputManager:
    """The engine's grammars: compiled in a thread of their own and cached by spec, one
    matcher per constrained request, the batch's bitmask each step."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        """`vocab_size`: the width of the model's logits (may exceed the tokenizer's)."""
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        self.compiler = ThreadPoolExecutor(1, thread_name_prefix="treadle-grammar")
        self.templates: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self._tokenizer: llguidance.LLTokenizer | None = None  # built at the first grammar
        self._mask_executor: llguidance.LLExecutor | None = None  # threads: at the first mask

    def compile(self, params: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        """The constraint's template matcher, compiled in the background (a cache hit: a future
        already done). Copy it per request with `new_matcher`."""
        key = f"{params.kind}:{params.spec}"
        future = self.templates.get(key)
        if future is not None:
            self.templates.move_to_end(key)
            return future
        future = self.compiler.submit(self._compile, params)
        self.templates[key] = future
        if len(self.templates) > self.cache_size:
            self.templates.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        if self._tokenizer is None:
            # Half a second for a 49k vocabulary: once per engine, and only if constrained
            # requests come at all.
            self._tokenizer = llguidance.LLTokenizer(str(self.tokenizer_file),
                                                     n_vocab=self.vocab_size,
                                                     eos_token=self.eos_token_ids)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {params.kind} constraint does not compile: "
                             f"{matcher.get_error().strip()}")
        return matcher

    @staticmethod
    def new_matcher(template: Future[llguidance.LLMatcher]) -> llguidance.LLMatcher:
        """A request's own matcher, from a compiled template (raises its compile error)."""
        return template.result().deep_copy()

    def fill_bitmask(self, matchers: list[llguidance.LLMatcher | None]) -> np.ndarray:
        """int32 [rows, ceil(vocab / 32)], bit t of a row set when token t is allowed: each
        matcher's row filled, rows without one left all ones."""
        if self._mask_executor is None:
            self._mask_executor = llguidance.LLExecutor(num_threads=min(4, os.cpu_count() or 1))
        bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), self.vocab_size)
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        llguidance.numpy.fill_next_token_bitmask_par(self._mask_executor, rows, bitmask)
        return bitmask

    def fill_draft_bitmasks(self, matchers: list[llguidance.LLMatcher | None],
                            drafts: list[Sequence[int]]) -> np.ndarray:
        """The bitmask of speculating requests' rows (each request's len(drafts) + 1 rows, as
        verification reads them): row i of a constrained one the mask after its first i
        proposed tokens (which `grammar_drafts` checked), the others' all ones."""
        bitmask = llguidance.numpy.allocate_token_bitmask(
            sum(len(d) + 1 for d in drafts), self.vocab_size)
        row = 0
        for matcher, tokens in zip(matchers, drafts, strict=True):
            if matcher is not None:
                trial = matcher.deep_copy()  # the request's own matcher takes only the output
                for i, token in enumerate(tokens):
                    llguidance.numpy.fill_next_token_bitmask(trial, bitmask, row + i)
                    trial.consume_token(token)
                llguidance.numpy.fill_next_token_bitmask(trial, bitmask, row + len(tokens))
            row += len(tokens) + 1
        return bitmask

    def shutdown(self) -> None:
        self.compiler.shutdown(wait=False, cancel_futures=True)
