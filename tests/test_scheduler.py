"""Scheduler: budget, chunked prefill, admission, preemption, policies, prefix caching."""

from __future__ import annotations

import zlib

import pytest
from conftest import assert_scheduler_empty
from engine_sim import (
    EOS,
    make_scheduler,
    model_for,
    reference_output,
    run_until_done,
    step,
)

from treadle.core.request import Request, RequestStatus
from treadle.core.sampling_params import SamplingParams
from treadle.core.sched.fair import FairPolicy
from treadle.core.sched.fcfs import FCFSPolicy
from treadle.core.sched.priority import PriorityPolicy
from treadle.core.sched.scheduler import MAX_SKIPS, Scheduler


def req(request_id: str, prompt: list[int] | int, max_tokens: int = 8, *, arrival: float = 0.0,
        priority: int = 0, tenant: str = "default", **params: object) -> Request:
    """`prompt` as a length: tokens of the request's own, so prompts share no prefix."""
    first = 100 + zlib.crc32(request_id.encode())
    tokens = [first, *range(1, prompt)] if isinstance(prompt, int) else prompt
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, **params),
                   priority=priority, arrival_time=arrival, tenant=tenant)


def scheduled_tokens(output) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in output.scheduled}


def check_outputs(finished: list[Request]) -> None:
    for request in finished:
        expected = reference_output(request.prompt_token_ids, request.sampling_params)
        assert request.output_token_ids == expected, request


def test_sampling_params_validation():
    SamplingParams(temperature=0, top_p=1, top_k=1, min_tokens=16)
    for bad, field in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
                       ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                       ({"top_k": 0}, "top_k"), ({"min_tokens": -1}, "min_tokens"),
                       ({"min_tokens": 17}, "min_tokens"), ({"n": 0}, "n")]:
        with pytest.raises(ValueError, match=f"^{field} must be"):
            SamplingParams(**bad)


def test_request_tokens_live_in_one_list():
    r = req("a", [5, 6, 7])
    r.append_output_token(9)
    assert (r.prompt_token_ids, r.output_token_ids, r.all_token_ids) == ([5, 6, 7], [9],
                                                                         [5, 6, 7, 9])
    assert (r.num_prompt_tokens, r.num_output_tokens, r.num_tokens) == (3, 1, 4)
    assert r.finish_reason is None and not r.is_finished
    r.status = RequestStatus.FINISHED_LENGTH
    assert r.is_finished and r.finish_reason == "length"


def test_add_request_refuses_what_can_never_run():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="at least one token"):
        s.add_request(req("empty", []))
    with pytest.raises(ValueError, match=r"prompt \(30 tokens\) \+ max_tokens \(3\) = 33 exceeds "
                                         r"max_model_len \(32\)"):
        s.add_request(req("long", 30, max_tokens=3))
    with pytest.raises(ValueError, match="needs 5 KV cache blocks of 4 tokens; the whole cache "
                                         "has 4"):
        s.add_request(req("big", 16, max_tokens=2))
    s.add_request(req("fits", 16, max_tokens=1))  # the last token never enters the cache
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("fits", 3))
    assert s.num_waiting == 1 and list(s.requests) == ["fits"]


def test_budget_holds_and_decodes_go_before_prefills():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=10)
    model = model_for(s)
    s.add_request(req("a", 4, arrival=0))
    step(s, model)
    s.add_request(req("b", 20, arrival=1))
    s.add_request(req("c", 20, arrival=2))
    output, _ = step(s, model)
    assert [x.request.request_id for x in output.scheduled] == ["a", "b"]
    assert scheduled_tokens(output) == {"a": 1, "b": 9}
    assert output.num_batched_tokens == 10
    assert output.scheduled[0].produces_token and not output.scheduled[1].produces_token
    output, _ = step(s, model)
    assert scheduled_tokens(output) == {"a": 1, "b": 9}  # b's chunk goes before c, a waiter
    output, _ = step(s, model)
    assert scheduled_tokens(output) == {"a": 1, "b": 2, "c": 7}
    check_outputs(run_until_done(s, model))
    assert_scheduler_empty(s)


