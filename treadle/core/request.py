"""Request: the single source of one generation's state, from arrival to finish.

Its tokens live in one list, `all_token_ids` (prompt then outputs); everything else about them is
derived. `num_computed_tokens` counts the tokens whose KV is in the cache: prefill chunks, prefix
hits and decode steps all just advance it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from treadle.core.lora_request import LoRARequest
from treadle.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Each status with the finish reason reported to clients (None: not finished). Both are
    plain member fields: the scheduler asks every running request each step, and a dict of
    members hashed each one in Python."""

    WAITING = (1, None)
    RUNNING = (2, None)
    PREEMPTED = (3, None)
    FINISHED_STOPPED = (4, "stop")
    FINISHED_LENGTH = (5, "length")
    FINISHED_ABORTED = (6, "abort")
    FINISHED_ERROR = (7, "error")
    FINISHED_QUEUE_TIMEOUT = (8, "queue_timeout")  # waited past max_queue_wait, never scheduled
    # Its output's grammar failed (one llguidance compiles but cannot follow): the output so far
    # may break the constraint, so it is no normal stop.
    FINISHED_GRAMMAR_ERROR = (9, "grammar_error")

    def __init__(self, _: int, finish_reason: str | None) -> None:
        self.finish_reason = finish_reason
        self.is_finished = finish_reason is not None


DEFAULT_TENANT = "default"


