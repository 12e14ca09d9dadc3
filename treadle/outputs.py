"""What the Python APIs return for a request (`LLM.generate`, `AsyncLLM.generate`), vLLM's
shape: one `RequestOutput` per prompt, one `CompletionOutput` per sample; torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from treadle.core.messages import TokenLogprobs
from treadle.frontend.output_processor import RequestState


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # stop, length, abort, error; None while it runs
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    finished: bool = True


def request_output(state: RequestState) -> RequestOutput:
    """A snapshot of `state`: each sample's text and tokens so far (copies, as `state` goes on
    changing)."""
    return RequestOutput(
        state.request_id, list(state.prompt_token_ids),
        [CompletionOutput(s.index, s.text, list(s.token_ids), s.finish_reason, s.stop_reason,
                          None if s.logprobs is None else list(s.logprobs))
         for s in state.samples],
        state.prompt_logprobs, state.num_cached_tokens, state.finished)
