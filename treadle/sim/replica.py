"""One simulated engine: the production Scheduler and KVCacheManager on a virtual clock.

`step()` does what EngineCore.step does, minus the model: expire requests past max_queue_wait,
schedule, advance the clock by the profile's predicted step time, hand every request that
completes its chunk a token (never EOS: outputs run to their length), and update. The predicted
duration feeds the scheduler's step-time model, as the engine feeds it the measured one; `add`
refuses what the engine process would (the policy's admission hook, through the scheduler's
`refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treadle.core.kv_cache import KVCacheManager
from treadle.core.request import Request
from treadle.core.sampling_params import SamplingParams
from treadle.core.sched.policy import make_policy
from treadle.core.sched.scheduler import Scheduler
from treadle.sim.profile import StepProfile, shared_decode_context
from treadle.sim.settings import SimSettings
from treadle.sim.workload import SimRequest

SAMPLED_TOKEN = 7  # the token every simulated step samples; no EOS is configured


class PolicyRefused(ValueError):
    """The policy refused the request at once (the engine's 429, its reason the policy's
    name)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Timeline:
    """What happened to one request, in virtual seconds."""

    index: int
    replica: int
    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    last_token: float | None = None
    itl: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None


@dataclass
class StepRecord:
    start: float
    duration: float
    num_prefill_tokens: int
    num_decode_seqs: int
    kv_usage: float  # after the step
    num_preempted: int


class SimReplica:
    def __init__(self, settings: SimSettings, profile: StepProfile, index: int = 0,
                 record_batches: bool = False) -> None:
        engine = settings.engine
        self.index = index
        self.now = 0.0
        self.profile = profile
        self.kv = KVCacheManager(engine.cache.num_blocks, engine.cache.block_size,
                                 engine.cache.enable_prefix_caching)
        policy = make_policy(engine.policy, engine.scheduler, engine.policy_settings)
        self.scheduler = Scheduler(engine.scheduler, self.kv, policy,
                                   engine.model.max_model_len, eos_token_ids=(),
                                   clock=lambda: self.now)
        self.timelines: dict[str, Timeline] = {}
        self.steps: list[StepRecord] = []
        # Each step's batch as (request id, tokens computed before, new tokens), for tests.
        self.batches: list[list[tuple[str, int, int]]] | None = [] if record_batches else None
        self.outstanding_tokens = 0  # prompt + output tokens of unfinished requests

    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def add(self, index: int, request: SimRequest) -> Timeline:
        """Queue `request` (its arrival is the clock's now or earlier); ValueError as the
        engine gives one that can never run, recorded as a failed request by the caller;
        PolicyRefused for one the policy refuses at once, as the engine process does."""
        self.now = max(self.now, request.arrival)
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
        req = Request(str(index), request.prompt_token_ids, params, priority=request.priority,
                      arrival_time=request.arrival, tenant=request.tenant, ttft=request.ttft,
                      tpot=request.tpot)
        why = self.scheduler.refusal(req)
        if why is not None:
            raise PolicyRefused(why, self.scheduler.policy.name)
        self.scheduler.add_request(req)
        timeline = self.timelines[req.request_id] = Timeline(index, self.index, request.arrival)
        self.outstanding_tokens += request.prompt_len + request.output_len
        return timeline

    def step(self) -> list[Timeline]:
        """One engine step at `now`; returns the timelines of the requests that ended."""
        scheduler = self.scheduler
        ended = [self._end(r) for r in scheduler.expire_waiting(self.now)] \
            if scheduler.config.max_queue_wait is not None else []
        output = scheduler.schedule()
        if not output.scheduled:
            return ended
        start = self.now
        chunks = [(s.num_computed_tokens, s.num_new_tokens) for s in output.scheduled]
        shared = 0 if not self.kv.block_pool.num_shared_blocks else shared_decode_context(
            ((s.num_computed_tokens, s.block_ids) for s in output.scheduled
             if s.num_new_tokens == 1), self.kv.block_size)
        duration = self.profile.predict_chunks(chunks, shared)
        self.now = end = start + duration
        scheduler.step_time.update(duration, output.num_batched_tokens)
        if self.batches is not None:
            self.batches.append([(s.request.request_id, s.num_computed_tokens, s.num_new_tokens)
                                 for s in output.scheduled])
        sampled = {}
        for s in output.scheduled:
            timeline = self.timelines[s.request.request_id]
            if timeline.scheduled is None:
                timeline.scheduled = start
            if s.produces_token:
                sampled[s.request.request_id] = SAMPLED_TOKEN
                if timeline.first_token is None:
                    timeline.first_token = end
                else:
                    timeline.itl.append(end - timeline.last_token)
                timeline.last_token = end
        finished = scheduler.update_from_output(output, sampled)
        num_decode = sum(1 for _, n in chunks if n == 1)
        self.steps.append(StepRecord(start, duration, output.num_batched_tokens - num_decode,
                                     num_decode, self.kv.block_pool.usage,
                                     len(output.preempted)))
        return ended + [self._end(r) for r in finished]

    def _end(self, request: Request) -> Timeline:
        timeline = self.timelines.pop(request.request_id)
        timeline.finished = self.now
        timeline.finish_reason = request.finish_reason
        timeline.num_output_tokens = request.num_output_tokens
        timeline.num_cached_tokens = request.num_cached_tokens
        timeline.num_preemptions = request.num_preemptions
        self.outstanding_tokens -= request.num_prompt_tokens + request.sampling_params.max_tokens
        return timeline