@dataclass(slots=True)
class RequestStats:
    """Where a request's engine time went, counted as it runs, for `explain`: counters, and one
    entry per prefill chunk (as the timeline's events already have), nothing per decode token."""

    # At arrival: the requests queued and running, and the uncomputed tokens of those queued
    # that the policy puts first.
    waiting_ahead: int = 0
    running_ahead: int = 0
    tokens_ahead: int = 0
    # At arrival: the other tenant holding the most KV blocks (running requests') and its share
    # of the cache, when another tenant held any ("" / 0.0: none).
    top_tenant: str = ""
    top_tenant_kv_share: float = 0.0
    # Steps whose schedule passed it over while waiting because its LoRA adapter would have made
    # one adapter too many among the running (max_loras): its wait's cause, for explain.
    lora_cap_steps: int = 0
    # Prefill chunks (not recompute): (scheduled time, tokens, other requests in the step, their
    # prefill tokens, the step's seconds).
    prefill_chunks: list[tuple[float, int, int, int, float]] = field(default_factory=list)
    # Preemptions: tokens computed again, and seconds from each preemption until the request had
    # recomputed what it lost, before and after its first token.
    recompute_tokens: int = 0
    preempted_prefill_s: float = 0.0
    preempted_decode_s: float = 0.0
    # The preemption in progress: since when, the computed tokens to catch up to (0: none), and
    # whether it came before the first token.
    preempted_at: float = 0.0
    recompute_until: int = 0
    preempted_in_prefill: bool = True
    # Decode steps: how many, the sum of their batch sizes, and their seconds with and without
    # other requests' prefill tokens in the same step.
    decode_steps: int = 0
    decode_batch_sum: int = 0
    decode_mixed_steps: int = 0
    decode_mixed_s: float = 0.0
    decode_only_s: float = 0.0
    # Speculative decoding: tokens proposed for this request and checked, and of those accepted.
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def preempted(self, now: float, num_computed_tokens: int, in_prefill: bool) -> None:
        if not self.recompute_until:  # a second preemption before recovering extends the first
            self.preempted_at, self.preempted_in_prefill = now, in_prefill
        self.recompute_until = max(self.recompute_until, num_computed_tokens)

    def step_ran(self, start: int, num_new: int, decode: bool, batch_size: int,
                 prefill_tokens: int, seconds: float, end: float) -> None:
        """One scheduled share of a step that ran: tokens [start, start + num_new), in a batch of
        `batch_size` requests with `prefill_tokens` in all, which took `seconds`, ending at
        `end`."""
        if decode:
            self.decode_steps += 1
            self.decode_batch_sum += batch_size
            if prefill_tokens:
                self.decode_mixed_steps += 1
                self.decode_mixed_s += seconds
            else:
                self.decode_only_s += seconds
            return
        others_prefill = prefill_tokens - num_new
        if start >= self.recompute_until:
            self.prefill_chunks.append((end - seconds, num_new, batch_size - 1, others_prefill,
                                        seconds))
            return
        self.recompute_tokens += min(start + num_new, self.recompute_until) - start
        if start + num_new >= self.recompute_until:  # caught up: the preemption is over
            if self.preempted_in_prefill:
                self.preempted_prefill_s += end - self.preempted_at
            else:
                self.preempted_decode_s += end - self.preempted_at
            self.recompute_until = 0


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None = None, *, priority: int = 0,
                 arrival_time: float | None = None, cache_salt: str | None = None,
                 tenant: str = DEFAULT_TENANT, ttft: float | None = None,
                 tpot: float | None = None, pooling: str | None = None,
                 lora_request: LoRARequest | None = None, held: float = 0.0) -> None:
        for name, objective in (("ttft", ttft), ("tpot", tpot)):
            if objective is not None and not objective > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {objective}")
        self.request_id = request_id
        self.sampling_params = sampling_params or SamplingParams()
        self.priority = priority  # lower runs first under the priority policy
        # Seconds the frontend held it (a sample sent once sample 0 has prefilled): its arrival
        # is that much earlier, its place in the queue and deadline its request's; its time
        # limit in the queue (max_queue_wait) starts as it reaches the engine.
        self.held = held
        self.arrival_time = (time.monotonic() if arrival_time is None else arrival_time) - held
        self.cache_salt = cache_salt  # requests share cached blocks only under the same salt
        self.lora_request = lora_request  # its adapter (None: the base); keys its cached blocks
        self.tenant = tenant  # whose share of the server it uses, under the fair policy
        # Objectives in seconds (None: none): time to first token, time per output token.
        self.ttft = ttft
        self.tpot = tpot
        # A pooling (embedding) request, "last" or "mean": prefill only, it finishes when its
        # prompt is computed, never samples. None: a generating request.
        self.pooling = pooling
        # Its pooling accumulator (model/pooling.py's PooledHidden), kept by the engine core.
        self.pooled_hidden: Any = None
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # len(all_token_ids), kept as a field: the scheduler reads it for every running request
        # several times a step.
        self.num_tokens = self.num_prompt_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at the first schedule, for usage reports
        self.num_preemptions = 0
        # Preemptions by the policy, for a waiting request it ranks higher (not for blocks).
        self.num_displacements = 0
        self.num_skips = 0  # steps the scheduler passed over it while waiting, for lack of blocks
        # Logprobs of prompt tokens 1.. (sampler objects), filled as prefill chunks run.
        self.prompt_logprobs: list = []
        # A constrained request's llguidance matcher (engine/structured_output.py), advanced by
        # each sampled token; None: unconstrained.
        self.grammar: Any = None
        # Speculative decoding (core/spec_decode/): the tokens proposed to follow its tokens,
        # checked in its next step; and how many it proposes now (0: none measured yet).
        self.spec_token_ids: Sequence[int] = ()
        self.draft_length = 0
        # Engine-clock (time.monotonic) marks for the latency breakdown: queue, prefill, decode.
        self.scheduled_time: float | None = None  # first scheduled
        self.first_token_time: float | None = None
        # The timeline for debugging: (time.monotonic(), event, tokens) for queued, each
        # scheduled chunk (its token count), preempted, first_token, finished.
        self.events: list[tuple[float, str, int]] = [(self.queued_time, "queued", 0)]
        self.stats = RequestStats()

    @property
    def queued_time(self) -> float:
        """When it reached the engine (its arrival, but for the time the frontend held it)."""
        return self.arrival_time + self.held

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """The finish reason reported to clients (stop, length, abort, error, queue_timeout);
        None until then."""
        return self.status.finish_reason

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.num_tokens += 1

    def preempt(self, now: float) -> None:
        """Preempted by recompute: its KV is dropped; the caller requeues it."""
        self.events.append((now, "preempted", 0))
        self.stats.preempted(now, self.num_computed_tokens, self.first_token_time is None)
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
