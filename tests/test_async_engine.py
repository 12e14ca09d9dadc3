"""AsyncEngine with the engine in its own process, on the default model (float32): streamed
tokens equal the offline API's, refusals arrive as ValueError, and an abandoned stream frees its
blocks in the engine process."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from treadle.config import AsyncEngineConfig, build_config
from treadle.core.sampling_params import SamplingParams
from treadle.frontend.admission import EngineOverloaded
from treadle.frontend.async_engine import AsyncEngine
from treadle.llm import LLM

pytestmark = pytest.mark.default_model


def scrape(text: bytes) -> dict[str, float]:
    """Sample name (with labels other than model_name and tenant) -> value, summed over
    tenants."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "tenant")}
            suffix = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "le")
            if "le" not in labels:
                name = sample.name + (f"{{{suffix}}}" if suffix else "")
                values[name] = values.get(name, 0.0) + sample.value
    return values


async def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = engine.load()
        if load == {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}:
            return load
        await asyncio.sleep(0.1)
    return engine.load()


def test_streams_equal_offline_and_aborts_free_blocks(tmp_path):
    offline = LLM(dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20)
    prompts = [offline.chat_prompt(q) for q in ("Why is the sky blue?", "Name three fruits.")]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    expected = [o.outputs[0] for o in offline.generate(prompts, params, use_tqdm=False)]

    async def scenario():
        engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
            dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20,
            trace_file=str(tmp_path / "trace.json"))))
        await engine.start()
        try:
            async def collect(request_id, prompt):
                text, tokens = "", []
                async for update in engine.generate(request_id, prompt, params):
                    for delta in update.deltas:
                        text += delta.text
                        tokens += delta.token_ids
                cached.append(update.state.num_cached_tokens)
                return text, tokens, update.state.samples[0].finish_reason

            cached: list[int] = []

            results = await asyncio.gather(*(collect(f"r{i}", p) for i, p in enumerate(prompts)))
            for (text, tokens, reason), want in zip(results, expected, strict=True):
                assert (text, tokens, reason) == (want.text, want.token_ids, want.finish_reason)
            generated = sum(len(tokens) for _, tokens, _ in results)
            prompt_tokens = sum(len(p) for p in prompts) - sum(cached)  # prefix hits: not run

            # Prometheus: exact counts for this known workload.
            metrics = scrape(engine.metrics.render())
            assert metrics["treadle:generation_tokens_total"] == generated
            assert metrics["treadle:prompt_tokens_total"] == sum(len(p) for p in prompts)
            assert metrics["treadle:prefix_cache_queries_total"] == sum(len(p) for p in prompts)
            assert metrics["treadle:prefix_cache_hits_total"] == sum(cached) > 0
            for reason in {r for _, _, r in results}:
                assert metrics[f'treadle:request_success_total{{finished_reason="{reason}"}}'] \
                    == sum(r == reason for _, _, r in results)
            for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time",
                         "request_prefill_time", "request_decode_time"):
                assert metrics[f"treadle:{name}_seconds_count"] == len(prompts)
            assert metrics["treadle:inter_token_latency_seconds_count"] == generated - 2
            assert metrics["treadle:iteration_tokens_total_sum"] == prompt_tokens + generated - 2

            with pytest.raises(ValueError, match="max_model_len"):
                async for _ in engine.generate("too-long", prompts[0],
                                               SamplingParams(max_tokens=10**6)):
                    pass

            stream = engine.generate("left", prompts[0],
                                     SamplingParams(max_tokens=500, ignore_eos=True))
            async for _ in stream:
                assert engine.load()["running"] <= 1
                break
            await stream.aclose()  # what a disconnect does
            assert await wait_idle(engine) == {"running": 0, "waiting": 0,
                                               "kv_cache_usage": 0.0}
            assert engine.is_ready()
        finally:
            await engine.shutdown()
        return generated, prompt_tokens

    generated, prompt_tokens = asyncio.run(scenario())
    # The step trace: one complete event per step; until the refused and the abandoned requests
    # (which came later), generated and prefill tokens add up to what the streams carried.
    events = json.loads((tmp_path / "trace.json").read_text())
    assert all(e["ph"] == "X" and e["dur"] > 0 for e in events)
    # The model pass is part of the step, and not all of it (scheduling, sampling).
    assert all(0 < e["args"]["model_ms"] < e["dur"] / 1e3 for e in events)
    served = []
    total = 0
    for event in events:
        if total == generated:
            break
        total += event["args"]["generated_tokens"]
        served.append(event)
    assert total == generated
    assert sum(e["args"]["prefill_tokens"] for e in served) == prompt_tokens
    assert sum(e["args"]["decode_tokens"] for e in served) == generated - len(prompts)
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)


def test_a_full_queue_refuses_then_serves_again():
    async def scenario():
        engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
            dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20,
            max_queued_requests=1)))
        await engine.start()
        try:
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            first = engine.generate("a", [1, 2, 3, 4], params)
            first_update = asyncio.create_task(first.__anext__())
            await asyncio.sleep(0)  # "a" is sent and waits for its first token
            with pytest.raises(EngineOverloaded, match="queued"):
                await engine.generate("b", [5, 6, 7], params).__anext__()
            await first_update  # "a" is running now: the queue has room again
            tokens = [t async for u in engine.generate("c", [5, 6, 7], params)
                      for d in u.deltas for t in d.token_ids]
            assert len(tokens) == 4
            async for _ in first:
                pass
            assert await wait_idle(engine) == {"running": 0, "waiting": 0,
                                               "kv_cache_usage": 0.0}
        finally:
            await engine.shutdown()

    asyncio.run(scenario())
