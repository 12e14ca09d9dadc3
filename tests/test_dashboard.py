"""The live dashboard: its feed's snapshot from a known workload (LiveFeed alone, numbers checked
by hand and percentiles against numpy), and the real page in headless Chromium (Debian's
`chromium`, driven by Playwright) against a live server over a tiny model, behind an API key:
it loads without console errors, its numbers move under load, a click shows a request's
timeline, each tenant's share of the KV cache and of the tokens scheduled shows. Screenshots go
to the test's tmp dir (and /tmp/dashboard.png)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from frontends import start_frontends, stop_frontends, wait_started
from model_utils import save_random_adapter

from treadle.config import APIKey, AsyncEngineConfig, ServerConfig, build_config
from treadle.core.messages import EngineCensus, EngineLoad, StepRecord
from treadle.frontend.async_engine import AsyncEngine
from treadle.frontend.output_processor import SampleDelta
from treadle.observability import live
from treadle.observability.live import LiveFeed, timeline_segments
from treadle.server.dashboard import router

CHROMIUM = shutil.which("chromium")
KEY = "dash-key"  # tenant key-1: reads its own tenant's rows
ADMIN_KEY = "dash-admin-key"  # tenant admin: reads every tenant's
ADAPTER = "tone"  # the server's LoRA adapter


def delta(request_id: str, tokens: int, finished: bool = False, reason: str | None = None,
          events: list | None = None, index: int = 0) -> SampleDelta:
    return SampleDelta(request_id, index, "x" * tokens, [7] * tokens, None, finished, reason,
                       events=events)


def load(running: int, waiting: int, usage: float, queries: int, hits: int,
         preemptions: int) -> EngineLoad:
    return EngineLoad(running, waiting, usage, running + waiting > 0, queries, hits, preemptions)


def test_snapshot_of_a_known_workload():
    feed, t0 = LiveFeed(), 1000.0
    # Ten steps, one every 0.1 s: a prefill of 32 tokens then nine decode steps of 2.
    for i in range(10):
        prefill, decode = (32, 0) if i == 0 else (0, 2)
        step = StepRecord(t0 + 0.1 * i, 0.05, 2, prefill, decode, 1 if i == 5 else 0)
        census = EngineCensus(waiting=(("alice", 0, 3), ("bob", 1, 1)),
                              running=(("alice", 0, 2),), num_cached_free_blocks=5)
        feed.record_engine(load(2, 4, 0.25, 100 + 10 * i, 40 + 5 * i, 1 if i >= 5 else 0),
                           step, census if i == 0 else None, t0 + 0.1 * i)
    # Two requests: "a" finishes (3 tokens); "b" gets one token and its client leaves.
    feed.start("a", 1, "alice", 0, 32, t0)
    feed.start("b", 1, "bob", 1, 8, t0 + 0.2)
    feed.observe(delta("a", 1), t0 + 0.5)
    feed.observe(delta("b", 1), t0 + 0.6)
    feed.observe(delta("a", 1), t0 + 0.7)
    events = [(t0 + 0.05, "queued", 0), (t0 + 0.1, "scheduled", 16),
              (t0 + 0.2, "scheduled", 16), (t0 + 0.45, "first_token", 0),
              (t0 + 0.45, "scheduled", 1), (t0 + 0.7, "scheduled", 1),
              (t0 + 0.9, "finished", 0)]
    feed.observe(delta("a", 1, True, "length", events), t0 + 1.0)
    feed.forget("b", t0 + 1.1)
    feed.rejected("queue_full", t0 - 100)  # out of the minute
    feed.rejected("queue_full", t0 + 0.3)
    feed.record_engine(load(2, 4, 0.25, 200, 100, 1), None, None, t0 + 1.1)  # a heartbeat
    snap = feed.snapshot(0, num_blocks=40, now=t0 + 1.2)

    assert snap["cursor"] == 10 and len(snap["steps"]) == 10
    assert snap["steps"][0] == [-1.2, 0.05, 2, 32, 0, 0]
    assert feed.snapshot(7, 40, t0 + 1.2)["steps"] == snap["steps"][7:]  # after the cursor
    now = snap["now"]
    assert (now["running"], now["waiting"]) == (2, 4)
    assert now["waiting_by"] == [{"tenant": "alice", "priority": 0, "requests": 3},
                                 {"tenant": "bob", "priority": 1, "requests": 1}]
    assert now["running_by"] == [{"tenant": "alice", "priority": 0, "requests": 2}]
    assert now["kv_blocks"] == {"total": 40, "used": 10, "cached_free": 5, "free": 25}
    # Counters sampled once a second: (100, 40) at t0, (200, 100) at the heartbeat.
    assert now["prefix_hit_rate"] == {"total": 0.5, "minute": pytest.approx(60 / 100)}
    assert now["preemptions"]["total"] == 1
    assert now["steps_per_s"] == 10 / live.RATE_WINDOW
    assert now["prefill_tokens_per_s"] == round(32 / live.RATE_WINDOW, 1)
    assert now["decode_tokens_per_s"] == round(18 / live.RATE_WINDOW, 1)
    assert snap["rejections"] == {"total": 2, "minute": 1, "by_reason": {"queue_full": 2}}

    b, a = snap["requests"]  # newest first
    assert (b["id"], b["finish_reason"], b["output_tokens"]) == ("b", "abort", 1)
    assert (a["id"], a["finish_reason"], a["output_tokens"]) == ("a", "length", 3)
    assert a["ttft"] == pytest.approx(0.5)
    assert [s[0] for s in a["segments"]] == ["frontend", "queued", "prefill", "decode"]
    assert a["segments"][-1][2] == pytest.approx(-0.2)  # ends at the frontend's finish
    assert a["chunks"] == [pytest.approx(-1.1), pytest.approx(-1.0)]
    assert [s[0] for s in b["segments"]] == ["pending", "decode"]  # no engine events: aborted

    latency = snap["latency"]
    assert latency["ttft"]["count"] == 2 and latency["itl"]["count"] == 2
    assert latency["e2e"]["count"] == 1 and latency["e2e"]["p50"] == pytest.approx(1.0)
    for name, values in (("ttft", [0.5, 0.4]), ("itl", [0.2, 0.3])):
        for p in (50, 90, 99):
            assert latency[name][f"p{p}"] == pytest.approx(np.percentile(values, p))
    assert feed.row("a", t0 + 1.2) == a and feed.row("nope", t0) is None
    # Idle since the census: nobody is left in its classes; its cached blocks still are.
    feed.record_engine(load(0, 0, 0.0, 200, 100, 1), None, None, t0 + 1.3)
    idle = feed.snapshot(10, 40, t0 + 1.3)["now"]
    assert idle["waiting_by"] == idle["running_by"] == []
    assert idle["kv_blocks"] == {"total": 40, "used": 0, "cached_free": 5, "free": 35}
    # A minute later the latencies and rejections have left the window.
    later = feed.snapshot(10, 40, t0 + 70)
    assert later["latency"]["ttft"]["count"] == 0 and later["rejections"]["minute"] == 0


def shares_census(blocks: tuple = (), shared: int = 0, tokens: tuple = ()) -> EngineCensus:
    return EngineCensus((), (), 0, blocks, shared, tokens)


def test_tenant_shares_in_the_snapshot():
    feed, t0 = LiveFeed(), 1000.0
    busy = load(3, 0, 0.5, 0, 0, 0)
    # A census a second: a's tokens since the start 300, then 30 more a second; b's 10 a
    # second from t0 + 4.
    for i in range(8):
        tokens = (("a", 300 + 30 * i),) + ((("b", 10 * (i - 3)),) if i > 3 else ())
        feed.record_engine(busy, None, shares_census((("a", 12), ("b", 4)), 2, tokens), t0 + i)
    now = feed.snapshot(0, num_blocks=40, now=t0 + 7)["now"]
    # The last RATE_WINDOW (5 s): since the census at t0 + 2, a 150 tokens and b 40.
    assert now["tenants"] == [
        {"tenant": "a", "kv_blocks": 12, "kv_share": 0.3, "token_share": round(150 / 190, 4)},
        {"tenant": "b", "kv_blocks": 4, "kv_share": 0.1, "token_share": round(40 / 190, 4)}]
    assert now["kv_shared"] == {"kv_blocks": 2, "kv_share": 0.05}
    assert now["token_window_s"] == live.RATE_WINDOW
    # A tenant's key: its own row, and nothing of blocks it may share with others.
    own = feed.snapshot(0, 40, t0 + 7, tenant="b")["now"]
    assert own["tenants"] == [now["tenants"][1]] and own["kv_shared"] is None
    # Two live replicas: shares of both pools.
    feed.record_replica(0, True, busy)
    feed.record_replica(1, True, busy)
    assert feed.snapshot(0, 40, t0 + 7)["now"]["tenants"][0]["kv_share"] == 0.15
    feed.record_replica(1, False, busy)
    # A new engine counts from 0: its tokens are all in the window; a holds no blocks now.
    feed.record_engine(busy, None, shares_census((("b", 3),), 0, (("a", 5),)), t0 + 8)
    assert feed.snapshot(0, 40, t0 + 8)["now"]["tenants"] == [
        {"tenant": "a", "kv_blocks": 0, "kv_share": 0.0, "token_share": 1.0},
        {"tenant": "b", "kv_blocks": 3, "kv_share": 0.075, "token_share": 0.0}]
    # Idle since the census: nobody holds blocks; long after, nothing was scheduled lately.
    feed.record_engine(load(0, 0, 0.0, 0, 0, 0), None, None, t0 + 9)
    idle = feed.snapshot(0, 40, t0 + 9)["now"]
    assert [t["kv_blocks"] for t in idle["tenants"]] == [0] and idle["kv_shared"]["kv_blocks"] == 0
    feed.record_engine(load(0, 0, 0.0, 0, 0, 0), None, shares_census(tokens=(("a", 5),)), t0 + 20)
    assert feed.snapshot(0, 40, t0 + 20)["now"]["tenants"] == []


def test_adapter_rows_in_the_snapshot():
    """Per LoRA adapter: requests waiting and running, summed over tenants for the admin, a
    tenant's own for its key; the share of all tokens scheduled in the window, base model's
    included."""
    feed, t0 = LiveFeed(), 1000.0
    busy = load(5, 2, 0.5, 0, 0, 0)
    for i in range(8):  # a census a second; t1's adapter x 20 tokens a second, t2's y 10
        census = EngineCensus(
            (), (), 0, (), 0, (("t1", 100 * i), ("t2", 100 * i)),
            lora_waiting=(("t1", "x", 1), ("t2", "y", 1)),
            lora_running=(("t1", "x", 2), ("t2", "x", 1), ("t2", "y", 1)),
            scheduled_tokens_by_lora=(("t1", "x", 20 * i), ("t2", "y", 10 * i)))
        feed.record_engine(busy, None, census, t0 + i)
    feed.start("r1", 1, "t1", 0, 4, t0 + 7, lora="x")
    snapshot = feed.snapshot(0, num_blocks=40, now=t0 + 7)
    # The last RATE_WINDOW (5 s): 1000 tokens in all, x 100 of them, y 50.
    assert snapshot["now"]["adapters"] == [
        {"adapter": "x", "waiting": 1, "running": 3, "token_share": 0.1},
        {"adapter": "y", "waiting": 1, "running": 1, "token_share": 0.05}]
    assert snapshot["requests"][0]["lora"] == "x"
    own = feed.snapshot(0, 40, t0 + 7, tenant="t1")["now"]["adapters"]
    assert own == [{"adapter": "x", "waiting": 1, "running": 2, "token_share": 0.1}]
    # Idle since the census: nobody waits or runs; the window's tokens still count.
    feed.record_engine(load(0, 0, 0.0, 0, 0, 0), None, None, t0 + 8)
    idle = feed.snapshot(0, 40, t0 + 8)["now"]["adapters"]
    assert [(a["waiting"], a["running"]) for a in idle] == [(0, 0), (0, 0)]
    assert feed.snapshot(0, 40, t0 + 30)["now"]["adapters"] == []


def test_replicas_in_the_snapshot():
    feed = LiveFeed()
    assert feed.snapshot(0, 40, 1.0)["now"]["replicas"] == []  # one engine: no rows
    feed.record_replica(1, True, load(3, 2, 0.5, 0, 0, 0))
    feed.record_replica(0, False, load(0, 0, 0.0, 0, 0, 0))
    feed.record_replica(1, True, load(4, 1, 0.25, 0, 0, 0))  # the latest state wins
    assert feed.snapshot(0, 40, 1.0)["now"]["replicas"] == [
        {"replica": 0, "up": False, "running": 0, "waiting": 0, "kv_usage": 0.0},
        {"replica": 1, "up": True, "running": 4, "waiting": 1, "kv_usage": 0.25}]


def test_segments_through_a_preemption():
    events = [(1.0, "queued", 0), (2.0, "scheduled", 8), (3.0, "first_token", 0),
              (3.0, "scheduled", 1), (4.0, "preempted", 0), (5.0, "scheduled", 9),
              (6.0, "scheduled", 1), (7.0, "finished", 0)]
    segments, chunks = timeline_segments(events, 0.5, 7.5)
    assert segments == [("frontend", 0.5, 1.0), ("queued", 1.0, 2.0), ("prefill", 2.0, 3.0),
                        ("decode", 3.0, 4.0), ("preempted", 4.0, 5.0), ("prefill", 5.0, 6.0),
                        ("decode", 6.0, 7.5)]
    assert chunks == [2.0, 5.0]


def test_buffers_stay_bounded():
    feed = LiveFeed()
    for i in range(live.REQUEST_HISTORY + 50):
        feed.start(f"r{i}", 1, "t", 0, 1, float(i))
        feed.observe(delta(f"r{i}", 1, True, "stop"), float(i) + 0.5)
    feed.start("open", 1, "t", 0, 1, 1e3)
    assert len(feed.requests) == live.REQUEST_HISTORY + 1
    assert ("open", 0) in feed.requests and ("r0", 0) not in feed.requests
    assert len(feed.snapshot(0, 1, 1e3)["requests"]) == live.MAX_ROWS


@pytest.fixture(scope="module")
def server(tiny_folder, tmp_path_factory):
    """The tiny model with LoRA on and one adapter, `ADAPTER`, served by name."""
    adapter = save_random_adapter(tiny_folder, tmp_path_factory.mktemp("adapter") / ADAPTER, 0)
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        model=str(tiny_folder), dtype="float32", kv_cache_memory_bytes=4 << 20,
        max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, enable_lora=True,
        max_loras=2)))
    frontends, thread = start_frontends(engine, ServerConfig(
        port=0, api_keys=(APIKey("key-1", KEY), APIKey("admin", ADMIN_KEY)),
        lora_modules=(f"{ADAPTER}={adapter}",)))
    wait_started(frontends, thread)
    yield engine, frontends.port
    stop_frontends(frontends, thread)


def first_event(port: int, headers: dict, until: Callable[[dict], bool] = lambda event: True,
                limit: int = 1) -> dict:
    """The feed's first event for which `until` holds, within `limit` events (one a second)."""
    with httpx.stream("GET", f"http://127.0.0.1:{port}/dashboard/feed", headers=headers,
                      timeout=10) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                limit -= 1
                if until(event) or not limit:
                    return event
    raise AssertionError("the feed ended without an event")