def test_long_prefill_is_chunked_by_the_threshold():
    s = make_scheduler(num_blocks=64, block_size=4, long_prefill_token_threshold=32)
    model = model_for(s)
    s.add_request(req("long", 100, arrival=0))
    s.add_request(req("short", 5, arrival=1))
    chunks = []
    for _ in range(4):
        output, _ = step(s, model)
        chunks.append((scheduled_tokens(output)["long"], output.scheduled[0].produces_token))
    assert chunks == [(32, False), (32, False), (32, False), (4, True)]
    assert s.requests["long"].num_output_tokens == 1
    check_outputs(run_until_done(s, model))


def test_max_num_seqs():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2)
    model = model_for(s)
    for i in range(5):
        s.add_request(req(str(i), 3, arrival=i))
    output, _ = step(s, model)
    assert list(scheduled_tokens(output)) == ["0", "1"]
    assert (s.num_running, s.num_waiting) == (2, 3)
    check_outputs(run_until_done(s, model))
    assert_scheduler_empty(s)


def test_fcfs_preempts_the_newest_and_requeues_it_at_the_front():
    s = make_scheduler(num_blocks=4, block_size=2)
    model = model_for(s)
    s.add_request(req("a", 3, max_tokens=6, arrival=0, ignore_eos=True))
    s.add_request(req("b", 3, max_tokens=6, arrival=1, ignore_eos=True))
    step(s, model)
    s.add_request(req("c", 1, arrival=2, ignore_eos=True))
    output, _ = step(s, model)  # a, b decode into their second block; no room for c
    assert list(scheduled_tokens(output)) == ["a", "b"]
    output, _ = step(s, model)  # a needs a third block
    assert output.preempted == [s.requests["b"]]
    assert list(scheduled_tokens(output)) == ["a"]  # nobody is admitted after a preemption
    b = s.requests["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert s.num_preemptions == 1
    check_outputs(run_until_done(s, model))
    assert_scheduler_empty(s)


def test_a_request_preempts_itself_when_it_sorts_last():
    s = make_scheduler(num_blocks=5, block_size=2)
    model = model_for(s)
    s.add_request(req("a", 3, max_tokens=6, arrival=0, ignore_eos=True))
    s.add_request(req("b", 3, max_tokens=6, arrival=1, ignore_eos=True))
    step(s, model)
    step(s, model)
    output, _ = step(s, model)  # a takes the last free block; b would need one more
    assert [r.request_id for r in output.preempted] == ["b"]
    assert list(scheduled_tokens(output)) == ["a"]
    check_outputs(run_until_done(s, model))


@pytest.mark.parametrize("policy, victim", [(FCFSPolicy(), "z"), (PriorityPolicy(), "x"),
                                            (FairPolicy(), "y")])
def test_victim_by_policy(policy, victim):
    # Fair share (its cache share lifted so all three run): tenant a (x, y) has been served more
    # than b (z); its newest goes.
    s = make_scheduler(num_blocks=6, block_size=2, policy=policy, max_kv_blocks_per_tenant=6)
    model = model_for(s)
    s.add_request(req("x", 3, arrival=0, priority=2, ignore_eos=True, tenant="a"))
    s.add_request(req("y", 3, arrival=1, priority=0, ignore_eos=True, tenant="a"))
    s.add_request(req("z", 3, arrival=2, priority=1, ignore_eos=True, tenant="b"))
    step(s, model)
    step(s, model)
    output, _ = step(s, model)
    assert [r.request_id for r in output.preempted] == [victim]
    check_outputs(run_until_done(s, model))
    assert_scheduler_empty(s)


def test_priority_orders_the_waiting_queue():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2, policy=PriorityPolicy())
    for name, priority, arrival in [("low", 2, 0), ("high_late", 0, 3), ("mid", 1, 1),
                                    ("high", 0, 2)]:
        s.add_request(req(name, 3, arrival=arrival, priority=priority))
    assert [r.request_id for r in s.waiting] == ["high", "high_late", "mid", "low"]
    output, _ = step(s, model_for(s))
    assert list(scheduled_tokens(output)) == ["high", "high_late"]


def test_priority_newest_is_preempted_among_equals():
    s = make_scheduler(num_blocks=4, block_size=2, policy=PriorityPolicy())
    model = model_for(s)
    s.add_request(req("old", 3, max_tokens=6, arrival=0, priority=1, ignore_eos=True))
    s.add_request(req("new", 3, max_tokens=6, arrival=1, priority=1, ignore_eos=True))
    step(s, model)
    step(s, model)
    output, _ = step(s, model)
    assert [r.request_id for r in output.preempted] == ["new"]


