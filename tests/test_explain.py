"""Why was this request slow: explain.py on hand-built timelines, RequestStats' accounting, and
GET /v1/requests/{id}/explain against a live server (a tiny random-weight model, the engine in
its own process) where requests are made slow on purpose: one queued behind long ones, one
preempted by a KV cache of 16 blocks. Every breakdown's parts must sum to the end-to-end time,
and that must match the client's own clock."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from frontends import start_frontends, stop_frontends, wait_started
from model_utils import TINY

from treadle.config import AsyncEngineConfig, ServerConfig, build_config
from treadle.core.request import RequestStats
from treadle.frontend.async_engine import AsyncEngine
from treadle.frontend.request_ids import sanitize_request_id
from treadle.observability.explain import PARTS, e2e, explain, timings

# Hand-built timelines, as the observer writes them.


def timeline(engine_events: list[tuple[float, str]], **fields) -> dict:
    base = {"request_id": "r", "index": 0, "tenant": "default", "prompt_tokens": 100,
            "output_tokens": 20, "cached_tokens": 0, "finish_reason": "length",
            "ttft_s": None, "e2e_s": max(t for t, _ in engine_events) + 0.01 if engine_events
            else 0.0, "frontend_s": 0.02,
            "events": [{"t_s": 0.0, "event": "arrival"}]
            + [{"t_s": t, "event": kind} for t, kind in engine_events],
            "queue": {"waiting_ahead": 0, "running_ahead": 0, "tokens_ahead": 0},
            "prefill_chunks": [], "response_end_s": None,
            "preemptions": {"count": 0, "recompute_tokens": 0, "prefill_s": 0.0,
                            "decode_s": 0.0},
            "decode": {"steps": 19, "avg_batch": 1.0, "steps_with_prefill": 0,
                       "with_prefill_s": 0.0, "decode_only_s": 0.1}}
    return base | fields


def seconds(explained: dict) -> dict[str, float]:
    return {p["name"]: p["seconds"] for p in explained["parts"]}


def assert_sums_to_e2e(explained: dict) -> None:
    total = sum(p["seconds"] for p in explained["parts"])
    assert [p["name"] for p in explained["parts"]] == list(PARTS)
    assert all(p["seconds"] >= 0 for p in explained["parts"]), explained["parts"]
    assert total == pytest.approx(explained["e2e_s"], rel=0.05, abs=1e-5)


def test_queue_is_the_main_cause_when_the_wait_is_longest():
    t = timeline([(0.001, "queued"), (4.101, "scheduled"), (4.2, "first_token"),
                  (4.5, "finished")], response_end_s=4.52,
                 queue={"waiting_ahead": 30, "running_ahead": 7, "tokens_ahead": 9000})
    explained = explain(t)
    assert explained["main_cause"] == ("waited 4.1 s behind 37 requests (9000 tokens queued "
                                       "ahead): queue")
    assert seconds(explained) == pytest.approx({
        "frontend": 0.021, "queue": 4.1, "prefill": 0.099, "preemption": 0.0, "decode": 0.3,
        "stream": 0.02})
    assert explained["e2e_s"] == pytest.approx(0.02 + 4.52)
    assert_sums_to_e2e(explained)
    assert explained["timeline"] is t


def test_a_wait_for_another_tenant_names_it():
    t = timeline([(0.001, "queued"), (2.101, "scheduled"), (2.2, "first_token"),
                  (2.3, "finished")], response_end_s=2.32,
                 queue={"waiting_ahead": 3, "running_ahead": 6, "tokens_ahead": 9000,
                        "top_tenant": "heavy", "top_tenant_kv_share": 0.92})
    assert explain(t)["main_cause"] == "waited 2.1 s: tenant heavy held 92% of the KV cache"


def test_a_wait_for_the_step_in_flight_is_named_as_such():
    """The engine reads new requests between steps: most of a light request's "frontend" part
    beside long steps is the step in flight, not the frontend's own work."""
    t = timeline([(0.25, "queued"), (0.251, "scheduled"), (0.3, "first_token"),
                  (0.31, "finished")], response_end_s=0.32, frontend_s=0.004,
                 decode={"steps": 0, "avg_batch": 0.0, "steps_with_prefill": 0,
                         "with_prefill_s": 0.0, "decode_only_s": 0.0})
    assert explain(t)["main_cause"] == ("reached the engine's queue after 254 ms, 250 ms of it "
                                        "waiting for the step in flight: frontend")
    t = timeline([(0.001, "queued"), (0.002, "scheduled"), (0.05, "first_token"),
                  (0.06, "finished")], response_end_s=0.07, frontend_s=0.4)
    assert explain(t)["main_cause"] == ("spent 401 ms before reaching the engine (tokenize, "
                                        "admission): frontend")


