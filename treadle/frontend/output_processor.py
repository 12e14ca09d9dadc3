"""From engine-core token outputs to what a client sees: text deltas, stop strings, n samples.

A client request with n > 1 runs as n engine requests (`{id}/{i}`: no client id holds a "/", so
none is another's sample), each its own sequence with its own seed (seed + i). With prefix caching
on, the later samples find the first one's full prompt blocks cached and share them by ref count,
then diverge; nothing is copied. Prompt logprobs are computed once, by sample 0 (a request that
asks for them gets no prefix hit: it needs logits at every prompt position); AsyncEngine sends
the others once sample 0 has prefilled, so they share its prompt's blocks and every sample's
first update has the prompt's logprobs. Stop strings are matched here, on text; a match
finishes the sample and asks the engine to abort it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from treadle.core.messages import EngineCoreOutput, TokenLogprobs
from treadle.core.request import RequestStats
from treadle.core.sampling_params import SamplingParams
from treadle.frontend.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from treadle.tokenizer import Tokenizer


@dataclass
class SampleDelta:
    """What one step added to one sample of a request."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    timings: tuple[float, float, float] | None = None  # engine's queue, prefill, decode seconds
    events: list[tuple[float, str, int]] | None = None  # the engine's timeline of the sample
    stats: RequestStats | None = None  # where the sample's engine time went, when finished


@dataclass
class SampleState:
    index: int
    engine_request_id: str
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detokenizer.output_text


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # a pooling request's, once it has finished

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """One sample's own parameters: n=1, a distinct seed so samples differ, and prompt logprobs
    for sample 0 only."""
    seed = None if params.seed is None else (params.seed + index) % 2**64
    return replace(params, n=1, seed=seed,
                   prompt_logprobs=params.prompt_logprobs if index == 0 else None)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.samples: dict[str, tuple[RequestState, SampleState]] = {}  # by engine request id

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """Track a client request; returns the engine requests to add (id, params)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        engine_ids = [request_id] if params.n == 1 else [f"{request_id}/{i}"
                                                         for i in range(params.n)]
        state = RequestState(request_id, prompt_token_ids, params, [
            SampleState(i, engine_id, IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output),
                logprobs=[] if params.logprobs is not None else None)
            for i, engine_id in enumerate(engine_ids)])
        self.requests[request_id] = state
        for sample in state.samples:
            self.samples[sample.engine_request_id] = (state, sample)
        return [(s.engine_request_id, sample_params(params, s.index)) for s in state.samples]

    def engine_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return [] if state is None else [s.engine_request_id for s in state.samples]

    def remove(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        for sample in state.samples if state else ():
            self.samples.pop(sample.engine_request_id, None)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[SampleDelta], list[str]]:
        """Deltas per sample, and the engine requests to abort (a stop string matched)."""
        deltas, to_abort = [], []
        for out in outputs:
            entry = self.samples.get(out.request_id)
            if entry is None:
                continue
            state, sample = entry
            if sample.finished:  # stopped on a string before the engine heard of it
                continue
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = out.prompt_logprobs
            state.num_cached_tokens = out.num_cached_tokens
            if out.embedding is not None:
                state.embedding = out.embedding
            new_token_ids, delta, text = add_tokens(sample.detokenizer, out.new_token_ids)
            sample.token_ids += new_token_ids
            if sample.logprobs is not None and out.logprobs:
                sample.logprobs += out.logprobs[:len(new_token_ids)]
            if not delta.stopped and out.finished:
                delta = sample.detokenizer.flush()
                text += delta.text
            if delta.stopped:
                sample.finish_reason, sample.stop_reason = "stop", delta.stop_reason
                if not out.finished:
                    to_abort.append(out.request_id)
            elif out.finished:
                sample.finish_reason = out.finish_reason
                last = sample.token_ids[-1] if sample.token_ids else None
                if out.finish_reason == "stop" and last in state.params.stop_token_ids:
                    sample.stop_reason = last
            deltas.append(SampleDelta(state.request_id, sample.index, text, new_token_ids,
                                      out.logprobs and out.logprobs[:len(new_token_ids)],
                                      sample.finished, sample.finish_reason,
                                      sample.stop_reason, out.timings, out.events,
                                      out.stats))
        return deltas, to_abort


def add_tokens(detokenizer: IncrementalDetokenizer, token_ids: list[int]
               ) -> tuple[list[int], DetokenizerDelta, str]:
    """Feed a step's tokens to a sample's detokenizer: those kept (up to the one completing a
    stop string), the last delta, and the text they release. Several tokens come from one step
    under speculative decoding: fed one by one, so tokens past a stop string are dropped."""
    if len(token_ids) <= 1:
        delta = detokenizer.add_tokens(token_ids)
        return token_ids, delta, delta.text
    text = ""
    for kept, token in enumerate(token_ids, 1):
        delta = detokenizer.add_tokens([token])
        text += delta.text
        if delta.stopped:
            return token_ids[:kept], delta, text
    return token_ids, delta, text
