"""`--policy fair` with no other flag (issue 34): the KV share, the chunk size and the
displacement it derives from the cache, the short prompts admitted and the tenants present."""

from __future__ import annotations

import zlib

from conftest import assert_scheduler_empty
from engine_sim import make_scheduler, model_for, run_until_done, step
from hypothesis import given, settings
from hypothesis import strategies as st

from treadle.core.lora_request import LoRARequest
from treadle.core.request import Request
from treadle.core.sampling_params import SamplingParams
from treadle.core.sched.fair import MIN_DERIVED_CHUNK, PRESENCE_SECONDS, SHORT_PROMPTS_SEEN
from treadle.core.sched.scheduler import MIN_CONTEXT_ALLOWANCE


def request(rid: str, tenant: str, prompt_len: int, max_tokens: int, t: float = 0.0) -> Request:
    # A first token of its own (crc32, not hash(): str hashes change from run to run), so no two
    # prompts share cached blocks.
    return Request(rid, [3 + zlib.crc32(rid.encode()) % 10_000] + [2] * (prompt_len - 1),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=t,
                   tenant=tenant)


def saturated(policy: str = "fair", **config):
    """A heavy tenant's six long prompts fill a 64-block cache (16-token blocks)."""
    s = make_scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=256,
                       long_prefill_token_threshold=256, policy=policy, **config)
    for i in range(6):
        s.add_request(request(f"h{i}", "heavy", 300, 64, t=i))
    model = model_for(s)
    for _ in range(12):
        step(s, model)
    return s, model


def test_one_tenant_is_never_capped_and_runs_as_fcfs():
    runs = []
    for policy in ("fcfs", "fair"):
        s = make_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=64,
                           long_prefill_token_threshold=32, policy=policy)
        for i in range(8):
            s.add_request(request(f"r{i}", "only", 40 + 7 * i, 12, t=i))
        assert s.policy.tenant_kv_cap("only") is None
        model, steps = model_for(s), []
        while s.has_unfinished_requests():
            output, _ = step(s, model)
            steps.append([(x.request.request_id, x.num_new_tokens) for x in output.scheduled])
        runs.append(steps)
    assert runs[0] == runs[1]


