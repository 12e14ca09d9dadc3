"""Scheduler: each step, which requests share the next model pass and how many tokens each.

One mechanism: a request's `num_computed_tokens` trails its `num_tokens`, and each step hands out
tokens to close the gap within the step's token budget. A new prompt, a prefill chunk, a prefix
hit (tokens counted computed at admission), a decode step and a recompute after preemption are
all that one rule.
"""

from __future__ import annotations

import time
from bisect import insort
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from treadle.config import SchedulerConfig
from treadle.engine.kv_cache import KVCacheManager, assert_kv_cache_empty, cdiv
from treadle.engine.policies import SchedulingPolicy
from treadle.engine.request import Request, RequestStatus

# A waiting request passed over this many times for lack of blocks reserves the queue: nothing
# behind it is admitted until it fits. Running requests then drain (each is bounded by its
# max_tokens) and free their blocks, so it cannot starve; until then, smaller requests behind it
# may go, so it does not block the line either.
MAX_SKIPS = 8


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens [num_computed_tokens, + num_new_tokens)."""

    request: Request
    num_computed_tokens: int  # tokens already in the cache before this step
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table, covering the new tokens
    produces_token: bool  # the step reaches the last known token: sample the next one

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.request.all_token_ids[start:start + self.num_new_tokens]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 policy: SchedulingPolicy, max_model_len: int,
                 eos_token_ids: Iterable[int] = ()) -> None:
        self.config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.policy = policy
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: list[Request] = []  # sorted by the policy's key
        self.running: list[Request] = []  # sorted by the policy's key
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        """Queue a request, or refuse at once one that could never run."""
        num_prompt, max_tokens = request.num_prompt_tokens, request.sampling_params.max_tokens
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if num_prompt == 0:
            raise ValueError("the prompt must have at least one token")
        if num_prompt + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
                             f"{num_prompt + max_tokens} exceeds max_model_len "
                             f"({self.max_model_len})")
        kv = self.kv_cache_manager
        # The last sampled token is never fed back: the cache holds at most num_tokens - 1.
        num_blocks = cdiv(num_prompt + max_tokens - 1, kv.block_size)
        if num_blocks > kv.num_blocks:
            raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs "
                             f"{num_blocks} KV cache blocks of {kv.block_size} tokens; the "
                             f"whole cache has {kv.num_blocks}")
        self.requests[request.request_id] = request
        insort(self.waiting, request, key=self.policy.sort_key)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        kv = self.kv_cache_manager

        # Running requests first, in policy order: one decode token each, or a prefill chunk.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, threshold, budget)
            block_ids = kv.allocate_slots(request, num_new)
            while block_ids is None:
                victim = self.running.pop()  # sorts last, so not yet scheduled this step
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
                block_ids = kv.allocate_slots(request, num_new)
            if block_ids is None:  # it was the last running request, now preempted
                break
            output.scheduled.append(self._scheduled(request, num_new, block_ids))
            budget -= num_new
            i += 1

        # Then waiting requests, unless blocks ran short this step.
        if output.preempted:
            return output
        admitted = False
        for request in self.waiting:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            # Prompt logprobs need logits at every prompt position: no cached prefix.
            hit_blocks, num_hit = (kv.get_computed_blocks(request)
                                   if request.sampling_params.prompt_logprobs is None
                                   else ([], 0))
            num_new = min(request.num_tokens - num_hit, threshold, budget)
            block_ids = kv.allocate_slots(request, num_new, hit_blocks, num_hit)
            if block_ids is None:  # try the ones behind it, unless it now reserves (MAX_SKIPS)
                request.num_skips += 1
                if request.num_skips >= MAX_SKIPS:
                    break
                continue
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            insort(self.running, request, key=self.policy.sort_key)
            output.scheduled.append(self._scheduled(request, num_new, block_ids))
            budget -= num_new
            admitted = True
        if admitted:
            self.waiting = [r for r in self.waiting if r.status is not RequestStatus.RUNNING]
        return output

    def update_from_output(self, output: SchedulerOutput,
                           sampled: Mapping[str, int]) -> list[Request]:
        """Advance the step's requests; `sampled` holds a token for each one that
        `produces_token`. Returns the requests that finished, their blocks already freed."""
        finished = []
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += scheduled.num_new_tokens
            if not scheduled.produces_token:
                continue
            token = sampled[request.request_id]
            request.append_output_token(token)
            status = self._stop_status(request, token)
            if status is not None:
                self._end(request, status)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return finished

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request in any state, freeing its blocks. Returns it, or None when it has
        already ended (or never existed): a request ends exactly once."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        request = self.requests.get(request_id)
        if request is None:
            return None
        queue = self.running if request.status is RequestStatus.RUNNING else self.waiting
        queue.remove(request)
        self._end(request, status)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _scheduled(self, request: Request, num_new: int, block_ids: list[int]) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(request, start, num_new, block_ids,
                                produces_token=start + num_new == request.num_tokens)

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop its KV; it re-prefills prompt and outputs when readmitted,
        from the prefix cache where its blocks survive."""
        self.kv_cache_manager.free(request)
        request.events.append((time.monotonic(), "preempted", 0))
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        insort(self.waiting, request, key=self.policy.sort_key)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if (is_eos or token in params.stop_token_ids) and \
                request.num_output_tokens >= params.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        # add_request checked prompt + max_tokens <= max_model_len: max_tokens is the only cap.
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _end(self, request: Request, status: RequestStatus) -> None:
        del self.requests[request.request_id]
        self.kv_cache_manager.free(request)
        request.status = status

    def check_invariants(self) -> None:
        """Raise AssertionError unless queues, request states and the KV cache agree."""
        self.kv_cache_manager.check_invariants()
        key = self.policy.sort_key
        assert self.waiting == sorted(self.waiting, key=key), "waiting queue out of order"
        assert self.running == sorted(self.running, key=key), "running list out of order"
        waiting_ids = [r.request_id for r in self.waiting]
        running_ids = [r.request_id for r in self.running]
        assert sorted(waiting_ids + running_ids) == sorted(self.requests), "queues != requests"
        assert len(self.running) <= self.config.max_num_seqs
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
            assert request.num_computed_tokens == 0, request
        for request in self.running:
            assert request.status is RequestStatus.RUNNING, request
            assert 0 < request.num_computed_tokens < request.num_tokens, request
        tables = self.kv_cache_manager.block_tables
        assert tables.keys() == set(running_ids), "block tables != running requests"
        block_size = self.kv_cache_manager.block_size
        for request in self.running:
            assert len(tables[request.request_id]) == cdiv(request.num_computed_tokens,
                                                           block_size), request


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """After every request has ended: no requests left and the KV cache entirely free."""
    scheduler.check_invariants()
    assert not scheduler.requests, f"requests left: {sorted(scheduler.requests)}"
    assert_kv_cache_empty(scheduler.kv_cache_manager)
