"""One engine step around the model, torch-free: expire, schedule, run the batch, time it.

EngineCore runs it with the executor and sampler as the batch runner; `treadle sim` runs the same
loop with a step-time profile as the runner and a virtual clock, so the simulator's batches are
the engine's by construction.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from treadle.core.kv_cache import KVCacheManager
from treadle.core.messages import EngineCoreOutput, StepRecord
from treadle.core.request import Request
from treadle.core.sched.scheduler import Scheduler, SchedulerOutput


class Clock(Protocol):
    def wall(self) -> float:
        """Seconds since the epoch (trace events)."""

    def monotonic(self) -> float:
        """Seconds on the clock of requests' arrival times, events and step durations."""


class SystemClock:
    def wall(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


# Runs one scheduled batch: computes it, samples, advances the scheduler (update_from_output)
# and returns the requests' outputs.
BatchRunner = Callable[[SchedulerOutput], list[EngineCoreOutput]]


@dataclass(frozen=True)
class StepStats:
    """What one step did: the batch's composition, the cache, the time it took."""

    start: float  # wall-clock seconds
    duration: float  # seconds
    num_requests: int
    num_prefill_tokens: int  # prompt chunks, and recomputation after preemption
    num_decode_tokens: int
    num_generated_tokens: int  # tokens sampled
    num_preemptions: int
    kv_cache_usage: float  # after the step
    scheduled_at: float  # monotonic: the requests' "scheduled" events
    model_duration: float = 0.0  # seconds of `duration` in the model pass; the rest is the
    # engine's own work (scheduling, sampling, updating requests)
    num_draft_tokens: int = 0  # proposed tokens checked (speculative decoding)
    num_accepted_tokens: int = 0  # of those, accepted
    num_experts_read: int = 0  # a mixture of experts' (layer, expert) pairs the pass ran

    def record(self) -> StepRecord:
        """This step as the frontend receives it."""
        return StepRecord(self.scheduled_at, self.duration, self.num_requests,
                          self.num_prefill_tokens, self.num_decode_tokens, self.num_preemptions,
                          self.num_draft_tokens, self.num_accepted_tokens)

    def trace_event(self) -> dict:
        """This step as a Chrome-trace / Perfetto complete event."""
        args = {"requests": self.num_requests, "prefill_tokens": self.num_prefill_tokens,
                "decode_tokens": self.num_decode_tokens,
                "generated_tokens": self.num_generated_tokens,
                "preemptions": self.num_preemptions,
                "kv_cache_usage": round(self.kv_cache_usage, 4),
                "model_ms": round(self.model_duration * 1e3, 3)}
        if self.num_draft_tokens:
            args.update(draft_tokens=self.num_draft_tokens,
                        accepted_tokens=self.num_accepted_tokens)
        if self.num_experts_read:
            args.update(experts_read=self.num_experts_read)
        return {"name": "step", "ph": "X", "pid": 0, "tid": 0, "ts": self.start * 1e6,
                "dur": self.duration * 1e6, "args": args}


class StepLoop:
    """The scheduler and KV cache manager of one engine, stepped on `clock`."""

    def __init__(self, scheduler: Scheduler, kv_cache_manager: KVCacheManager,
                 clock: Clock) -> None:
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager
        self.clock = clock
        self.last_step_stats: StepStats | None = None  # of the last step that ran a batch
        self.model_seconds = 0.0  # of the last step's model pass, as the runner measured it
        self.num_accepted_tokens = 0  # proposed tokens the last step accepted, as the runner
        # counted them
        self.experts_read = 0  # experts the last step's model pass ran, as the runner counted
        # Tokens scheduled per tenant since the start (the dashboard's share of steps): counted
        # in the loop over the batch that each step makes anyway.
        self.scheduled_tokens_by_tenant: Counter[str] = Counter()
        # The same by (tenant, LoRA adapter) for requests with one: the dashboard's adapters
        # table, whose rows a tenant's key sees only for its own requests.
        self.scheduled_tokens_by_lora: Counter[tuple[str, str]] = Counter()

    def step(self, run_batch: BatchRunner,
             before_schedule: Callable[[], list[EngineCoreOutput]] | None = None,
             ) -> list[EngineCoreOutput]:
        """Outputs of the step's requests, of those that waited past max_queue_wait and of
        `before_schedule`'s (requests it ended before the scheduler ran)."""
        clock, scheduler = self.clock, self.scheduler
        start, started = clock.wall(), clock.monotonic()
        outputs = ([self._expired(r) for r in scheduler.expire_waiting(started)]
                   if scheduler.config.max_queue_wait is not None else [])
        if before_schedule is not None:
            outputs += before_schedule()
        batch = scheduler.schedule()
        if not batch.scheduled:
            return outputs
        now = clock.monotonic()
        decodes = []
        draft_tokens = 0
        for s in batch.scheduled:
            request = s.request
            draft_tokens += len(s.spec_token_ids)
            decodes.append(is_decode(request, s.num_new_tokens - len(s.spec_token_ids)))
            request.events.append((now, "scheduled", s.num_new_tokens))
            self.scheduled_tokens_by_tenant[request.tenant] += s.num_new_tokens
            if request.lora_request is not None:
                self.scheduled_tokens_by_lora[request.tenant, request.lora_request.lora_name] += \
                    s.num_new_tokens
            if request.scheduled_time is None:
                request.scheduled_time = now
        decode_tokens = sum(decodes)
        self.model_seconds = 0.0
        self.num_accepted_tokens = 0
        self.experts_read = 0
        produced = run_batch(batch)
        end = clock.monotonic()
        duration = end - started
        scheduler.step_time.update(duration, batch.num_batched_tokens)
        prefill_tokens = batch.num_batched_tokens - decode_tokens - draft_tokens
        for s, decode in zip(batch.scheduled, decodes, strict=True):
            s.request.stats.step_ran(s.num_computed_tokens, s.num_new_tokens, decode,
                                     len(decodes), prefill_tokens, duration, end)
        self.last_step_stats = StepStats(
            start, duration, len(batch.scheduled), prefill_tokens, decode_tokens,
            sum(len(o.new_token_ids) for o in produced), len(batch.preempted),
            self.kv_cache_manager.block_pool.usage, now, self.model_seconds, draft_tokens,
            self.num_accepted_tokens, self.experts_read)
        return outputs + produced

    def _expired(self, request: Request) -> EngineCoreOutput:
        now = self.clock.monotonic()
        request.events.append((now, "finished", 0))
        return EngineCoreOutput(request.request_id, [], True, request.finish_reason,
                                timings=(now - request.queued_time, 0.0, 0.0),
                                events=request.events, stats=request.stats)


def latency_breakdown(request: Request, now: float) -> tuple[float, float, float]:
    """Seconds queued (from when it reached the engine), in prefill (first schedule to first
    token) and in decode."""
    scheduled = request.scheduled_time or request.queued_time
    first_token = request.first_token_time or now
    return scheduled - request.queued_time, first_token - scheduled, now - first_token


def is_decode(request: Request, num_new_tokens: int) -> bool:
    """One new token after outputs already computed: the decode phase (recomputation after a
    preemption and prompt chunks count as prefill)."""
    return (num_new_tokens == 1 and request.num_output_tokens > 0
            and request.num_computed_tokens == request.num_tokens - 1)