def test_a_wait_for_a_lora_slot_names_the_adapter():
    """The scheduler's count of steps that passed the request over for --max-loras beats the
    guess from the cache at arrival; a base-model request's explain has no adapter."""
    t = timeline([(0.001, "queued"), (1.501, "scheduled"), (1.6, "first_token"),
                  (1.7, "finished")], lora="support",
                 queue={"waiting_ahead": 0, "running_ahead": 4, "tokens_ahead": 0,
                        "top_tenant": "heavy", "top_tenant_kv_share": 0.8,
                        "lora_cap_steps": 120})
    explained = explain(t)
    assert explained["lora"] == "support"
    assert explained["main_cause"] == ("waited 1.5 s, 120 steps of it for a LoRA slot (adapter "
                                       "support): max-loras")
    queue = next(p for p in explained["parts"] if p["name"] == "queue")
    assert queue["detail"].endswith("; passed over in 120 steps for a LoRA slot: adapter "
                                    "support would have made one more than --max-loras running")
    plain = explain(timeline([(0.001, "queued"), (0.2, "scheduled"), (0.3, "finished")]))
    assert plain["lora"] is None and "LoRA" not in json.dumps(plain)


def test_preemption_time_comes_out_of_prefill_and_decode():
    t = timeline([(0.0, "queued"), (0.1, "scheduled"), (0.3, "preempted"), (1.5, "first_token"),
                  (1.6, "preempted"), (3.5, "finished")],
                 preemptions={"count": 2, "recompute_tokens": 150, "prefill_s": 1.0,
                              "decode_s": 1.5})
    explained = explain(t)
    parts = seconds(explained)
    assert parts["prefill"] == pytest.approx(1.4 - 1.0)
    assert parts["decode"] == pytest.approx(2.0 - 1.5)
    assert parts["preemption"] == pytest.approx(2.5)
    assert explained["main_cause"].startswith("preempted twice for 2.5 s, 150 tokens recomputed")
    assert explained["main_cause"].endswith(": KV cache full")
    assert_sums_to_e2e(explained)


def test_decode_blames_others_prefills_or_the_batch():
    events = [(0.0, "queued"), (0.01, "scheduled"), (0.1, "first_token"), (3.0, "finished")]
    # 10 decode-only steps of 10 ms, 90 carrying others' prefill at 30 ms: 1.8 s inflation.
    slowed = explain(timeline(events, decode={
        "steps": 100, "avg_batch": 4.0, "steps_with_prefill": 90, "with_prefill_s": 2.7,
        "decode_only_s": 0.1}))
    assert slowed["main_cause"] == ("decode slowed 1.8 s by others' prefills in 90 of 100 steps:"
                                    " prefill interference")
    assert "costing 1.8 s more than decode-only steps" in slowed["parts"][4]["detail"]
    shared = explain(timeline(events, decode={
        "steps": 100, "avg_batch": 61.0, "steps_with_prefill": 0, "with_prefill_s": 0.0,
        "decode_only_s": 2.9}))
    assert shared["main_cause"] == "decode steps shared with 60 others for 2.9 s: batch"
    alone = explain(timeline(events))
    assert alone["main_cause"] == "generated 20 tokens in 2.9 s: decode"
    for explained in (slowed, shared, alone):
        assert_sums_to_e2e(explained)
    assert "proposed" not in alone["parts"][4]["detail"]


def test_decode_says_how_many_proposed_tokens_were_accepted():
    events = [(0.0, "queued"), (0.01, "scheduled"), (0.1, "first_token"), (1.0, "finished")]
    speculated = explain(timeline(events, decode={
        "steps": 8, "avg_batch": 1.0, "steps_with_prefill": 0, "with_prefill_s": 0.0,
        "decode_only_s": 0.9, "draft_tokens": 24, "accepted_tokens": 18}))
    assert speculated["parts"][4]["detail"].endswith(
        "; 18 of 24 proposed tokens accepted (75%, speculative decoding)")
    assert_sums_to_e2e(speculated)