def test_no_head_of_line_blocking():
    s = make_scheduler(num_blocks=8, block_size=2)
    model = model_for(s)
    s.add_request(req("running", 8, max_tokens=4, arrival=0))
    step(s, model)  # holds 4 of 8 blocks (and grows)
    s.add_request(req("big", 12, max_tokens=2, arrival=1))
    s.add_request(req("small", 2, max_tokens=2, arrival=2))
    output, _ = step(s, model)
    assert list(scheduled_tokens(output)) == ["running", "small"]
    assert s.requests["big"].num_skips == 1
    check_outputs(run_until_done(s, model))
    assert_scheduler_empty(s)


def test_a_prompt_is_admitted_only_when_its_whole_prompt_fits_beside_running_prompts():
    # 20 blocks of 4 tokens, chunks of 16: two 48-token prompts need 12 blocks each. Admitted on
    # their first chunks, both would grow mid-prefill until one was preempted and computed again.
    s = make_scheduler(num_blocks=20, block_size=4, long_prefill_token_threshold=16)
    model = model_for(s)
    s.add_request(req("a", 48, max_tokens=4, arrival=0, ignore_eos=True))
    s.add_request(req("b", 48, max_tokens=4, arrival=1, ignore_eos=True))
    s.add_request(req("c", 4, max_tokens=4, arrival=2, ignore_eos=True))
    output, _ = step(s, model)
    # a's 12 blocks are reserved from its first chunk on: b waits; the short c goes around it.
    assert scheduled_tokens(output) == {"a": 16, "c": 4}
    assert s.requests["b"].num_skips == 1
    computed = 20
    finished = []
    while s.has_unfinished_requests():
        output, done = step(s, model)
        assert not output.preempted
        computed += output.num_batched_tokens
        finished += done
    # Every prompt token once; each request's outputs but the last go back in as decodes.
    assert computed == 48 + 48 + 4 + 3 * 3
    check_outputs(finished)
    assert_scheduler_empty(s)


def test_nobody_is_displaced_for_a_head_that_would_not_fit_even_so():
    s = make_scheduler(num_blocks=20, block_size=4, policy=PriorityPolicy())
    model = model_for(s)
    s.add_request(req("low", 8, max_tokens=30, priority=1, ignore_eos=True))
    s.add_request(req("high0", 40, max_tokens=30, priority=0, ignore_eos=True))
    step(s, model)
    s.add_request(req("high1", 60, max_tokens=2, priority=0, arrival=1, ignore_eos=True))
    # 7 blocks free; preempting "low" would free 3, and high1's prompt needs 15.
    output, _ = step(s, model)
    assert not output.preempted and s.requests["low"].num_preemptions == 0
    check_outputs(run_until_done(s, model))
    assert_scheduler_empty(s)


def run_big_among_small_arrivals(steps: int) -> tuple[int | None, int]:
    """Two small requests arrive every step, enough to keep the cache too full for a big one.
    Returns the step at which the big one started (None: not within `steps`) and how many small
    ones were admitted while it waited."""
    s = make_scheduler(num_blocks=8, block_size=4)
    model = model_for(s)
    arrivals = iter(range(10_000))

    def add_small() -> None:
        i = next(arrivals)
        s.add_request(req(f"small{i}", 4, max_tokens=2, arrival=i, ignore_eos=True))

    add_small()
    add_small()
    step(s, model)
    s.add_request(req("big", 24, max_tokens=4, arrival=next(arrivals), ignore_eos=True))
    big = s.requests["big"]
    started, admitted_while_big_waited = None, 0
    for i in range(steps):
        add_small()
        add_small()
        output, _ = step(s, model)
        if big.status is RequestStatus.RUNNING:
            started = i
            break
        admitted_while_big_waited += sum(x.num_computed_tokens == 0 for x in output.scheduled)
    check_outputs(run_until_done(s, model))
    assert_scheduler_empty(s)
    return started, admitted_while_big_waited


def test_a_skipped_request_reserves_the_queue_and_is_not_starved():
    started, admitted_while_big_waited = run_big_among_small_arrivals(steps=100)
    assert started is not None and started <= MAX_SKIPS + 2
    assert admitted_while_big_waited >= MAX_SKIPS  # smaller ones went around it meanwhile


def test_without_the_reservation_the_big_request_would_starve(monkeypatch):
    monkeypatch.setattr("treadle.core.sched.scheduler.MAX_SKIPS", 10**9)
    assert run_big_among_small_arrivals(steps=100)[0] is None


