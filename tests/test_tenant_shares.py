"""Each tenant's share of the KV cache and of the steps (issue 34's dashboard rows): the engine's
census on a real engine over a tiny random model, checked against the KV cache manager's own
block tables; and the per-tenant Prometheus series, their labels bounded."""

from __future__ import annotations

import pytest
from conftest import assert_engine_empty
from model_utils import build_tiny_model

from treadle.config import CacheConfig, EngineConfig, ModelConfig
from treadle.core.engine_core import EngineCore
from treadle.core.engine_process import take_census
from treadle.core.sampling_params import SamplingParams
from treadle.observability.metrics import ServerMetrics

PROMPT = list(range(10, 34))  # 24 tokens: six 4-token blocks, five of them reusable by a hit
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model("llama", folder)
    return folder


def make_engine(folder, prefix_caching: bool = True) -> EngineCore:
    return EngineCore(EngineConfig(ModelConfig(model=str(folder), dtype="float32"),
                                   CacheConfig(block_size=4, num_blocks=64,
                                               enable_prefix_caching=prefix_caching)))


def blocks_by_tables(engine: EngineCore) -> tuple[dict[str, int], int]:
    """From the cache manager's tables, as sets: each tenant's blocks no other tenant holds,
    and the blocks several tenants hold."""
    held: dict[str, set[int]] = {}
    for request in engine.scheduler.running:
        held.setdefault(request.tenant, set()).update(
            engine.kv_cache_manager.block_ids(request.request_id))
    shared = {b for t in held for b in held[t]
              if any(b in held[other] for other in held if other != t)}
    return {t: len(blocks - shared) for t, blocks in held.items()}, len(shared)


def add(engine: EngineCore, request_id: str, tenant: str, prompt: list[int]) -> None:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                          ignore_eos=True), tenant=tenant)


def test_census_counts_each_block_in_use_once_and_each_tenants_tokens(tiny_model):
    engine = make_engine(tiny_model)
    # heavy's two requests and guest's one share PROMPT's cached blocks; light's prompt is its own.
    for request_id, tenant, prompt in (("h0", "heavy", PROMPT), ("h1", "heavy", PROMPT),
                                       ("g0", "guest", PROMPT), ("l0", "light", [7] * 10)):
        add(engine, request_id, tenant, prompt)
    requests = dict(engine.scheduler.requests)
    scheduled = 0
    engine.step()
    scheduled += engine.last_step_stats.num_prefill_tokens + \
        engine.last_step_stats.num_decode_tokens
    census = take_census(engine)
    expected, num_shared = blocks_by_tables(engine)
    assert dict(census.kv_blocks_by_tenant) == expected
    assert census.kv_blocks_shared == num_shared == 5  # PROMPT's hit blocks: heavy's and guest's
    # heavy's two tables share five blocks, counted once.
    heavy_tables = sum(len(engine.kv_cache_manager.block_ids(r)) for r in ("h0", "h1"))
    assert expected["heavy"] < heavy_tables - num_shared
    assert sum(expected.values()) + num_shared == engine.kv_cache_manager.num_used_blocks

    while engine.has_unfinished_requests():
        engine.step()
        scheduled += engine.last_step_stats.num_prefill_tokens + \
            engine.last_step_stats.num_decode_tokens
    census = take_census(engine)
    assert engine.scheduler.num_preemptions == 0
    # Each request: its prompt less its prefix hit, then a decode token per output but the first.
    expected_tokens: dict[str, int] = {}
    for request in requests.values():
        expected_tokens[request.tenant] = expected_tokens.get(request.tenant, 0) + \
            request.num_prompt_tokens - request.num_cached_tokens + MAX_TOKENS - 1
    assert dict(census.scheduled_tokens_by_tenant) == expected_tokens
    assert sum(expected_tokens.values()) == scheduled
    assert not any(n for _, n in census.kv_blocks_by_tenant) and census.kv_blocks_shared == 0
    assert_engine_empty(engine)


def test_census_without_prefix_caching_counts_the_tables(tiny_model):
    engine = make_engine(tiny_model, prefix_caching=False)
    for request_id, tenant in (("a0", "a"), ("a1", "a"), ("b0", "b")):
        add(engine, request_id, tenant, PROMPT)
    engine.step()
    engine.step()
    census = take_census(engine)
    tables = {t: sum(len(engine.kv_cache_manager.block_ids(r)) for r in ids)
              for t, ids in (("a", ("a0", "a1")), ("b", ("b0",)))}
    assert dict(census.kv_blocks_by_tenant) == tables and census.kv_blocks_shared == 0
    assert sum(tables.values()) == engine.kv_cache_manager.num_used_blocks
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_empty(engine)


def test_explain_share_counts_a_tenants_shared_blocks_once(tiny_model):
    """heavy's two requests share PROMPT's blocks: the share a later request of light's is told
    heavy held (explain's "tenant X held N%") counts each of heavy's blocks once."""
    engine = make_engine(tiny_model)
    add(engine, "h0", "heavy", PROMPT)
    add(engine, "h1", "heavy", PROMPT)
    engine.step()
    expected, num_shared = blocks_by_tables(engine)
    assert num_shared == 0 and set(expected) == {"heavy"}
    tables = sum(len(engine.kv_cache_manager.block_ids(r)) for r in ("h0", "h1"))
    assert expected["heavy"] < tables  # the tables overlap: summing them would overstate
    add(engine, "l0", "light", [7] * 10)
    stats = engine.scheduler.requests["l0"].stats
    assert stats.top_tenant == "heavy"
    assert stats.top_tenant_kv_share == expected["heavy"] / engine.kv_cache_manager.num_blocks
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_empty(engine)


def sample(metrics: ServerMetrics, name: str, tenant: str) -> float | None:
    return metrics.registry.get_sample_value(f"treadle:{name}",
                                             {"model_name": "m", "tenant": tenant})


def test_tenant_series_are_bounded_and_follow_the_engine():
    metrics = ServerMetrics("m", max_tenant_labels=1)
    metrics.observe_tenants((("a", 5), ("b", 3), ("c", 2)), (("a", 100), ("b", 40), ("c", 10)))
    assert sample(metrics, "tenant_kv_cache_blocks", "a") == 5
    assert sample(metrics, "tenant_kv_cache_blocks", "other") == 5  # b and c: past the bound
    assert sample(metrics, "tenant_kv_cache_blocks", "b") is None
    assert sample(metrics, "scheduled_tokens_total", "a") == 100
    assert sample(metrics, "scheduled_tokens_total", "other") == 50
    # a's requests have all ended: its gauge goes to 0; the counters grow by the difference.
    metrics.observe_tenants((("b", 1),), (("a", 100), ("b", 70), ("c", 10)))
    assert sample(metrics, "tenant_kv_cache_blocks", "a") == 0
    assert sample(metrics, "tenant_kv_cache_blocks", "other") == 1
    assert sample(metrics, "scheduled_tokens_total", "other") == 80
    # A restarted engine counts from 0: its tokens are all new.
    metrics.observe_tenants((), (("a", 7),))
    assert sample(metrics, "scheduled_tokens_total", "a") == 107
    assert sample(metrics, "tenant_kv_cache_blocks", "other") == 0