def test_a_request_the_engine_never_reported_is_all_queue_and_timings_are_milliseconds():
    t = timeline([], e2e_s=0.8, finish_reason="abort", response_end_s=0.9)
    explained = explain(t)
    assert seconds(explained)["queue"] == pytest.approx(0.9)
    assert_sums_to_e2e(explained)
    ms = timings(t)
    assert ms["queue_ms"] == pytest.approx(900.0) and ms["e2e_ms"] == pytest.approx(920.0)
    assert (ms["prompt_n"], ms["predicted_n"]) == (100, 20)
    assert e2e(t) == pytest.approx(0.92)


def test_request_stats_count_recompute_until_caught_up():
    stats = RequestStats()
    stats.step_ran(0, 64, False, 3, 100, 0.02, 10.0)  # a chunk beside 2 others' 36 tokens
    assert stats.prefill_chunks == [(10.0 - 0.02, 64, 2, 36, 0.02)]
    stats.preempted(10.5, 64, in_prefill=True)
    stats.step_ran(16, 32, False, 1, 32, 0.01, 12.0)  # a prefix hit of 16, then 32 recomputed
    assert (stats.recompute_tokens, stats.preempted_prefill_s) == (32, 0.0)
    stats.step_ran(48, 40, False, 1, 40, 0.01, 12.5)  # 16 more recomputed, then new prompt
    assert stats.recompute_tokens == 48
    assert stats.preempted_prefill_s == pytest.approx(2.0) and stats.recompute_until == 0
    stats.step_ran(88, 1, True, 4, 0, 0.01, 13.0)
    stats.step_ran(89, 1, True, 2, 50, 0.03, 13.1)
    assert (stats.decode_steps, stats.decode_batch_sum, stats.decode_mixed_steps) == (2, 6, 1)
    assert (stats.decode_only_s, stats.decode_mixed_s) == pytest.approx((0.01, 0.03))


def test_client_request_ids_are_sanitised():
    assert sanitize_request_id("abc-123_x.y:z") == "abc-123_x.y:z"
    assert sanitize_request_id("a b/c\u00e9%") == "a_b_c__"
    assert len(sanitize_request_id("x" * 1000)) == 128


@contextmanager
def live_server(tiny_folder, num_blocks: int) -> Iterator[str]:
    """A live server with 2 batch slots and `num_blocks` blocks of 4 tokens."""
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        model=str(tiny_folder), dtype="float32", num_blocks=num_blocks, block_size=4,
        max_num_seqs=2, max_model_len=TINY["max_position_embeddings"])))
    frontends, thread = start_frontends(engine, ServerConfig(port=0, grpc_port=None))
    try:
        wait_started(frontends, thread)
        yield f"http://127.0.0.1:{frontends.port}"
    finally:
        stop_frontends(frontends, thread)


@pytest.fixture(scope="module")
def server(tiny_folder) -> Iterator[str]:
    """16 blocks: 64 tokens, so that two requests of 36 and 63 tokens preempt each other."""
    with live_server(tiny_folder, 16) as url:
        yield url


@pytest.fixture(scope="module")
def roomy_server(tiny_folder) -> Iterator[str]:
    """64 blocks: two requests long enough to surely still run when a third arrives (24
    tokens each were done before it, in CI)."""
    with live_server(tiny_folder, 64) as url:
        yield url


def prompt(n: int, seed: int) -> list[int]:
    """Distinct prompts, so that no prefix-cache hit shortens a prefill."""
    return random.Random(seed).choices(range(3, 250), k=n)


# One client for every test: building one costs about 25 ms (its SSL context), which delays a
# request meant to arrive while another still runs.
HTTP = httpx.Client()


