"""What crosses between the frontend process and the engine process: typed messages, torch-free.

Requests (frontend → engine): `AddRequest`, `AbortRequest`, `Shutdown`. Outputs (engine →
frontend): first `EngineReady` or `EngineFailed`, then `StepOutputs` (each step's token outputs
with the engine's load, the step's `StepRecord`, now and then an `EngineCensus`) and
`RequestRejected` (and from data-parallel replicas, `RequestFailed`). Plain dataclasses,
pickled over multiprocessing pipes; the offline API uses `EngineCoreOutput` and `TokenLogprobs`
in-process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treadle.core.lora_request import LoRARequest
from treadle.core.request import RequestStats
from treadle.core.sampling_params import SamplingParams


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
    stats: RequestStats | None = None  # where its engine time went, when finished
    # With the first new token, when asked for: one entry per prompt token, None for the first
    # (nothing precedes it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # A pooling request's finishing output: its embedding (pooled, normalised hidden states).
    embedding: list[float] | None = None


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
    pooling: bool = False  # an embedding: prefill only, pooled as the engine's `pooling` says
    lora_request: LoRARequest | None = None  # its adapter; None: the base model
    # Seconds the frontend held it after sending its request's sample 0 (the other samples of
    # a long prompt go once sample 0 has prefilled): it keeps sample 0's place in the queue.
    held: float = 0.0


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
    # {"weights_bytes": as held, "kv_cache": blocks, tokens, bytes per token, max concurrency}
    memory: dict[str, Any]


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
    # Speculative decoding: (proposals, proposed tokens, accepted tokens) checked.
    spec_decode: tuple[int, int, int] = (0, 0, 0)
    # Position i: proposals whose first i + 1 tokens were accepted.
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    # The LoRA adapters (names) of the running and of the waiting requests, sorted.
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step ran, for metrics and the live dashboard: a few numbers, nothing per
    request or token."""

    scheduled_at: float  # CLOCK_MONOTONIC (shared with the frontend): requests' "scheduled"
    duration: float  # seconds
    num_requests: int
    num_prefill_tokens: int  # prompt chunks, and recomputation after preemption
    num_decode_tokens: int
    num_preemptions: int
    num_draft_tokens: int = 0  # proposed tokens checked (speculative decoding)
    num_accepted_tokens: int = 0  # of those, accepted


@dataclass(frozen=True, slots=True)
class EngineCensus:
    """Who is in the engine, counted at most once a second (it walks the queues and the
    cached blocks): (tenant, priority, requests) for the waiting and the running; the KV blocks
    each tenant holds and the tokens each has been scheduled, (tenant, count) sorted by tenant."""

    waiting: tuple[tuple[str, int, int], ...]
    running: tuple[tuple[str, int, int], ...]
    num_cached_free_blocks: int  # free blocks still holding a prefix (evicted on demand)
    # Blocks held by one tenant's running requests only; those held by several tenants'
    # (a prefix shared across tenants) are kv_blocks_shared: together, the blocks in use.
    kv_blocks_by_tenant: tuple[tuple[str, int], ...] = ()
    kv_blocks_shared: int = 0
    # Tokens scheduled (prompt chunks, recompute, decode, proposed) since the engine started.
    scheduled_tokens_by_tenant: tuple[tuple[str, int], ...] = ()
    # Requests with a LoRA adapter, (tenant, adapter, requests) waiting and running, and their
    # tokens scheduled since the start, (tenant, adapter, tokens); sorted. By tenant too, so that
    # a tenant's key reads only its own requests' rows.
    lora_waiting: tuple[tuple[str, str, int], ...] = ()
    lora_running: tuple[tuple[str, str, int], ...] = ()
    scheduled_tokens_by_lora: tuple[tuple[str, str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class StepOutputs:
    outputs: list[EngineCoreOutput]
    load: EngineLoad
    step: StepRecord | None = None  # the step that just ran; None: a heartbeat, no step
    census: EngineCensus | None = None  # when due


INVALID_REQUEST = "invalid_request"  # a RequestRejected's reason when the request is at fault


@dataclass(frozen=True, slots=True)
class RequestRejected:
    """The engine refused a request: `reason` INVALID_REQUEST (a ValueError; `param` names the
    field when it is an InvalidField), or the name of the queue policy that refused it at once
    (its admission hook: the frontend's 429)."""

    request_id: str
    message: str
    reason: str
    param: str | None = None


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """The engine replica running a request died (data parallelism): it ends with
    EngineUnavailable; the others go on."""

    request_id: str
    message: str


EngineOutput = EngineReady | EngineFailed | StepOutputs | RequestRejected | RequestFailed
