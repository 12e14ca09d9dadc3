"""Request: the single source of one generation's state, from arrival to finish.

Its tokens live in one list, `all_token_ids` (prompt then outputs); everything else about them is
derived. `num_computed_tokens` counts the tokens whose KV is in the cache: prefill chunks, prefix
hits and decode steps all just advance it.
"""

from __future__ import annotations

import enum
import time

from treadle.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_QUEUE_TIMEOUT = enum.auto()  # waited past max_queue_wait, never scheduled

    @property
    def is_finished(self) -> bool:
        return self in FINISH_REASONS


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_QUEUE_TIMEOUT: "queue_timeout",
}

DEFAULT_TENANT = "default"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None = None, *, priority: int = 0,
                 arrival_time: float | None = None, cache_salt: str | None = None,
                 tenant: str = DEFAULT_TENANT, ttft: float | None = None,
                 tpot: float | None = None) -> None:
        for name, objective in (("ttft", ttft), ("tpot", tpot)):
            if objective is not None and not objective > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {objective}")
        self.request_id = request_id
        self.sampling_params = sampling_params or SamplingParams()
        self.priority = priority  # lower runs first under the priority policy
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt  # requests share cached blocks only under the same salt
        self.tenant = tenant  # whose share of the server it uses, under the fair policy
        # Objectives in seconds (None: none): time to first token, time per output token.
        self.ttft = ttft
        self.tpot = tpot
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at the first schedule, for usage reports
        self.num_preemptions = 0
        self.num_skips = 0  # steps the scheduler passed over it while waiting, for lack of blocks
        # Logprobs of prompt tokens 1.. (sampler objects), filled as prefill chunks run.
        self.prompt_logprobs: list = []
        # Engine-clock (time.monotonic) marks for the latency breakdown: queue, prefill, decode.
        self.scheduled_time: float | None = None  # first scheduled
        self.first_token_time: float | None = None
        # The timeline for debugging: (time.monotonic(), event, tokens) for queued, each
        # scheduled chunk (its token count), preempted, first_token, finished.
        self.events: list[tuple[float, str, int]] = [(self.arrival_time, "queued", 0)]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """The finish reason reported to clients (stop, length, abort, error, queue_timeout);
        None until then."""
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