def complete(base: str, body: dict, request_id: str | None = None
             ) -> tuple[dict, str, tuple[float, float]]:
    """The response, the X-Request-Id it carried, and when the client sent it and had the
    answer (time.monotonic(): the server runs in this process, on the same clock)."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    start = time.monotonic()
    response = HTTP.post(f"{base}/v1/completions", timeout=120, headers=headers,
                         json={"max_tokens": 4, "temperature": 0, "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    return response.json(), response.headers["x-request-id"], (start, time.monotonic())


def assert_within(explained: dict, client: tuple[float, float]) -> None:
    """The breakdown spans the server's part of what the client measured: from the request
    received to the response written, inside the client's send and receipt. (How much of the
    client's time it covers is not asserted: the client shares this process and two busy
    cores with the server, and measured 0.36 s around a 0.12 s request in CI.)"""
    record = explained["timeline"]
    received = record["arrival_monotonic"] - record["frontend_s"]
    assert client[0] - 1e-3 <= received
    assert received + explained["e2e_s"] <= client[1] + 1e-3


def at(record: dict, event: str) -> float:
    """When a timeline's first `event` happened, on time.monotonic()."""
    return record["arrival_monotonic"] + next(e["t_s"] for e in record["events"]
                                              if e["event"] == event)


def explained(base: str, request_id: str) -> dict:
    response = httpx.get(f"{base}/v1/requests/{request_id}/explain", timeout=30)
    assert response.status_code == 200, response.text
    body = response.json()
    assert_sums_to_e2e(body)
    return body


class Background(threading.Thread):
    """A streamed completion in a thread: `started` once its first token arrived."""

    def __init__(self, base: str, body: dict, request_id: str) -> None:
        super().__init__(daemon=True)
        self.base, self.body, self.request_id = base, body, request_id
        self.started, self.echoed = threading.Event(), None

    def run(self) -> None:
        with httpx.stream("POST", f"{self.base}/v1/completions", timeout=120,
                          headers={"X-Request-Id": self.request_id},
                          json={"temperature": 0, "ignore_eos": True, "stream": True,
                                **self.body}) as response:
            self.echoed = response.headers["x-request-id"]
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.started.set()


def test_queued_behind_running_requests(roomy_server, caplog):
    server = roomy_server
    caplog.set_level(logging.INFO, logger="treadle.frontend.observer")
    # Both batch slots taken (and all 64 blocks: 127 tokens each). The case needs the third
    # request sent while both have more left to run than its own decode; on two busy cores the
    # client may send it later than that, so such a try runs again.
    for attempt in range(5):
        ahead = [Background(server, {"prompt": prompt(8, 100 * attempt + i), "max_tokens": 120},
                            f"same{attempt}") for i in range(2)]
        for thread in ahead:
            thread.start()
        for thread in ahead:
            assert thread.started.wait(60)
        body, echoed, client = complete(server, {"prompt": prompt(8, 100 * attempt + 9)},
                                        f"slow one/%{attempt}")
        for thread in ahead:
            thread.join(60)
        by_header = explained(server, echoed)
        # It cannot be scheduled before a slot frees, when the first of those ahead finished.
        freed = min(at(explained(server, t.echoed)["timeline"], "finished") for t in ahead)
        if freed - at(by_header["timeline"], "queued") > seconds(by_header)["decode"]:
            break
    else:
        pytest.fail("those ahead had nearly finished when the third request came, 5 times")
    assert echoed == f"slow_one__{attempt}" and body["id"] == f"cmpl-slow_one__{attempt}"
    # A client id already in flight gets a suffix; both requests are explained apart.
    assert sorted(t.echoed for t in ahead) == [f"same{attempt}", f"same{attempt}~2"]
    assert explained(server, body["id"]) == by_header
    assert by_header["request_id"] == f"slow_one__{attempt}"
    assert by_header["main_cause"].startswith("waited ")
    assert by_header["main_cause"].endswith(": queue")
    assert by_header["timeline"]["queue"]["running_ahead"] == 2
    assert_within(by_header, client)
    assert seconds(by_header)["queue"] >= freed - at(by_header["timeline"], "queued") - 1e-3
    for thread in ahead:  # never preempted: one chunk for the prompt, a step per later token
        record = explained(server, thread.echoed)["timeline"]
        assert sum(c["tokens"] for c in record["prefill_chunks"]) == 8
        assert record["decode"]["steps"] == record["output_tokens"] - 1 == 119
        assert record["preemptions"]["count"] == 0
    log = [r.getMessage() for r in caplog.records if f"request slow_one__{attempt} finished"
           in r.getMessage()]
    assert len(log) == 1 and "queue " in log[0] and "decode " in log[0]


