"""LoRA adapters in the engine's census, the timelines, explain and the dashboard (issue 37's
rows): the census's per-adapter counts on a real engine over a tiny random model with two random
PEFT adapters, checked against the scheduler's queues step by step; the steps a request waited
for a LoRA slot (--max-loras); and through a real server, the adapter on a request's timeline,
its explain and the dashboard feed's adapters table."""

from __future__ import annotations

import threading
from collections import Counter

import httpx
import pytest
from conftest import assert_engine_empty
from model_utils import preload_adapters, save_random_adapter

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
    preload_adapters(engine, loras.values())  # so only the cap holds requests back
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


def stream(base: str, model: str, request_id: str, max_tokens: int,
           started: threading.Event) -> None:
    """A streamed completion through `model`; `started` set at its first token."""
    with httpx.stream("POST", f"{base}/v1/completions", timeout=120,
                      headers={"X-Request-Id": request_id},
                      json={"model": model, "prompt": "Once upon a time", "stream": True,
                            "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                started.set()


def at(timeline: dict, event: str) -> float:
    """When a timeline's first `event` happened, on time.monotonic()."""
    return timeline["arrival_monotonic"] + next(e["t_s"] for e in timeline["events"]
                                                if e["event"] == event)


def test_server_timelines_and_explain_name_the_adapter(tiny_folder, adapters):
    """Through a real server with one adapter at a time: a's request streams (200 tokens: it
    surely still runs when the next arrives), b's waits for its slot; each timeline names its
    adapter (none for the base model), b's explain says it waited for a LoRA slot, and b was
    first scheduled only once a's had finished."""
    from frontends import start_frontends, stop_frontends, wait_started

    from treadle.config import AsyncEngineConfig, ServerConfig, build_config
    from treadle.frontend.async_engine import AsyncEngine

    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        model=str(tiny_folder), dtype="float32", kv_cache_memory_bytes=4 << 20,
        enable_lora=True, max_loras=1)))
    frontends, thread = start_frontends(engine, ServerConfig(
        port=0, grpc_port=None, enable_debug_endpoints=True,
        lora_modules=tuple(f"{name}={path}" for name, path in adapters.items())))
    try:
        wait_started(frontends, thread)
        base = f"http://127.0.0.1:{frontends.port}"
        started = threading.Event()
        first = threading.Thread(target=stream, args=(base, "a", "with-a", 200, started))
        first.start()
        assert started.wait(60)
        for model, request_id in (("b", "with-b"), (engine.model_name, "plain")):
            response = httpx.post(f"{base}/v1/completions", timeout=120,
                                  headers={"X-Request-Id": request_id},
                                  json={"model": model, "prompt": "Once upon a time",
                                        "max_tokens": 4, "temperature": 0})
            assert response.status_code == 200, response.text
        first.join(120)
        timelines = {request_id: httpx.get(f"{base}/debug/requests/{request_id}").json()
                     for request_id in ("with-a", "with-b", "plain")}
        explained = {request_id: httpx.get(f"{base}/v1/requests/{request_id}/explain").json()
                     for request_id in timelines}
        panel = httpx.get(f"{base}/dashboard/requests/with-b").json()
    finally:
        stop_frontends(frontends, thread)
    for request_id, lora in (("with-a", "a"), ("with-b", "b"), ("plain", None)):
        assert timelines[request_id]["lora"] == explained[request_id]["lora"] == lora
    assert panel["row"]["lora"] == panel["timeline"]["lora"] == "b"
    waited = timelines["with-b"]["queue"]["lora_cap_steps"]
    assert waited > 0 and at(timelines["with-b"], "scheduled") >= at(timelines["with-a"],
                                                                     "finished")
    assert timelines["with-a"]["queue"]["lora_cap_steps"] == 0
    parts = {p["name"]: p for p in explained["with-b"]["parts"]}
    assert f"passed over in {waited} steps for a LoRA slot: adapter b" in parts["queue"]["detail"]
    if max(parts.values(), key=lambda p: p["seconds"])["name"] == "queue":
        assert explained["with-b"]["main_cause"].endswith("(adapter b): max-loras")
    assert "LoRA" not in parts_text(explained["plain"])


def parts_text(explained: dict) -> str:
    return " ".join([explained["main_cause"], *(p["detail"] for p in explained["parts"])])
