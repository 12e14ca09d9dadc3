"""Property-based: random add / step / abort / finish / expire sequences over tiny block pools,
under every queue policy.

After every operation the scheduler's and the KV cache's invariants hold (engine_sim.step checks
them, and the fake model checks every block table against the tokens). At the end every accepted
request has ended exactly once, the cache is empty, and every request that ran to its end
produced exactly the output it produces alone: preemption, chunking, batching and prefix hits
change nothing.
"""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import assert_scheduler_empty
from engine_sim import VOCAB, make_scheduler, model_for, reference_output, run_until_done, step
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from treadle.core.kv_cache import cdiv
from treadle.core.request import Request, RequestStatus
from treadle.core.sampling_params import SamplingParams
from treadle.core.sched.policy import POLICIES
from treadle.core.sched.scheduler import Scheduler
from treadle.core.sched.step_time import StepFit

# Prompts cut from a few shared stems, so prefix hits are frequent.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [1, 2, 3, 4, 20, 21]]
TENANTS = ["a", "b", "c"]
OBJECTIVES = [None, None, 2.0, 8.0, 30.0]  # seconds on the test's clock: one op, one second


def prompts(min_size: int = 0) -> st.SearchStrategy[list[int]]:
    return st.builds(lambda stem, cut, suffix: stem[:cut] + suffix,
                     st.sampled_from(STEMS), st.integers(min_size, 8),
                     st.lists(st.integers(1, VOCAB - 1), max_size=6))


add_op = st.tuples(st.just("add"), prompts(), st.integers(1, 8), st.integers(0, 2),
                   st.booleans(), st.sampled_from([None, None, "tenant"]),
                   st.sampled_from(TENANTS), st.sampled_from(OBJECTIVES),
                   st.sampled_from(OBJECTIVES))
step_op = st.tuples(st.just("step"))
end_op = st.tuples(st.sampled_from(["abort", "error"]), st.integers(0, 99))
expire_op = st.tuples(st.just("expire"))
ops = st.lists(st.one_of(add_op, add_op, add_op, step_op, step_op, step_op, end_op, expire_op),
               min_size=5, max_size=60)