def test_preempted_when_the_cache_runs_out(server):
    # Each fits alone (63 and 36 tokens of 64), not together: past 32 tokens each, the later
    # one is the victim and waits for the first to finish. That needs the victim admitted
    # while the first still runs: the first's 43 steps take about 0.1 s on the tiny model, and
    # the client thread may wake later than that on two busy cores, so such a try runs again;
    # so does one where the victim was preempted near the first's end and its wait for the
    # step in flight on arrival (the frontend part) was the longer.
    for attempt in range(5):
        first = Background(server, {"prompt": prompt(20, 10 + attempt), "max_tokens": 43},
                           f"big{attempt}")
        first.start()
        assert first.started.wait(60)
        body, echoed, client = complete(server, {"prompt": prompt(20, 20 + attempt),
                                                 "max_tokens": 16}, f"victim{attempt}")
        first.join(60)
        victim = explained(server, echoed)
        record = victim["timeline"]
        big = explained(server, f"big{attempt}")["timeline"]
        parts = seconds(victim)
        if (at(record, "scheduled") < at(big, "finished")
                and parts["preemption"] == max(parts.values())):
            break
    else:
        pytest.fail("the second request was never admitted and then preempted for most of its "
                    "time while the first ran, in 5 tries")
    assert record["preemptions"]["count"] >= 1
    assert victim["main_cause"].endswith(": KV cache full"), victim
    assert seconds(victim)["preemption"] > seconds(victim)["decode"]
    assert_within(victim, client)
    assert body["usage"]["completion_tokens"] == 16
    assert big["preemptions"]["count"] == 0


def test_timings_are_opt_in_and_chat_ids_are_explained(server):
    plain, _, _ = complete(server, {"prompt": "Hello"})
    assert "timings" not in plain
    timed, echoed, _ = complete(server, {"prompt": "Hello", "return_timings": True})
    record = explained(server, echoed)
    assert timed["timings"]["e2e_ms"] == pytest.approx(record["e2e_s"] * 1e3, rel=0.05)
    assert set(timed["timings"]) == {f"{p}_ms" for p in PARTS} | {"e2e_ms", "prompt_n",
                                                                  "predicted_n"}
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=messages, max_tokens=3, n=2,
                                          extra_body={"ignore_eos": True})
    assert chat.id.startswith("chatcmpl-") and chat.model_extra.get("timings") is None
    for index in range(2):
        assert explained(server, f"{chat.id}/{index}")["timeline"]["index"] == index
    stream = client.chat.completions.create(
        model=chat.model, messages=messages, max_tokens=3, stream=True,
        extra_body={"ignore_eos": True, "return_timings": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].model_extra["timings"]["decode_ms"] >= 0
    assert all("timings" not in c.model_extra for c in chunks[:-1])
    assert explained(server, chunks[-1].id)["timeline"]["response_end_s"] is not None


def test_unknown_ids_are_404_in_openai_shape(server):
    for request_id in ("nope", "cmpl-nope", "a/b/c"):
        response = httpx.get(f"{server}/v1/requests/{request_id}/explain", timeout=30)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "request_not_found"


def test_latency_histograms_carry_the_request_id_as_an_exemplar(server):
    """OpenMetrics, as Prometheus asks for it: a latency bucket names a request that fell in it,
    and that id is one explain knows. Prometheus' own text format has no exemplars."""
    complete(server, {"prompt": prompt(6, 99)}, request_id="exemplar-me")
    text = httpx.get(f"{server}/metrics", timeout=30,
                     headers={"Accept": "application/openmetrics-text; version=1.0.0"}).text
    ttft = [line for line in text.splitlines()
            if line.startswith("treadle_time_to_first_token_seconds_bucket")  # ":" escaped
            and 'request_id="exemplar-me"' in line]
    assert len(ttft) == 1, text
    e2e = [line for line in text.splitlines()
           if line.startswith("treadle_e2e_request_latency_seconds_bucket")
           and 'request_id="exemplar-me"' in line]
    assert len(e2e) == 1
    assert explained(server, "exemplar-me")["request_id"] == "exemplar-me"
    plain = httpx.get(f"{server}/metrics", timeout=30).text
    assert "treadle:time_to_first_token_seconds_bucket" in plain and "exemplar-me" not in plain
