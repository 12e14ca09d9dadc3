"""EngineCore on a tiny random-weight model: scheduling, preemption, prefix caching and aborts
must never change what greedy decoding produces, and must leave the cache empty."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_engine_empty
from model_utils import build_tiny_model, greedy_decode, make_runner

from treadle.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from treadle.core.engine_core import EngineCore
from treadle.core.messages import EngineCoreOutput
from treadle.core.sampling_params import SamplingParams

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model("llama", folder)
    return folder


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=gen).tolist()
            for n in (5, 40, 17, 63, 8, 29, 50, 12)]


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    """Greedy tokens from the runner alone: no scheduler, no cache manager."""
    return greedy_decode(make_runner(tiny_model), prompts, MAX_TOKENS)


def make_engine(folder, num_blocks=256, block_size=4, prefix_caching=True,
                **scheduler) -> EngineCore:
    return EngineCore(EngineConfig(ModelConfig(model=str(folder), dtype="float32"),
                                   CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                               enable_prefix_caching=prefix_caching,
                                               kv_cache_dtype="float32"),
                                   SchedulerConfig(**scheduler)))


def run(engine: EngineCore, prompts, params=None, ids=None) -> dict[str, list[int]]:
    params = params or SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = ids or [str(i) for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return {i: tokens[i] for i in ids}


def test_engine_greedy_equals_runner_reference(tiny_model, prompts, reference):
    engine = make_engine(tiny_model, max_num_batched_tokens=32, long_prefill_token_threshold=16)
    tokens = run(engine, prompts)
    assert [tokens[str(i)] for i in range(len(prompts))] == reference
    assert_engine_empty(engine)


def test_preemption_again_and_again_keeps_outputs(tiny_model, prompts, reference):
    # 24 blocks of 4 tokens: barely two of the longest requests at once.
    engine = make_engine(tiny_model, num_blocks=24, max_num_batched_tokens=64)
    tokens = run(engine, prompts)
    assert engine.scheduler.num_preemptions >= 5
    assert [tokens[str(i)] for i in range(len(prompts))] == reference
    assert_engine_empty(engine)


def test_shared_prefix_is_computed_once(tiny_model):
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, 256, (200,), generator=gen).tolist()
    first, second = prefix + [7, 8, 9], prefix + [10, 11, 12, 13]
    uncached = run(make_engine(tiny_model, block_size=16, prefix_caching=False),
                   [first, second])

    engine = make_engine(tiny_model, block_size=16, max_num_batched_tokens=512,
                         long_prefill_token_threshold=512)
    kv = engine.kv_cache_manager
    assert run(engine, [first], ids=["0"]) == {"0": uncached["0"]}
    queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
    assert run(engine, [second], ids=["1"]) == {"1": uncached["1"]}
    assert kv.prefix_cache_hits - hits == 192  # 12 full blocks of 16 of the 200 shared tokens
    assert kv.prefix_cache_queries - queries == len(second)
    assert_engine_empty(engine)


def test_abort_frees_blocks_and_others_finish(tiny_model, prompts, reference):
    engine = make_engine(tiny_model)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {"0": [], "1": [], "2": []}
    for _ in range(4):
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert engine.kv_cache_manager.num_used_blocks > 0
    assert engine.abort_request("1")
    assert not engine.abort_request("1")  # ends exactly once
    finished: list[EngineCoreOutput] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "1"
            tokens[out.request_id].extend(out.new_token_ids)
            finished += [out] if out.finished else []
    assert tokens["0"] == reference[0] and tokens["2"] == reference[2]
    assert {o.finish_reason for o in finished} == {"length"}
    assert_engine_empty(engine)


def test_stop_on_eos_and_stop_token(tiny_model, prompts, reference):
    engine = make_engine(tiny_model)
    target = reference[1][5]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[target])
    finish = {}
    engine.add_request("a", prompts[1], params)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            finish[out.request_id] = out.finish_reason
    assert tokens == reference[1][:reference[1].index(target) + 1]
    assert finish == {"a": "stop"}
    assert_engine_empty(engine)


def test_requests_that_can_never_run_are_refused_at_once(tiny_model):
    engine = make_engine(tiny_model, num_blocks=8)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [5] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="blocks"):
        engine.add_request("big", [5] * 40, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("bad", [5, 999], SamplingParams(max_tokens=1))
    assert not engine.has_unfinished_requests()
    assert_engine_empty(engine)


def test_seeded_sampling_is_independent_of_the_batch(tiny_model, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11, ignore_eos=True)
    alone = run(make_engine(tiny_model), [prompts[2]], params, ids=["x"])["x"]
    engine = make_engine(tiny_model)
    others = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"o{i}", prompt, others)
    assert run(engine, [prompts[2]], params, ids=["x"])["x"] == alone
    assert_engine_empty(engine)


def test_a_request_that_breaks_the_model_fails_alone(tiny_model, prompts, reference):
    """Fault injection at the executor boundary: any pass that contains the poisoned request
    raises. The engine must fail that request alone and finish the others unchanged."""
    engine = make_engine(tiny_model)
    real_execute = engine.executor.execute_model
    poison = prompts[3]

    def execute(model_input):
        if any(s.num_computed_tokens == 0 and s.token_ids == poison
               for s in model_input.sequences):
            raise RuntimeError("injected fault")
        return real_execute(model_input)

    engine.executor.execute_model = execute
    tokens = run(engine, prompts[:4])
    assert tokens["3"] == []
    assert [tokens[str(i)] for i in range(3)] == reference[:3]
    assert_engine_empty(engine)