def test_a_tenant_may_hold_what_the_others_leave_of_their_weighted_shares():
    s = make_scheduler(num_blocks=90, block_size=4, policy="fair", tenant_weights={"b": 2.0})
    cap = s.policy.tenant_kv_cap
    s.add_request(request("a0", "a", 8, 4))
    assert cap("a") is None  # alone
    s.add_request(request("b0", "b", 8, 4))
    assert cap("a") == 88 and cap("b") == 88  # each needs 2 blocks: the other may take the rest
    s.add_request(request("b1", "b", 300, 4))  # b needs 77 blocks, more than its share of 60
    assert cap("a") == 30 and cap("b") == 88
    s.add_request(request("a1", "a", 200, 4))  # a needs 52, more than its share of 30
    assert cap("a") == 30 and cap("b") == 60
    s.add_request(request("c0", "c", 8, 4))  # c needs 2 of its 22; a and b share 88 by weight
    assert (cap("a"), cap("b"), cap("c")) == (88 // 3, 88 * 2 // 3, 90 // 4)
    run_until_done(s)
    assert not s.tenants


def test_a_request_passed_over_in_a_step_still_counts_in_its_tenant_s_demand():
    """Passing a waiting request over takes it out of its lane for the rest of the step: its
    tenant's demand, and so the other tenant's cap, must not change with that."""
    s = make_scheduler(num_blocks=100, block_size=4, policy="fair")
    s.add_request(request("h0", "heavy", 200, 4))
    s.add_request(request("l0", "light", 120, 4))
    s.waiting.refresh(0.0, None)  # a step starts
    assert s.policy.tenant_kv_cap("heavy") == 100 - 30
    passed_over = []
    while s.waiting.peek() is not None:
        passed_over.append(s.waiting.pop())
    s.policy.caps.clear()
    assert s.policy.tenant_kv_cap("heavy") == 100 - 30
    for r in passed_over:
        s.waiting.restore(r)


def test_a_heavy_tenant_beside_a_light_one_holding_little_runs_several_requests():
    """A light tenant decoding in a few blocks leaves the heavy tenant the rest of the cache: a
    fixed half ran the heavy tenant's long prompts one at a time."""
    s = make_scheduler(num_blocks=100, block_size=4, max_num_batched_tokens=512,
                       long_prefill_token_threshold=256, policy="fair")
    model = model_for(s)
    s.add_request(request("l0", "light", 8, 60, t=0))
    step(s, model)
    for i in range(4):
        s.add_request(request(f"h{i}", "heavy", 120, 4, t=1 + i))
    step(s, model)
    # The light prompt's 8 tokens' blocks, and the one its decode took in the step.
    assert s.policy.tenant_kv_cap("heavy") == 100 - 3
    assert sum(r.tenant == "heavy" for r in s.running) == 3
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_an_explicit_cap_overrides_the_derived_share():
    s = make_scheduler(num_blocks=90, block_size=4, policy="fair", max_kv_blocks_per_tenant=7)
    assert s.policy.tenant_kv_cap("a") == 7


def test_derived_cut_follows_what_short_prompts_computed_at_admission():
    s = make_scheduler(num_blocks=400, block_size=4, max_num_batched_tokens=512,
                       long_prefill_token_threshold=256, policy="fair")
    model = model_for(s)
    long = request("a0", "a", 1200, 4)
    s.add_request(long)
    s.add_request(request("b0", "b", 8, 4))
    assert s.policy.chunk_tokens(long, 256) == MIN_DERIVED_CHUNK  # no short prompt admitted yet
    step(s, model)
    assert s.policy.chunk_tokens(long, 256) == MIN_DERIVED_CHUNK  # as of the step's start
    for rid, tokens in (("b1", 100), ("b2", 90), ("b3", 120)):
        s.add_request(request(rid, "b", tokens, 4))
        step(s, model)
    # Twice the upper median of 8, 90, 100, 120, less the running decodes: a token each where
    # context is not weighed, (b + context) / b each where it is.
    decodes = [r for r in s.running if r.num_computed_tokens >= r.num_tokens - 1]
    assert decodes
    assert s.policy.derived_chunk_tokens() == 2 * 100 - len(decodes)
    s.attention_break_even = 50
    assert s.policy.derived_chunk_tokens() == int(
        2 * 100 - sum((50 + r.num_computed_tokens) / 50 for r in decodes))
    s.attention_break_even = 0
    step(s, model)  # its cut, from its start: the same decodes
    assert s.policy.chunk_tokens(long, 256) == 2 * 100 - len(decodes)
    assert s.policy.chunk_tokens(long, 40) == 40  # never above the engine's threshold
    assert s.policy.chunk_tokens(request("x", "a", 100, 4), 256) == 256  # fits one chunk
    # A prompt that hits b3's cached blocks computes only what follows them.
    prompt = request("b3", "b", 120, 4).all_token_ids
    for i in range(SHORT_PROMPTS_SEEN):
        s.add_request(Request(f"c{i}", list(prompt), SamplingParams(max_tokens=4), tenant="b"))
        step(s, model)
    assert s.policy.short_prompt_tokens[-1] < 8
    assert s.policy.chunk_tokens(long, 256) == MIN_DERIVED_CHUNK
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_derived_cut_counts_short_prompts_admitted_beside_another_tenant():
    """A short prompt admitted with no other tenant's requests (a client's one-token probe
    before anyone else comes) is not among those the cut follows; of a probe and a real prompt
    beside another tenant, the upper median is the real one."""
    s = make_scheduler(num_blocks=400, block_size=4, max_num_batched_tokens=512,
                       long_prefill_token_threshold=256, policy="fair")
    model = model_for(s)
    s.add_request(request("a-probe", "a", 1, 1))
    step(s, model)
    assert not s.policy.short_prompt_tokens  # alone
    long = request("a0", "a", 1200, 4)
    s.add_request(long)
    s.add_request(request("b-probe", "b", 1, 1))
    step(s, model)
    s.add_request(request("b0", "b", 64, 4))
    step(s, model)
    assert list(s.policy.short_prompt_tokens) == [1, 64]
    decodes = [r for r in s.running if r.num_computed_tokens >= r.num_tokens - 1]
    assert s.policy.derived_chunk_tokens() == 2 * 64 - len(decodes)
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_long_prompts_share_one_cut_per_step_while_another_tenant_is_present():
    """Three long heavy prompts beside a light request: each step computes at most one cut's
    tokens of them, the oldest first; once the light tenant has been gone PRESENCE_SECONDS,
    the heavy prompts go in whole threshold chunks again."""
    now = [0.0]
    s = make_scheduler(num_blocks=800, block_size=4, max_num_batched_tokens=256,
                       long_prefill_token_threshold=128, policy="fair", fair_chunk_tokens=32,
                       clock=lambda: now[0])
    heavy = [request(f"h{i}", "heavy", 600, 4, t=i) for i in range(3)]
    for r in heavy:
        s.add_request(r)
    s.add_request(request("l0", "light", 8, 30, t=3))
    model = model_for(s)
    order = []
    while s.tenants["light"]:
        output, _ = step(s, model)
        chunks = [x for x in output.scheduled if x.request.tenant == "heavy"
                  and x.num_computed_tokens < x.request.num_prompt_tokens]
        assert sum(x.num_new_tokens for x in chunks) <= 32
        order += [x.request.request_id for x in chunks]
    assert order == sorted(order)  # one prompt at a time, in arrival order
    output, _ = step(s, model)  # the light tenant has just left: still present
    assert max(x.num_new_tokens for x in output.scheduled) <= 32
    now[0] = PRESENCE_SECONDS + 1
    output, _ = step(s, model)
    assert sorted(x.num_new_tokens for x in output.scheduled) == [128, 128]
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_tenants_of_long_prompts_alone_do_not_cut_each_other_s():
    s = make_scheduler(num_blocks=800, block_size=4, max_num_batched_tokens=256,
                       long_prefill_token_threshold=128, policy="fair", fair_chunk_tokens=32)
    model = model_for(s)
    s.add_request(request("a0", "a", 600, 4, t=0))
    s.add_request(request("b0", "b", 600, 4, t=1))
    output, _ = step(s, model)
    assert sorted(x.num_new_tokens for x in output.scheduled) == [128, 128]
    s.add_request(request("l0", "light", 8, 4, t=2))  # a short request: the cut protects it
    output, _ = step(s, model)
    assert sum(x.num_new_tokens for x in output.scheduled
               if x.request.tenant != "light") <= 32
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_nobody_yields_to_a_head_whose_cut_a_running_prompt_takes():
    """A heavy prompt mid-prefill takes the step's cut, so the heavy head behind it would get
    no tokens: the light tenant, served more, must not sit the step out for it (it sat out
    every step of that prompt's prefill)."""
    s = make_scheduler(num_blocks=800, block_size=4, max_num_batched_tokens=256,
                       long_prefill_token_threshold=128, policy="fair", fair_chunk_tokens=32)
    model = model_for(s)
    s.add_request(request("h0", "heavy", 600, 4, t=0))
    s.add_request(request("l0", "light", 8, 30, t=1))
    step(s, model)
    s.add_request(request("h1", "heavy", 600, 4, t=2))
    s.policy.counters["light"] = s.policy.counter("heavy") + 10_000
    assert s.waiting.peek().request_id == "h1"
    output, _ = step(s, model)
    assert {x.request.request_id for x in output.scheduled} == {"h0", "l0"}
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_a_tenant_prefilling_a_long_prompt_sits_out_a_short_head_s_step():
    """A light tenant with requests decoding, at the heavy tenant's counter as its next request
    arrives (the most the lift gives it, late in the heavy prompt): the heavy tenant,
    prefilling a long prompt, sits out that request's admission step, so its first token waits
    for a step of light work only; the step after, everyone runs. Once the long prompt decodes,
    nobody sits out for a light arrival (tenants of long chat prompts would sit out each other's
    every admission)."""
    s = make_scheduler(num_blocks=800, block_size=4, max_num_batched_tokens=256,
                       long_prefill_token_threshold=128, policy="fair")
    model = model_for(s)
    for i in range(3):
        s.add_request(request(f"l{i}", "light", 8, 400, t=i))
    while any(r.num_output_tokens == 0 for r in s.running) or s.num_waiting:
        step(s, model)
    s.add_request(request("h0", "heavy", 600, 100, t=3))
    step(s, model)  # its first cut chunk
    for i in (3, 4):
        if i == 4:  # h0 decodes now
            while any(r.num_output_tokens == 0 for r in s.running):
                step(s, model)
        s.add_request(request(f"l{i}", "light", 8, 20, t=2 + i))
        s.policy.counters["light"] = s.policy.counter("heavy")  # the most the lift gives
        output, _ = step(s, model)
        scheduled = {x.request.request_id for x in output.scheduled}
        assert f"l{i}" in scheduled and ("h0" in scheduled) == (i == 4)
        output, _ = step(s, model)
        assert "h0" in {x.request.request_id for x in output.scheduled}
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_a_tenant_s_heavy_decodes_sit_out_a_step_s_worth_of_short_arrivals_not_two_in_a_row():
    """`n: 4`'s shape in small: the heavy tenant's requests decode at a context of 100 or so;
    the light tenant, one request decoding, is served more (its lift and its own outputs took
    it past the heavy counter). Weighted by context (b = 100: about 2 each), the heavy decodes
    weigh half a 16-token light prompt or more, and sit out its admission step whatever the
    counters, though not two steps in a row: with a light request arriving every step, the
    heavy tenant decodes in every other step. Two light requests arriving at once, one step's
    worth, count as one; a backlog longer than a step, or with a long prompt in it, goes by the
    counters, as does one request when the decodes weigh less (unweighted: 4 of them)."""
    s = make_scheduler(num_blocks=800, block_size=4, max_num_batched_tokens=256,
                       long_prefill_token_threshold=128, policy="fair")
    s.attention_break_even = 100
    model = model_for(s)
    for i in range(4):
        s.add_request(request(f"h{i}", "heavy", 100, 200, t=i))
    s.add_request(request("l0", "light", 8, 200, t=8))
    while any(r.num_output_tokens == 0 for r in s.running) or s.num_waiting:
        step(s, model)
    assert not s.sat_out

    def heavy_ran(*arrivals: str) -> bool:
        for rid in arrivals:
            s.add_request(request(rid, "light", 16, 2, t=20))
        s.policy.counters["light"] = s.policy.counter("heavy") + 1000
        output, _ = step(s, model)
        scheduled = {x.request.request_id for x in output.scheduled}
        assert arrivals[0] in scheduled
        return any(x.request.tenant == "heavy" for x in output.scheduled)

    assert [heavy_ran(f"l{i}") for i in range(1, 9)] == [False, True] * 4
    step(s, model)
    assert not heavy_ran("l9", "l10")
    step(s, model)
    assert heavy_ran(*(f"b{i}" for i in range(17)))  # 272 tokens: more than a step's 256
    while s.num_waiting:
        step(s, model)
    step(s, model)
    s.add_request(request("l12", "light", 16, 2, t=20))
    s.add_request(request("long", "light", 200, 2, t=21))  # 216 tokens together, one long
    s.policy.counters["light"] = s.policy.counter("heavy") + 1000
    output, _ = step(s, model)
    assert any(x.request.tenant == "heavy" for x in output.scheduled)
    while s.num_waiting:
        step(s, model)
    step(s, model)
    s.attention_break_even = 0
    assert heavy_ran("l11")
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_nobody_sits_out_for_a_short_head_waiting_for_its_adapter():
    """With one adapter at a time, a light head needing another adapter than the heavy
    tenant's long prompt cannot be admitted: the heavy tenant must not sit the step out (the
    step would be empty, the adapter never released, every step the same)."""
    s = make_scheduler(num_blocks=800, block_size=4, max_num_batched_tokens=256,
                       long_prefill_token_threshold=128, policy="fair", max_loras=1)
    model = model_for(s)
    heavy = request("h0", "heavy", 600, 4, t=0)
    heavy.lora_request = LoRARequest("a", 1, "/adapters/a")
    s.add_request(heavy)
    step(s, model)
    light = request("l0", "light", 8, 4, t=1)
    light.lora_request = LoRARequest("b", 2, "/adapters/b")
    s.add_request(light)
    s.policy.counters["light"] = s.policy.counter("heavy")
    output, _ = step(s, model)
    assert [x.request.request_id for x in output.scheduled] == ["h0"]
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_nobody_is_preempted_for_a_head_whose_cut_a_running_prompt_takes():
    """The heavy head finds no batch slot, but its tenant's running prompt takes the step's
    cut: it would get no tokens, so no light request is displaced for it."""
    s = make_scheduler(num_blocks=800, block_size=4, max_num_batched_tokens=256, max_num_seqs=3,
                       long_prefill_token_threshold=128, policy="fair", fair_chunk_tokens=32)
    model = model_for(s)
    s.add_request(request("h0", "heavy", 200, 4, t=0))
    s.add_request(request("l0", "light", 8, 200, t=1))
    s.add_request(request("l1", "light", 8, 200, t=2))
    step(s, model)
    s.add_request(request("h1", "heavy", 200, 4, t=3))
    s.policy.counters["light"] = s.policy.counter("heavy") + 10_000
    for _ in range(3):  # h0 mid-prefill: l0 and l1 decode on
        output, _ = step(s, model)
        assert not output.preempted
        assert {"l0", "l1"} <= {x.request.request_id for x in output.scheduled}
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_cuts_stop_ten_seconds_after_the_other_tenant_left_without_an_admission():
    """Presence is what the steps saw: a light tenant decoding for a long time, then gone,
    still cuts a heavy prompt that arrives a second later, not one that arrives later than
    PRESENCE_SECONDS."""
    now = [0.0]
    s = make_scheduler(num_blocks=800, block_size=4, max_num_batched_tokens=256,
                       long_prefill_token_threshold=128, policy="fair", fair_chunk_tokens=32,
                       clock=lambda: now[0])
    model = model_for(s)
    s.add_request(request("h0", "heavy", 8, 60, t=0))
    s.add_request(request("l0", "light", 8, 30, t=0))
    while s.tenants["light"]:
        now[0] += 1.0  # 30 steps of decode: no admission for 30 s
        step(s, model)
    now[0] += 1.0
    late = request("h1", "heavy", 600, 4, t=now[0])
    s.add_request(late)
    output, _ = step(s, model)
    assert {x.request.request_id: x.num_new_tokens for x in output.scheduled}["h1"] == 32
    now[0] += PRESENCE_SECONDS
    output, _ = step(s, model)
    assert {x.request.request_id: x.num_new_tokens for x in output.scheduled}["h1"] == 128
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_a_tenant_over_its_share_goes_last_in_the_step_order_whatever_the_counters():
    """The victim for blocks is the over-share tenant's newest request even when a light
    tenant's lifted counter is above its own; one preempted max_policy_preemptions times goes
    ahead of its tenant's others, still after the light tenant's."""
    s = make_scheduler(num_blocks=40, block_size=4, policy="fair")
    model = model_for(s)
    for i in range(2):
        s.add_request(request(f"h{i}", "heavy", 60, 40, t=i))
    step(s, model)
    s.add_request(request("l0", "light", 8, 40, t=5))
    step(s, model)
    s.add_request(request("l1", "light", 40, 4, t=6))  # the light tenant needs 12 blocks now
    assert s.committed_blocks("heavy") > s.policy.tenant_kv_cap("heavy")
    s.policy.counters["light"] = s.policy.counter("heavy") + 1.0  # lifted, then served a hair
    ids = [r.request_id for r in s.policy.step_order(s.running)]
    assert ids == ["l0", "h0", "h1"]
    s.running[1].num_preemptions = s.config.max_policy_preemptions  # h1: guarded
    ids = [r.request_id for r in s.policy.step_order(s.running)]
    assert ids == ["l0", "h1", "h0"]


def test_a_light_decode_that_needs_a_block_preempts_the_heavy_tenant_not_itself():
    """The heavy tenant at its share to the block, the light tenant's decode starting a block
    and its counter a hair above: the heavy tenant's newest request is the victim."""
    s = make_scheduler(num_blocks=24, block_size=4, policy="fair")
    model = model_for(s)
    s.add_request(request("l0", "light", 8, 20, t=0))
    step(s, model)
    for i in range(2):
        s.add_request(request(f"h{i}", "heavy", 40, 40, t=1 + i))
    s.policy.counters["light"] = s.policy.counter("heavy") + 1.0
    step(s, model)  # the heavy prompts: 20 blocks of the 22 left
    assert s.kv_cache_manager.num_free_blocks == 2 and s.decode_growth() == {"light": 1, "heavy": 2}
    s.policy.counters["light"] = s.policy.counter("heavy") + 1.0  # lifted, then served a hair
    output, _ = step(s, model)
    assert [r.request_id for r in output.preempted] == ["h1"]
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_a_light_request_beside_a_saturating_tenant_is_scheduled_within_a_few_steps():
    s, model = saturated()
    light = request("l0", "light", 100, 8, t=100)  # 7 blocks: more than the heavy tenant left
    assert s.kv_cache_manager.num_free_blocks < 7
    s.add_request(light)
    for _ in range(3):
        output, _ = step(s, model)
        if any(x.request is light for x in output.scheduled):
            break
    else:
        raise AssertionError("the light request waited more than 3 steps")
    assert light.num_preemptions == 0
    finished = {r.request_id for r in run_until_done(s, model)}
    assert {f"h{i}" for i in range(6)} <= finished  # every heavy request finishes
    assert_scheduler_empty(s)


def test_preemptions_for_blocks_do_not_guard_a_request_from_displacement():
    """The guard counts the policy's displacements only: heavy requests each preempted for
    blocks as often as max_policy_preemptions (`n: 4`'s samples, preempted for each other's
    growth) can still be displaced for a light request, which waited for blocks otherwise; those
    displaced as often cannot."""
    for displaced in (0, 1):
        s, model = saturated(max_policy_preemptions=1)
        for r in s.running:
            r.num_preemptions, r.num_displacements = 1, displaced
        light = request("l0", "light", 100, 8, t=100)
        s.add_request(light)
        output, _ = step(s, model)
        if displaced:
            assert light not in {x.request for x in output.scheduled} and not output.preempted
        else:
            assert light in {x.request for x in output.scheduled}
            assert [r.num_displacements for r in output.preempted] == [1]
        run_until_done(s, model)
        assert_scheduler_empty(s)


def test_under_fcfs_the_same_light_request_waits_for_the_heavy_tenant():
    s, model = saturated("fcfs")
    light = request("l0", "light", 100, 8, t=100)
    s.add_request(light)
    for _ in range(3):
        output, _ = step(s, model)
        assert all(x.request is not light for x in output.scheduled)
    run_until_done(s, model)


@settings(max_examples=60, deadline=None)
@given(arrivals=st.lists(st.tuples(st.sampled_from(["heavy", "light", "other"]),
                                   st.integers(1, 120), st.integers(1, 24)),
                         min_size=1, max_size=24),
       num_blocks=st.integers(12, 48), chunk=st.integers(4, 64), steps_between=st.integers(0, 3))
def test_derived_rules_finish_every_request_and_leak_no_block(arrivals, num_blocks, chunk,
                                                              steps_between):
    """No livelock (every request ends within the step bound) and no leak, whatever the tenants
    and the cache's size, with the derived share, chunks and displacement."""
    s = make_scheduler(num_blocks=num_blocks, block_size=8, max_num_batched_tokens=chunk,
                       long_prefill_token_threshold=chunk, policy="fair", max_model_len=512)
    model = model_for(s)
    for i, (tenant, prompt_len, max_tokens) in enumerate(arrivals):
        if -(-(prompt_len + max_tokens - 1) // 8) > num_blocks:
            continue
        s.add_request(request(f"r{i}", tenant, prompt_len, max_tokens, t=i))
        for _ in range(steps_between):
            step(s, model)
    run_until_done(s, model, max_steps=5_000)
    assert not s.tenants
    assert_scheduler_empty(s)


def test_a_newly_backlogged_tenant_is_lifted_to_the_service_the_others_received():
    """The heavy tenant was charged its whole prompts at admission and has computed a quarter
    of each: a light tenant arriving is lifted to the heavy counter less the part not yet
    computed (by the heavy tenant's weight), whether the heavy tenant has a request waiting or
    was only the last one admitted (then to the least of that and the counter the queue last
    served at)."""
    for weight in (1.0, 2.0):
        s = make_scheduler(num_blocks=400, block_size=4, max_num_batched_tokens=100,
                           long_prefill_token_threshold=100, policy="fair",
                           tenant_weights={"heavy": weight})
        s.add_request(request("h0", "heavy", 400, 4, t=0))
        step(s, model_for(s))  # h0 admitted: charged 400, 100 computed
        s.add_request(request("h1", "heavy", 400, 4, t=1))  # waits: the step's budget is h0's
        s.add_request(request("l0", "light", 8, 4, t=2))
        assert s.policy.counter("light") == (400 - 300) / weight
        assert s.waiting.peek().request_id == "l0"

    s = make_scheduler(num_blocks=400, block_size=4, max_num_batched_tokens=200,
                       long_prefill_token_threshold=100, policy="fair")
    s.add_request(request("h0", "heavy", 400, 4, t=0))
    s.add_request(request("h1", "heavy", 400, 4, t=1))
    step(s, model_for(s))  # both admitted (h1 served at counter 400), 100 computed each
    assert s.num_waiting == 0 and s.policy.counter("heavy") == 800
    s.add_request(request("l0", "light", 8, 4, t=2))
    assert s.policy.counter("light") == 800 - 2 * 300

    s = make_scheduler(num_blocks=400, block_size=4, max_num_batched_tokens=400,
                       long_prefill_token_threshold=400, policy="fair")
    s.add_request(request("h0", "heavy", 400, 4, t=0))
    step(s, model_for(s))  # admitted at counter 0, its prompt computed: 400 received
    s.add_request(request("l0", "light", 8, 4, t=2))
    assert s.policy.counter("light") == 0  # the counter the queue served at is less


def test_a_light_tenant_decoding_stays_below_a_heavy_one_prefilling_and_gets_short_steps():
    """Issue 34's shape in small: heavy long prompts keep the cache full with one waiting, a
    light tenant's requests come one at a time while its earlier ones decode. The light
    tenant's outputs must not carry its counter past the heavy tenant's prepaid prompts: while
    a heavy prompt is mid-prefill, every light admission step holds no heavy work. (Lifted to
    the heavy counter itself, the light tenant passed it after a few outputs; its requests
    were then admitted beside the heavy chunks and decodes.)"""
    s = make_scheduler(num_blocks=120, block_size=16, max_num_batched_tokens=256,
                       long_prefill_token_threshold=64, policy="fair")
    model = model_for(s)
    for i in range(4):
        s.add_request(request(f"h{i}", "heavy", 600, 64, t=i))
    admissions = mixed = 0
    for n in range(200):
        if n % 6 == 0 and n < 150:
            s.add_request(request(f"l{n}", "light", 16, 24, t=10 + n))
        prefilling = any(r.tenant == "heavy" and r.num_computed_tokens < r.num_prompt_tokens
                         for r in s.running)
        output, _ = step(s, model)
        if prefilling and any(x.request.tenant == "light" and x.num_computed_tokens == 0
                              for x in output.scheduled):
            admissions += 1
            mixed += any(x.request.tenant == "heavy" for x in output.scheduled)
    assert admissions >= 10 and mixed == 0
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_a_cut_chunk_sits_out_a_step_admitting_another_tenant_s_short_prompt():
    """Two heavy tenants prefill long prompts (cut while the light tenant is present); the light
    tenant, served more than both (no yield rule applies to it), sends a short request. Its
    admission step holds no heavy chunk, whatever the counters: its first token waits for that
    step alone. A held prompt is not held again until it has had a chunk, so with a short
    request every step (the one-chunk cut going to one prompt a step) neither long prompt
    stalls: each gets a chunk at least every third step."""
    s = make_scheduler(num_blocks=800, block_size=4, max_num_batched_tokens=256,
                       long_prefill_token_threshold=128, policy="fair")
    model = model_for(s)
    s.add_request(request("l0", "light", 8, 400, t=0))
    step(s, model)
    s.add_request(request("h0", "heavy", 1200, 20, t=1))
    s.add_request(request("g0", "heavy2", 1200, 20, t=1))
    while s.num_waiting:  # both admitted (the step's cut goes to one of them at a time)
        step(s, model)
    heavy = [r for r in s.running if r.tenant != "light"]
    assert all(s.policy.chunk_tokens(r, 128) < 128 for r in heavy)  # cut
    last_chunk = {r.request_id: 0 for r in heavy}
    for i in range(1, 19):
        s.add_request(request(f"l{i}", "light", 8, 4, t=1 + i))
        s.policy.counters["light"] = max(s.policy.counters.values()) + 1000
        output, _ = step(s, model)
        admitted = {x.request.request_id for x in output.scheduled if x.num_computed_tokens == 0}
        assert f"l{i}" in admitted
        chunks = {x.request.request_id for x in output.scheduled
                  if x.request.tenant != "light" and x.num_new_tokens > 1}
        if i == 1:
            assert not chunks
        for rid in chunks:
            last_chunk[rid] = i
        assert all(i - last <= 3 for last in last_chunk.values())
    assert all(r.num_computed_tokens < r.num_prompt_tokens for r in heavy)  # still cut
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_long_prompts_share_a_step_s_budget_weighted_by_their_context():
    """Alone (no cut), the step's long prompts compute at most the token budget, each chunk's
    tokens counting (b + its first context) / b, b the context at which a token's attention
    costs its matmuls: a step late in long prompts costs about a full step at their start, so
    a newcomer's first request does not wait behind a step of seconds. The budget is used up
    but for less than a later prompt's least chunk (work conserving), and fcfs does not weigh
    context."""
    b, budget = 1000, 512
    for policy in ("fair", "fcfs"):
        s = make_scheduler(num_blocks=2000, block_size=16, max_num_batched_tokens=budget,
                           long_prefill_token_threshold=256, policy=policy, max_model_len=8192)
        s.attention_break_even = b
        model = model_for(s)
        for rid in ("a", "b"):
            s.add_request(request(rid, "heavy", 6000, 4))
        deep = 0
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running) \
                or s.num_waiting:
            output, _ = step(s, model)
            chunks = [(x.num_computed_tokens, x.num_new_tokens) for x in output.scheduled
                      if x.num_new_tokens > 1]
            if policy == "fcfs":
                assert all(n == 256 or c + n == 6000 for c, n in chunks)  # or a prompt's tail
                continue
            weighted = sum(n * (b + c) / b for c, n in chunks)
            assert weighted <= budget + 1e-9
            if len(s.running) == 2 and all(c + n < 6000 for c, n in chunks):
                heaviest = max((b + r.num_computed_tokens) / b for r in s.running)
                assert budget - weighted < MIN_CONTEXT_ALLOWANCE * heaviest
                deep += chunks[0][0] > 3000
        if policy == "fair":
            assert deep > 5  # the rule met contexts where a full step would cost 4x
        run_until_done(s, model)
        assert_scheduler_empty(s)


def test_a_long_prompt_admitted_on_a_cached_prefix_is_weighed_from_the_prefix_s_end():
    """A long prompt whose first 2,992 tokens are cached starts computing at that context: the
    step's weighted budget gives it 512 / 3.992 tokens, not a chunk priced at context 0."""
    s = make_scheduler(num_blocks=2000, block_size=16, max_num_batched_tokens=512,
                       long_prefill_token_threshold=256, policy="fair", max_model_len=8192)
    s.attention_break_even = 1000
    model = model_for(s)
    prefix = [7] + [2] * 2999
    s.add_request(Request("p", prefix, SamplingParams(max_tokens=1, ignore_eos=True),
                          tenant="heavy"))
    run_until_done(s, model)
    s.add_request(Request("q", prefix + [5] * 400, SamplingParams(max_tokens=1, ignore_eos=True),
                          tenant="heavy"))
    output, _ = step(s, model)
    [chunk] = output.scheduled
    assert (chunk.num_computed_tokens, chunk.num_new_tokens) == (2992, 512 * 1000 // 3992)
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_requests_sharing_a_cached_prompt_count_its_blocks_once_against_their_share():
    """`n: 4`'s siblings share their prompt's blocks: the tenant holds them once. Counted per
    request, the heavy tenant below held four copies of its 38-block prompt in a 100-block
    cache, and its siblings waited behind its share while the light tenant was present."""
    s = make_scheduler(num_blocks=100, block_size=16, max_num_batched_tokens=512,
                       long_prefill_token_threshold=256, policy="fair")
    model = model_for(s)
    prompt = [7] + [2] * 599  # 38 blocks
    s.add_request(request("l0", "light", 16, 200))
    s.add_request(Request("h0", prompt, SamplingParams(max_tokens=60, ignore_eos=True),
                          tenant="heavy"))
    while s.requests["h0"].num_computed_tokens < len(prompt):
        step(s, model)
    for i in range(1, 4):
        s.add_request(Request(f"h{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True),
                              tenant="heavy"))
    for _ in range(4):  # the siblings' last prompt tokens share the step's cut
        step(s, model)
    heavy = [r for r in s.running if r.tenant == "heavy"]
    assert len(heavy) == 4
    tables = s.kv_cache_manager.block_tables
    distinct = {block.block_id for r in heavy for block in tables[r.request_id]}
    to_finish = sum(s._blocks_to_finish(r) for r in heavy)
    assert s.committed_blocks("heavy") == len(distinct) + to_finish < 2 * 38
    run_until_done(s, model)
    assert_scheduler_empty(s)


def test_a_light_request_is_not_preempted_for_a_tenant_growing_past_its_share():
    """`n: 4`-like: a heavy tenant's samples share their prompts and decode, taking a block
    each now and then; it is admitted up to its share, so its decodes take it past the share
    within a step. The victims for those blocks are its own: the light tenant's requests,
    last by their lifted counters, were preempted for the heavy tenant's growth."""
    s = make_scheduler(num_blocks=100, block_size=4, max_num_batched_tokens=128,
                       long_prefill_token_threshold=64, policy="fair")
    model = model_for(s)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for g in range(4):
        prompt = [50 + g] + [2] * 39
        for i in range(4):
            s.add_request(Request(f"h{g}/{i}", prompt, params, arrival_time=g, tenant="heavy"))
    lights = []
    for n in range(200):
        if n % 3 == 0 and len(lights) < 30:
            lights.append(request(f"l{len(lights)}", "light", 8, 8, t=10 + n))
            s.add_request(lights[-1])
        step(s, model)
    run_until_done(s, model)
    assert s.num_preemptions > 0  # the cache binds: the heavy tenant's growth preempted some
    assert [r.request_id for r in lights if r.num_preemptions] == []
    assert_scheduler_empty(s)
