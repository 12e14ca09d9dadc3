"""Property-based: random add / step / abort / finish sequences over tiny block pools.

After every operation the scheduler's and the KV cache's invariants hold (engine_sim.step checks
them, and the fake model checks every block table against the tokens). At the end every accepted
request has ended exactly once, the cache is empty, and every request that ran to its end
produced exactly the output it produces alone: preemption, chunking, batching and prefix hits
change nothing.
"""

from __future__ import annotations

from collections import Counter

from engine_sim import VOCAB, make_scheduler, model_for, reference_output, run_until_done, step
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from treadle.engine.kv_cache import cdiv
from treadle.engine.policies import FCFSPolicy, PriorityPolicy
from treadle.engine.request import Request, RequestStatus
from treadle.engine.sampling_params import SamplingParams
from treadle.engine.scheduler import Scheduler, assert_scheduler_empty

# Prompts cut from a few shared stems, so prefix hits are frequent.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [1, 2, 3, 4, 20, 21]]



def prompts(min_size: int = 0) -> st.SearchStrategy[list[int]]:
    return st.builds(lambda stem, cut, suffix: stem[:cut] + suffix,
                     st.sampled_from(STEMS), st.integers(min_size, 8),
                     st.lists(st.integers(1, VOCAB - 1), max_size=6))


add_op = st.tuples(st.just("add"), prompts(), st.integers(1, 8), st.integers(0, 2),
                   st.booleans(), st.sampled_from([None, None, "tenant"]))
step_op = st.tuples(st.just("step"))
end_op = st.tuples(st.sampled_from(["abort", "error"]), st.integers(0, 99))
ops = st.lists(st.one_of(add_op, add_op, add_op, step_op, step_op, step_op, end_op),
               min_size=5, max_size=60)


@st.composite
def schedulers(draw: st.DrawFn) -> Scheduler:
    return make_scheduler(num_blocks=draw(st.integers(4, 12)), block_size=draw(st.integers(1, 4)),
                          max_num_batched_tokens=draw(st.integers(1, 16)),
                          max_num_seqs=draw(st.integers(1, 4)),
                          long_prefill_token_threshold=draw(st.integers(1, 16)),
                          policy=draw(st.sampled_from([FCFSPolicy(), PriorityPolicy()])),
                          max_model_len=draw(st.integers(8, 32)),
                          enable_prefix_caching=draw(st.booleans()))


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


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=schedulers(), ops=ops)
def test_random_operations_keep_invariants_and_end_each_request_once(s: Scheduler, ops):
    model = model_for(s)
    accepted: dict[str, Request] = {}
    ended: Counter[str] = Counter()
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, priority, ignore_eos, salt = op
            request = Request(f"r{len(accepted)}-{len(ended)}-{s.num_waiting}", prompt,
                              SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                              priority=priority, arrival_time=len(accepted), cache_salt=salt)
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
    target(float(s.num_preemptions))
    assert ended == Counter(accepted.keys())
    for request in accepted.values():
        assert request.is_finished and request.finish_reason is not None
        check_output(request)
    assert_scheduler_empty(s)


requests_specs = st.lists(st.tuples(prompts(min_size=1), st.integers(1, 8), st.booleans()),
                          min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(specs=requests_specs, num_blocks=st.integers(4, 8), block_size=st.integers(1, 4),
       budget=st.integers(1, 16), caching=st.booleans())
def test_outputs_under_preemption_equal_outputs_without_pressure(specs, num_blocks, block_size,
                                                                 budget, caching):
    outputs = []
    for blocks in (num_blocks, 1000):
        s = make_scheduler(num_blocks=blocks, block_size=block_size,
                           max_num_batched_tokens=budget, long_prefill_token_threshold=budget,
                           enable_prefix_caching=caching)
        for i, (prompt, max_tokens, ignore_eos) in enumerate(specs):
            if cdiv(len(prompt) + max_tokens - 1, block_size) > num_blocks:
                continue
            s.add_request(Request(str(i), prompt, SamplingParams(max_tokens=max_tokens,
                                                                 ignore_eos=ignore_eos),
                                  arrival_time=i))
        outputs.append({r.request_id: r.output_token_ids for r in run_until_done(s)})
        if blocks == num_blocks:
            target(float(s.num_preemptions))
        assert_scheduler_empty(s)
    assert outputs[0] == outputs[1]
