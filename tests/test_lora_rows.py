"""LoRA adapters in the engine's census, the timelines, explain and the dashboard (issue 37's
rows): the census's per-adapter counts on a real engine over a tiny random model with two random
PEFT adapters, checked against the scheduler's queues step by step; the steps a request waited
for a LoRA slot (--max-loras); and through a real server, the adapter on a request's timeline,
its explain and the dashboard feed's adapters table."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import assert_engine_empty
from model_utils import save_random_adapter

from treadle.core.engine_process import take_census
from treadle.core.lora_request import LoRARequest
from treadle.core.sampling_params import SamplingParams

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def adapters(tiny_folder, tmp_path_factory) -> dict[str, str]:
    """Two random adapters over tiny_folder's model, by name: their folders."""
    folder = tmp_path_factory.mktemp("adapters")
    return {name: str(save_random_adapter(tiny_folder, folder / name, seed))
            for seed, name in enumerate("ab")}


def test_census_counts_each_adapters_requests_and_tokens(tiny_folder, adapters):
    from treadle.llm import LLM

    llm = LLM(str(tiny_folder), dtype="float32", enable_lora=True, max_loras=1,
              kv_cache_memory_bytes=16 << 20)
    engine = llm.engine
    loras = {name: LoRARequest(name, i + 1, path)
             for i, (name, path) in enumerate(adapters.items())}
    # (id, tenant, adapter): with one adapter at a time, b's requests wait while a's run.
    plan = [("a0", "t1", "a"), ("b0", "t1", "b"), ("a1", "t2", "a"), ("base", "t2", None),
            ("b1", "t2", "b")]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, (request_id, tenant, name) in enumerate(plan):
        engine.add_request(request_id, [5, 6, 7, 8 + i], params, tenant=tenant,
                           lora_request=None if name is None else loras[name])
    requests = dict(engine.scheduler.requests)
    # Steps each request stayed waiting through: blocks, token budget and batch slots are
    # plenty here, so the cap was the only thing holding one back.
    cap_steps: Counter[str] = Counter()
    while engine.has_unfinished_requests():
        waiting = {r.request_id for r in engine.scheduler.waiting}
        engine.step()
        cap_steps.update(waiting & {r.request_id for r in engine.scheduler.waiting})
        census = take_census(engine)
        for rows, queue in ((census.lora_waiting, engine.scheduler.waiting),
                            (census.lora_running, engine.scheduler.running)):
            ids = {r.request_id for r in queue}
            expected = Counter((tenant, name) for request_id, tenant, name in plan
                               if name is not None and request_id in ids)
            assert rows == tuple((t, n, c) for (t, n), c in sorted(expected.items()))
    assert engine.scheduler.num_preemptions == 0
    assert set(cap_steps) == {"b0", "b1"}, cap_steps  # the plan did make b wait
    for request_id, request in requests.items():
        assert request.stats.lora_cap_steps == cap_steps[request_id], request_id
    # Each request: its prompt less its prefix hit, then a decode token per output but the first.
    tokens: Counter[tuple[str, str]] = Counter()
    for request_id, tenant, name in plan:
        request = requests[request_id]
        if name is not None:
            tokens[tenant, name] += (request.num_prompt_tokens - request.num_cached_tokens
                                     + MAX_TOKENS - 1)
    census = take_census(engine)
    assert census.scheduled_tokens_by_lora == tuple(
        (t, n, c) for (t, n), c in sorted(tokens.items()))
    assert census.lora_waiting == census.lora_running == ()
    assert_engine_empty(engine)
