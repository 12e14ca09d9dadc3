"""What crosses between the frontend process and the engine process: typed messages, torch-free.

Requests (frontend → engine): `AddRequest`, `AbortRequest`, `Shutdown`. Outputs (engine →
frontend): first `EngineReady` or `EngineFailed`, then `StepOutputs` (each step's token outputs
with the engine's load) and `RequestRejected`. Plain dataclasses, pickled over
multiprocessing pipes; the offline API uses `EngineCoreOutput` and `TokenLogprobs` in-process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treadle.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Raw logprobs (log_softmax of the model's logits) around one token."""

    token_id: int
    logprob: float
    rank: int  # 1 + the number of other tokens at least as likely (vLLM counts ties against it)
    top_token_ids: list[int]  # the N most likely, most likely first
    top_logprobs: list[float]


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # stop, length, abort, error, queue_timeout
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    # On the finishing output: seconds queued, in prefill (first schedule to first token) and in
    # decode (first token to finish), on the engine's clock.
    timings: tuple[float, float, float] | None = None
    events: list[tuple[float, str, int]] | None = None  # the request's timeline, when finished
    # With the first new token, when asked for: one entry per prompt token, None for the first
    # (nothing precedes it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


# Frontend → engine.

@dataclass(frozen=True, slots=True)
class AddRequest:
    """One engine request (one sample of a client request): the ids are the frontend's."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    tenant: str
    cache_salt: str | None
    ttft: float | None  # objectives, seconds
    tpot: float | None
    # Refuse it at once if its TTFT objective cannot be met (the deadline policy).
    admit_deadline: bool


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop after the current step."""


EngineRequest = AddRequest | AbortRequest | Shutdown


# Engine → frontend.

@dataclass(frozen=True, slots=True)
class EngineReady:
    """The model is loaded: what the frontend learns of the engine."""

    max_model_len: int
    num_blocks: int
    vocab_size: int
    platform: dict[str, Any]  # dtype served and why, fast paths (the executor's platform_info)


@dataclass(frozen=True, slots=True)
class EngineFailed:
    """The engine could not start; `error` says why."""

    error: str


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's load after a step, or at a heartbeat when idle."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    has_work: bool
    # Counters since the engine started.
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    iteration_tokens: int | None  # tokens of the step that just ran; None: no step ran


@dataclass(frozen=True, slots=True)
class StepOutputs:
    outputs: list[EngineCoreOutput]
    load: EngineLoad


@dataclass(frozen=True, slots=True)
class RequestRejected:
    """The engine refused a request: `reason` invalid_request (a ValueError) or deadline."""

    request_id: str
    message: str
    reason: str


EngineOutput = EngineReady | EngineFailed | StepOutputs | RequestRejected
