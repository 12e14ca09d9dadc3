"""One simulated engine: the engine's own step loop (core/step_loop.py: expiry, scheduling,
the step-time model, stats) on a virtual clock, with the profile as its batch runner.

The runner advances the clock by the profile's predicted step time and hands every request that
completes its chunk a token (never EOS: outputs run to their length). `add` refuses what the
engine process would (the policy's admission hook, through the scheduler's `refusal`). With a
speculative config, the engine's own `Speculator` picks who proposes how many tokens each step
(a proposer that always has them), the step runs them as the engine schedules them, and each
proposed token is accepted with the `spec_acceptance` chance until the first rejection.
A request with a LoRA adapter carries a `LoRARequest` (an id per adapter name), so the
scheduler's `max_loras` cap acts as in the engine, and its rows add the profile's LoRA terms.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from treadle.core.kv_cache import KVCacheManager
from treadle.core.lora_request import LoRARequest
from treadle.core.messages import EngineCoreOutput
from treadle.core.request import Request
from treadle.core.sampling_params import SamplingParams
from treadle.core.sched.policy import make_policy
from treadle.core.sched.scheduler import Scheduler, SchedulerOutput
from treadle.core.spec_decode.speculator import Speculator
from treadle.core.step_loop import StepLoop
from treadle.errors import InvalidField
from treadle.sim.profile import StepProfile, shared_decode_context
from treadle.sim.settings import SimSettings
from treadle.sim.workload import SimRequest

SAMPLED_TOKEN = 7  # the token every simulated step samples; no EOS is configured


class AlwaysProposes:
    """A proposer with a guess whenever asked: how many of its tokens are right is drawn when
    they are checked."""

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        return [SAMPLED_TOKEN] * max_tokens

    def finished(self, request_id: str, token_ids: list[int]) -> None:
        """Nothing to learn: every guess is drawn."""


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
    num_decode_seqs: int  # decode tokens: one per sequence
    kv_usage: float  # after the step
    num_preempted: int
    num_loras: int = 0  # distinct LoRA adapters whose rows the step ran


class VirtualClock:
    """The replica's clock: the time its current step ends (wall and monotonic alike)."""

    def __init__(self) -> None:
        self.now = 0.0

    def wall(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


class SimReplica:
    def __init__(self, settings: SimSettings, profile: StepProfile, index: int = 0,
                 record_batches: bool = False) -> None:
        engine = settings.engine
        self.index = index
        self.clock = VirtualClock()
        self.profile = profile
        self.kv = KVCacheManager(engine.cache.num_blocks, engine.cache.block_size,
                                 engine.cache.enable_prefix_caching)
        policy = make_policy(engine.policy, engine.scheduler, engine.policy_settings)
        self.scheduler = Scheduler(engine.scheduler, self.kv, policy,
                                   engine.model.max_model_len, eos_token_ids=(),
                                   clock=self.clock.monotonic,
                                   attention_break_even=settings.options.attention_break_even)
        self.loop = StepLoop(self.scheduler, self.kv, self.clock)
        self.requests: dict[str, Request] = {}
        self.timelines: dict[str, Timeline] = {}
        self.steps: list[StepRecord] = []
        # Each step's batch as (request id, tokens computed before, new tokens), for tests.
        self.batches: list[list[tuple[str, int, int]]] | None = [] if record_batches else None
        self.outstanding_tokens = 0  # prompt + output tokens of unfinished requests
        self.speculator = (None if engine.speculative_config is None
                           else Speculator(engine.speculative_config, AlwaysProposes()))
        self.spec_acceptance = settings.options.spec_acceptance
        self.rng = random.Random(index)  # which proposed tokens are accepted
        self.enable_lora = engine.model.enable_lora
        self.loras: dict[str, LoRARequest] = {}  # by adapter name, ids from 1 as first seen
        self.last_num_loras = 0  # of the batch the profile last ran

    @property
    def now(self) -> float:
        return self.clock.now

    @now.setter
    def now(self, value: float) -> None:
        self.clock.now = value

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
                      tpot=request.tpot, lora_request=self._lora_request(request.lora))
        why = self.scheduler.refusal(req)
        if why is not None:
            raise PolicyRefused(why, self.scheduler.policy.name)
        self.scheduler.add_request(req)
        self.requests[req.request_id] = req
        timeline = self.timelines[req.request_id] = Timeline(index, self.index, request.arrival)
        self.outstanding_tokens += request.prompt_len + request.output_len
        return timeline

    def _lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter's LoRARequest (one id per name, as the server's `LoraAdapters` gives);
        InvalidField, as the engine refuses it, when LoRA is not enabled."""
        if name is None:
            return None
        if not self.enable_lora:
            raise InvalidField("model", "LoRA adapters are not enabled (--enable-lora)")
        if name not in self.loras:  # no file behind it: the profile stands for its weights
            self.loras[name] = LoRARequest(name, len(self.loras) + 1, "")
        return self.loras[name]

    def step(self) -> list[Timeline]:
        """One engine step at `now`; returns the timelines of the requests that ended."""
        ended, last = [], self.loop.last_step_stats
        outputs = self.loop.step(self._run_batch, None if self.speculator is None
                                 else self._propose)
        stats = self.loop.last_step_stats
        if stats is not last:  # a batch ran
            self.steps.append(StepRecord(stats.start, stats.duration, stats.num_prefill_tokens,
                                         stats.num_decode_tokens, stats.kv_cache_usage,
                                         stats.num_preemptions, self.last_num_loras))
        for output in outputs:
            timeline = self.timelines[output.request_id]
            if output.new_token_ids:
                if timeline.first_token is None:
                    timeline.first_token = self.now
                else:
                    timeline.itl.append(self.now - timeline.last_token)
                timeline.last_token = self.now
            if output.finished:
                ended.append(self._end(self.requests.pop(output.request_id)))
        return ended

    def _propose(self) -> list[EngineCoreOutput]:
        assert self.speculator is not None
        self.speculator.propose(self.scheduler.running)
        return []

    def _accepted(self, proposed: int) -> int:
        """Proposed tokens accepted: each with the spec_acceptance chance, up to the first
        rejection."""
        accepted = 0
        while accepted < proposed and self.rng.random() < self.spec_acceptance:
            accepted += 1
        return accepted

    def _run_batch(self, batch: SchedulerOutput) -> list[EngineCoreOutput]:
        """The model's pass as the profile predicts it: the clock moves to its end."""
        # A speculating request's tokens are decode rows of their own, as the runner runs them.
        chunks = [chunk for s in batch.scheduled for chunk in (
            [(s.num_computed_tokens + i, 1) for i in range(s.num_new_tokens)]
            if s.spec_token_ids else [(s.num_computed_tokens, s.num_new_tokens)])]
        shared = 0 if not self.kv.block_pool.num_shared_blocks else shared_decode_context(
            ((s.num_computed_tokens, s.block_ids) for s in batch.scheduled
             if s.num_new_tokens == 1), self.kv.block_size)
        adapted = [s for s in batch.scheduled if s.request.lora_request is not None]
        self.last_num_loras = len({s.request.lora_request.lora_int_id for s in adapted})
        self.now += self.profile.predict_chunks(chunks, shared, self.last_num_loras,
                                                sum(s.num_new_tokens for s in adapted))
        if self.batches is not None:
            self.batches.append([(s.request.request_id, s.num_computed_tokens, s.num_new_tokens)
                                 for s in batch.scheduled])
        sampled = {s.request.request_id: SAMPLED_TOKEN for s in batch.scheduled
                   if s.produces_token}
        accepted = {}
        for s in batch.scheduled:
            if s.spec_token_ids:
                count = self._accepted(len(s.spec_token_ids))
                accepted[s.request.request_id] = list(s.spec_token_ids[:count])
                self.speculator.verified(s.request, len(s.spec_token_ids), count)
                self.loop.num_accepted_tokens += count
        before = {rid: self.requests[rid].num_output_tokens for rid in sampled}
        finished = {r.request_id for r in self.scheduler.update_from_output(batch, sampled,
                                                                            accepted)}
        # Every token the step appended (accepted ones before the sampled one).
        return ([EngineCoreOutput(request_id, [SAMPLED_TOKEN] * (
                    self.requests[request_id].num_output_tokens - before[request_id]),
                    request_id in finished) for request_id in sampled] +
                [EngineCoreOutput(request_id, [], True) for request_id in finished
                 if request_id not in sampled])

    def _end(self, request: Request) -> Timeline:
        timeline = self.timelines.pop(request.request_id)
        timeline.scheduled = request.scheduled_time
        timeline.finished = self.now
        timeline.finish_reason = request.finish_reason
        timeline.num_output_tokens = request.num_output_tokens
        timeline.num_cached_tokens = request.num_cached_tokens
        timeline.num_preemptions = request.num_preemptions
        self.outstanding_tokens -= request.num_prompt_tokens + request.sampling_params.max_tokens
        return timeline