class Clock:
    """The test's clock: it moves one second per operation."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@st.composite
def schedulers(draw: st.DrawFn, policy: str) -> Scheduler:
    s = make_scheduler(num_blocks=draw(st.integers(4, 12)), block_size=draw(st.integers(1, 4)),
                       max_num_batched_tokens=draw(st.integers(1, 16)),
                       max_num_seqs=draw(st.integers(1, 4)),
                       long_prefill_token_threshold=draw(st.integers(1, 16)),
                       policy=policy, max_model_len=draw(st.integers(8, 32)),
                       enable_prefix_caching=draw(st.booleans()), clock=Clock(),
                       max_num_partial_prefills=draw(st.integers(1, 3)),
                       max_queue_wait=draw(st.sampled_from([None, 3.0, 10.0])),
                       max_policy_preemptions=draw(st.integers(0, 2)),
                       max_kv_blocks_per_tenant=draw(st.sampled_from([None, 2, 5])),
                       tenant_weights=draw(st.dictionaries(st.sampled_from(TENANTS),
                                                           st.sampled_from([0.5, 1.0, 4.0]))))
    s.step_time.fit = draw(st.sampled_from([None, StepFit(0.0, 0.05), StepFit(0.2, 1.0)]))
    return s


def fits(s: Scheduler, prompt: list[int], max_tokens: int) -> bool:
    kv = s.kv_cache_manager
    return (bool(prompt) and len(prompt) + max_tokens <= s.max_model_len
            and cdiv(len(prompt) + max_tokens - 1, kv.block_size) <= kv.num_blocks)


def check_output(request: Request) -> None:
    expected = reference_output(request.prompt_token_ids, request.sampling_params)
    if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
        assert request.output_token_ids == expected, request
    else:
        assert request.output_token_ids == expected[:request.num_output_tokens], request


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), ops=ops)
def test_random_operations_keep_invariants_and_end_each_request_once(policy: str, data, ops):
    s = data.draw(schedulers(policy))
    check_operations(s, ops)
    target(float(s.num_preemptions))


def test_two_readmitted_requests_that_do_not_fit_together_do_not_take_turns_forever():
    # Hypothesis's example: under fair share, r2 (tenant b, the more served) and r3 (a), both
    # readmitted after preemption, need 5 of the 6 blocks each. The one first in the running
    # list took its chunk's blocks, then the other, on the policy's victim rule, preempted
    # whichever was more served: each step undid the other's recompute.
    s = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=10, max_num_seqs=4,
                       long_prefill_token_threshold=2, policy="fair", max_model_len=16,
                       enable_prefix_caching=False, clock=Clock(), max_num_partial_prefills=3,
                       max_policy_preemptions=1, max_kv_blocks_per_tenant=5)
    s.step_time.fit = StepFit(0.0, 0.05)
    stem, other = [1, 2, 3, 4, 5, 6, 7, 8], [17, 22, 3, 26, 11, 25]
    long_a = ("add", stem + [26, 14, 28, 27], 3, 0, False, None, "a", None, None)
    check_operations(s, [
        ("step",), ("add", [3, 1], 3, 0, False, None, "a", None, None), ("step",),
        ("add", other, 6, 0, True, None, "b", None, None),
        ("add", [1, 2, 3, 4, 5, 30, 3, 23], 5, 0, False, None, "b", None, None),
        ("add", [1, 2, 3, 4], 6, 0, True, None, "a", None, None), ("step",), long_a,
        ("add", stem[:6] + [29], 4, 0, True, None, "a", None, None),
        ("step",), ("step",), ("step",), ("step",),
        ("add", [], 3, 0, False, None, "a", None, None),
        ("add", other, 6, 0, True, None, "b", 2.0, 8.0),
        ("add", [1, 2, 3, 4, 5, 30, 3, 23], 5, 0, False, "tenant", "b", 30.0, 30.0),
        ("add", [1, 2, 3, 4], 6, 2, True, "tenant", "a", None, None), ("expire",),
        long_a[:7] + (2.0, 30.0), ("add", stem[:6] + [29], 4, 2, True, "tenant", "a", 8.0, None),
        ("step",)])


def check_operations(s: Scheduler, ops: list[tuple]) -> None:
    """Run `ops` on `s`, then every request to its end, checking invariants after each step and
    every request's output and end."""
    model = model_for(s)
    accepted: dict[str, Request] = {}
    ended: Counter[str] = Counter()
    for op in ops:
        s.clock.now += 1
        if op[0] == "add":
            _, prompt, max_tokens, priority, ignore_eos, salt, tenant, ttft, tpot = op
            request = Request(f"r{len(accepted)}-{len(ended)}-{s.num_waiting}", prompt,
                              SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                              priority=priority, arrival_time=s.clock.now, cache_salt=salt,
                              tenant=tenant, ttft=ttft, tpot=tpot)
            if request.request_id in accepted:
                continue
            try:
                s.add_request(request)
            except ValueError:
                assert not fits(s, prompt, max_tokens)
                continue
            assert fits(s, prompt, max_tokens)
            accepted[request.request_id] = request
        elif op[0] == "step":
            ended.update(r.request_id for r in step(s, model)[1])
        elif op[0] == "expire":
            expired = s.expire_waiting(s.clock.now)
            assert all(r.status is RequestStatus.FINISHED_QUEUE_TIMEOUT and r.num_output_tokens
                       == 0 and s.clock.now - r.arrival_time >= s.config.max_queue_wait
                       for r in expired)
            ended.update(r.request_id for r in expired)
            s.check_invariants()
        elif accepted:
            request_id = list(accepted)[op[1] % len(accepted)]
            status = (RequestStatus.FINISHED_ABORTED if op[0] == "abort"
                      else RequestStatus.FINISHED_ERROR)
            was_finished = accepted[request_id].is_finished
            ended_now = s.finish_request(request_id, status)
            assert (ended_now is None) == was_finished
            if ended_now is not None:
                assert ended_now is accepted[request_id] and ended_now.status is status
                ended[request_id] += 1
            s.check_invariants()
    ended.update(r.request_id for r in run_until_done(s, model))
    assert ended == Counter(accepted.keys())
    for request in accepted.values():
        assert request.is_finished and request.finish_reason is not None
        check_output(request)
    assert_scheduler_empty(s)


requests_specs = st.lists(st.tuples(prompts(min_size=1), st.integers(1, 8), st.booleans(),
                                    st.integers(0, 2), st.sampled_from(TENANTS),
                                    st.sampled_from(OBJECTIVES)),
                          min_size=1, max_size=8)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=100, deadline=None)
@given(specs=requests_specs, num_blocks=st.integers(4, 8), block_size=st.integers(1, 4),
       budget=st.integers(1, 16), caching=st.booleans())
def test_outputs_under_preemption_equal_outputs_without_pressure(policy, specs, num_blocks,
                                                                 block_size, budget, caching):
    outputs = []
    for blocks in (num_blocks, 1000):
        s = make_scheduler(num_blocks=blocks, block_size=block_size,
                           max_num_batched_tokens=budget, long_prefill_token_threshold=budget,
                           enable_prefix_caching=caching, policy=policy)
        for i, (prompt, max_tokens, ignore_eos, priority, tenant, ttft) in enumerate(specs):
            if cdiv(len(prompt) + max_tokens - 1, block_size) > num_blocks:
                continue
            s.add_request(Request(str(i), prompt, SamplingParams(max_tokens=max_tokens,
                                                                 ignore_eos=ignore_eos),
                                  arrival_time=i, priority=priority, tenant=tenant, ttft=ttft))
        outputs.append({r.request_id: r.output_token_ids for r in run_until_done(s)})
        if blocks == num_blocks:
            target(float(s.num_preemptions))
        assert_scheduler_empty(s)
    assert outputs[0] == outputs[1]