def test_shared_prefix_is_computed_once():
    prefix = [(7 * i) % 31 + 1 for i in range(200)]
    a = req("a", prefix + [1, 2, 3, 4, 5], ignore_eos=True)
    b = req("b", prefix + [9, 8, 7, 6, 5], ignore_eos=True)
    outputs = {}
    for caching in (True, False):
        s = make_scheduler(num_blocks=128, block_size=8, enable_prefix_caching=caching)
        model = model_for(s)
        for r in (a, b):
            s.add_request(req(r.request_id, r.prompt_token_ids, ignore_eos=True))
        output, _ = step(s, model)
        outputs[caching] = {r.request_id: r.output_token_ids for r in run_until_done(s, model)}
        assert_scheduler_empty(s)
        if caching:
            assert scheduled_tokens(output) == {"a": 205, "b": 5}
            kv = s.kv_cache_manager
            assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (410, 200)
            assert output.scheduled[1].block_ids[:25] == output.scheduled[0].block_ids[:25]
            assert output.scheduled[1].request.num_cached_tokens == 200
        else:
            assert scheduled_tokens(output) == {"a": 205, "b": 205}
    assert outputs[True] == outputs[False]
    assert outputs[True]["a"] == reference_output(a.prompt_token_ids, a.sampling_params)


def test_prefix_hit_after_the_first_request_finished():
    s = make_scheduler(num_blocks=64, block_size=8)
    model = model_for(s)
    prefix = list(range(1, 201))
    s.add_request(req("a", prefix + [1], max_tokens=2, ignore_eos=True))
    run_until_done(s, model)
    s.add_request(req("b", prefix + [2, 3], max_tokens=2, ignore_eos=True))
    output, _ = step(s, model)
    assert scheduled_tokens(output) == {"b": 2}
    check_outputs(run_until_done(s, model))
    assert_scheduler_empty(s)


def test_repeated_preemption_keeps_outputs():
    s = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=8,
                       long_prefill_token_threshold=4)
    for i in range(8):
        s.add_request(req(str(i), [i + 1, 2 * i + 3, 5], max_tokens=8, arrival=i,
                          ignore_eos=True))
    finished = run_until_done(s)
    assert s.num_preemptions >= 10
    assert len(finished) == 8
    check_outputs(finished)
    assert_scheduler_empty(s)


def drive(s: Scheduler, request: Request, tokens: list[int]) -> list[bool]:
    """Feed chosen sampled tokens; returns whether the request was finished after each."""
    s.add_request(request)
    done = []
    for token in tokens:
        output = s.schedule()
        s.update_from_output(output, {request.request_id: token})
        done.append(request.is_finished)
    return done


def test_stop_conditions():
    s = make_scheduler(num_blocks=16, block_size=4)
    r = req("eos", 2, max_tokens=5, min_tokens=2)
    assert drive(s, r, [EOS, EOS]) == [False, True]
    assert (r.finish_reason, r.output_token_ids) == ("stop", [EOS, EOS])
    r = req("stop_id", 2, max_tokens=5, stop_token_ids=[7])
    assert drive(s, r, [3, 7]) == [False, True] and r.finish_reason == "stop"
    r = req("ignore", 2, max_tokens=3, ignore_eos=True)
    assert drive(s, r, [EOS, EOS, EOS]) == [False, False, True]
    assert r.finish_reason == "length" and r.status is RequestStatus.FINISHED_LENGTH
    assert_scheduler_empty(s)


def test_abort_and_finish_from_any_state_exactly_once():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=1)
    model = model_for(s)
    s.add_request(req("running", 5, arrival=0))
    s.add_request(req("waiting", 5, arrival=1))
    output, _ = step(s, model)
    waiting = s.abort_request("waiting")
    assert waiting is not None and waiting.finish_reason == "abort"
    assert s.abort_request("waiting") is None
    assert s.abort_request("unknown") is None
    s.check_invariants()
    output = s.schedule()
    errored = s.finish_request("running", RequestStatus.FINISHED_ERROR)  # while the step runs
    assert errored is not None and errored.finish_reason == "error"
    assert s.update_from_output(output, model.execute(output)) == []
    assert errored.num_output_tokens == 1
    with pytest.raises(ValueError, match="not a finished status"):
        s.finish_request("x", RequestStatus.RUNNING)
    assert_scheduler_empty(s)