def test_page_open_feed_keyed(server):
    engine, port = server
    base = f"http://127.0.0.1:{port}"
    page = httpx.get(f"{base}/dashboard")
    assert page.status_code == 200 and "<canvas" in page.text  # open: it holds no data
    assert httpx.get(f"{base}/dashboard/app.js").headers["content-type"].startswith(
        "text/javascript")
    refused = httpx.get(f"{base}/dashboard/feed")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/dashboard/requests/x").status_code == 401
    missing = httpx.get(f"{base}/dashboard/requests/x", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"
    event = first_event(port, {"Authorization": f"Bearer {KEY}"})
    assert event["engine"]["status"] == "ok"
    assert event["now"]["kv_blocks"]["total"] == engine.num_blocks


def run_load(port: int, models: list[str], stop: threading.Event, errors: list,
             key: str = KEY) -> None:
    """A client per model (the base's name or an adapter's) sending completions until told to
    stop."""
    def client(model: str) -> None:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        try:
            while not stop.is_set():
                api.completions.create(model=model, prompt="The quick brown fox " * 8,
                                       max_tokens=24, temperature=0)
        except Exception as e:  # reported by the test
            errors.append(e)

    threads = [threading.Thread(target=client, args=(model,)) for model in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install chromium (.ci/run "
                    "does); Playwright's own browser downloads fail here")
def test_page_in_chromium(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    engine, port = server
    model = engine.model_name
    shots = tmp_path / "screenshots"
    shots.mkdir()
    problems: list[str] = []
    stop, errors = threading.Event(), []
    # Two of the four clients through the adapter: its row in the adapters table.
    load_thread = threading.Thread(target=run_load,
                                   args=(port, [model, model, ADAPTER, ADAPTER], stop, errors))
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.on("console", lambda m: m.type == "error" and problems.append(m.text))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(f"http://127.0.0.1:{port}/dashboard?key={KEY}")
            page.wait_for_function("document.getElementById('status').textContent"
                                   " === 'engine ok'", timeout=10_000)
            assert "key=" not in page.url  # taken into sessionStorage, out of the address bar
            assert page.is_hidden("#replicas-table")  # one engine: no replica rows
            # Under data parallelism (tests/test_data_parallel.py has the feed's rows from a Ray
            # cluster): the page's own update() draws a row per replica, a dead one marked.
            rows = page.evaluate("""() => {
                update({...lastData, steps: [], now: {...lastData.now, replicas: [
                    {replica: 0, up: true, running: 2, waiting: 1, kv_usage: 0.5},
                    {replica: 1, up: false, running: 0, waiting: 0, kv_usage: 0}]}});
                return [...document.querySelectorAll('#replicas tr')].map(
                    (tr) => [tr.className, tr.textContent]);
            }""")
            assert rows == [["", "0up1250.0%"], ["down", "1down000.0%"]]
            # Tenants' shares, and blocks several tenants hold on a row of their own.
            rows = page.evaluate("""() => {
                update({...lastData, steps: [], now: {...lastData.now, token_window_s: 5,
                    tenants: [{tenant: "a", kv_blocks: 12, kv_share: 0.3, token_share: 0.75},
                              {tenant: "b", kv_blocks: 0, kv_share: 0, token_share: null}],
                    kv_shared: {kv_blocks: 2, kv_share: 0.05}}});
                return [...document.querySelectorAll('#tenants tr')].map((tr) =>
                    [...tr.children].map((td) => td.textContent));
            }""")
            assert rows == [["a", "12", "30.0%", "75.0%"], ["b", "0", "0.0%", "–"],
                            ["shared by tenants", "2", "5.0%", "–"]]
            assert page.text_content("#token-window") == "5"
            idle_rate = page.text_content("#step-rate")
            load_thread.start()
            # Numbers move: steps per second and the Gantt's rows, while the load runs.
            page.wait_for_function("parseFloat(document.getElementById('step-rate')"
                                   ".textContent) > 0", timeout=10_000)
            page.wait_for_function("document.querySelectorAll('#gantt .grow').length >= 4",
                                   timeout=10_000)
            # The key's tenant's row: its blocks now, and all the tokens lately (only its load).
            page.wait_for_function("document.querySelector('#tenants td')"
                                   ".textContent === 'key-1'", timeout=10_000)
            page.wait_for_timeout(1500)
            page.screenshot(path=str(shots / "under_load.png"))
            tenant_row = page.evaluate("[...document.querySelectorAll('#tenants tr')].map((tr) =>"
                                       " [...tr.children].map((td) => td.textContent))")
            assert len(tenant_row) == 1 and tenant_row[0][0] == "key-1", tenant_row
            assert tenant_row[0][3] == "100.0%" and tenant_row[0][2].endswith("%"), tenant_row
            # The adapter's row (the key's own requests through it), and the limit.
            page.wait_for_function(f"document.querySelector('#adapters td').textContent"
                                   f" === '{ADAPTER}'", timeout=10_000)
            adapter_rows = page.evaluate("[...document.querySelectorAll('#adapters tr')].map("
                                         "(tr) => [...tr.children].map((td) => td.textContent))")
            assert len(adapter_rows) == 1 and adapter_rows[0][3].endswith("%"), adapter_rows
            assert page.is_visible("#adapters-table")
            assert page.text_content("#max-loras") == "2"
            assert page.locator(f"#gantt .grow .name:has-text(' · {ADAPTER} · ')").count() > 0
            assert idle_rate == "0.0" and float(page.text_content("#step-rate")) > 0
            stop.set()
            load_thread.join(30)
            assert not errors, errors
            # Click a finished request: its timeline (events from arrival to finished).
            page.wait_for_selector("#gantt .grow .reason.length", timeout=10_000)
            page.click("#gantt .grow:has(.reason.length)")
            page.wait_for_selector("#timeline table", timeout=10_000)
            timeline = page.text_content("#timeline")
            assert "arrival" in timeline and "first_token" in timeline and "finished" in timeline
            assert "decode steps" in timeline
            if page.evaluate("lastData.engine.explain"):  # the server has the explain route
                page.wait_for_selector("#explain .cause", timeout=10_000)
                parts = page.text_content("#explain table")
                assert "queue" in parts and "decode" in parts, parts
            page.screenshot(path=str(shots / "request.png"), full_page=True)
            assert page.text_content("#prefix-total").startswith("since start")
        finally:
            stop.set()
            browser.close()
    shutil.copy(shots / "request.png", "/tmp/dashboard.png")
    assert model and not problems, problems


def test_feed_shares_by_tenant(server):
    """Two tenants' load through the real server: the admin's feed has both tenants' rows, their
    token shares summing to 1 and KV shares of the pool; a tenant's key, its own row only; the
    Prometheus series count both."""
    engine, port = server
    stop, errors = threading.Event(), []
    loads = [threading.Thread(target=run_load,
                              args=(port, [engine.model_name] * 4, stop, errors, key))
             for key in (KEY, ADMIN_KEY)]
    for thread in loads:
        thread.start()
    try:
        def both_hold_blocks(event: dict) -> bool:
            return sum(1 for t in event["now"]["tenants"] if t["kv_blocks"]) == 2

        event = first_event(port, {"Authorization": f"Bearer {ADMIN_KEY}"}, both_hold_blocks, 30)
        own = first_event(port, {"Authorization": f"Bearer {KEY}"})
    finally:
        stop.set()
        for thread in loads:
            thread.join(30)
    assert not errors, errors
    now = event["now"]
    assert [t["tenant"] for t in now["tenants"]] == ["admin", "key-1"], now["tenants"]
    assert sum(t["token_share"] for t in now["tenants"]) == pytest.approx(1, abs=1e-3)
    assert all(0 < t["token_share"] < 1 for t in now["tenants"])
    held = sum(t["kv_blocks"] for t in now["tenants"]) + now["kv_shared"]["kv_blocks"]
    assert 0 < held <= engine.num_blocks
    for row in now["tenants"]:
        assert row["kv_share"] == round(row["kv_blocks"] / engine.num_blocks, 4)
    assert [t["tenant"] for t in own["now"]["tenants"]] == ["key-1"]
    assert own["now"]["kv_shared"] is None
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics",
                        headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    for tenant in ("admin", "key-1"):
        tokens = [line for line in metrics.splitlines()
                  if line.startswith("treadle:scheduled_tokens_total{")
                  and f'tenant="{tenant}"' in line]
        assert len(tokens) == 1 and float(tokens[0].split()[-1]) > 0, tokens
        assert f'treadle:tenant_kv_cache_blocks{{model_name="{engine.model_name}",' \
               f'tenant="{tenant}"}}' in metrics


def test_feeds_are_bounded_and_released(server, monkeypatch):
    engine, port = server
    monkeypatch.setattr(router, "MAX_FEEDS", 1)
    url, headers = f"http://127.0.0.1:{port}/dashboard/feed", {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=10) as client:
        first = open_feed(client, url, headers)  # once earlier tests' feeds have ended
        second = client.get(url, headers=headers)
        assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_feeds"
        first.close()
        open_feed(client, url, headers).close()  # the closed one's slot is free again


def open_feed(client: httpx.Client, url: str, headers: dict) -> httpx.Response:
    """A feed, as soon as a slot is free (within 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        response = client.send(client.build_request("GET", url, headers=headers), stream=True)
        if response.status_code == 200:
            return response
        response.close()
        assert time.monotonic() < deadline, f"no feed within 5 s: {response.status_code}"
        time.sleep(0.1)


def test_package_ships_the_page():
    static = Path(router.__file__).parent / "static"
    assert {p.name for p in static.iterdir()} >= {"index.html", "app.js", "style.css"}
