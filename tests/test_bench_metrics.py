"""Serving-benchmark metrics on hand-computed examples, the arrival generator's statistics, and
the streaming client's reading of SSE chunks (over httpx's mock transport, no server)."""

from __future__ import annotations

import asyncio
import json
import statistics

import httpx
import pytest

from treadle.bench.metrics import (
    RequestRecord,
    compute_metrics,
    latency_stats,
    meets_slos,
    parse_goodput,
    tpot,
)
from treadle.bench.serve import arrival_times, send_request


def records() -> list[RequestRecord]:
    return [
        # 4 tokens: first at 100 ms, then gaps of 50, 50, 100 ms -> e2e 300 ms
        RequestRecord(start=0.0, prompt_tokens=10, success=True, output_tokens=4, ttft=0.1,
                      itl=[0.05, 0.05, 0.1], e2e=0.3),
        # one token at 200 ms: no TPOT, no ITL
        RequestRecord(start=0.5, prompt_tokens=5, success=True, output_tokens=1, ttft=0.2,
                      e2e=0.2),
        RequestRecord(start=1.0, prompt_tokens=7, error="HTTP 500: boom"),
    ]


def test_tpot_is_decode_time_over_tokens_after_the_first():
    a, b, _ = records()
    assert tpot(a) == pytest.approx((0.3 - 0.1) / 3)
    assert tpot(b) is None


def test_percentiles_interpolate_linearly():
    stats = latency_stats([0.001, 0.002, 0.003, 0.004])
    # ranks 0..3: p90 at rank 2.7 -> 3 + 0.7 * (4 - 3) ms; p99 at rank 2.97
    assert stats == pytest.approx({"mean": 2.5, "median": 2.5, "p90": 3.7, "p99": 3.97})
    assert latency_stats([0.005]) == pytest.approx(
        {"mean": 5.0, "median": 5.0, "p90": 5.0, "p99": 5.0})
    assert latency_stats([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def test_metrics_of_a_run():
    m = compute_metrics(records(), duration=2.0)
    assert (m["successful"], m["failed"]) == (2, 1)
    # failed requests' prompts count nowhere
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (15, 5)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(10.0)
    assert m["ttft_ms"] == pytest.approx({"mean": 150, "median": 150, "p90": 190, "p99": 199})
    only = 1e3 * 0.2 / 3
    assert m["tpot_ms"] == pytest.approx({"mean": only, "median": only, "p90": only,
                                          "p99": only})
    # ITLs pooled over requests: 50, 50, 100 ms; p90 at rank 1.8 -> 50 + 0.8 * 50
    assert m["itl_ms"] == pytest.approx({"mean": 200 / 3, "median": 50, "p90": 90, "p99": 99})
    assert m["e2e_ms"] == pytest.approx({"mean": 250, "median": 250, "p90": 290, "p99": 299})
    assert m["goodput"] is None


def test_goodput_counts_requests_within_every_slo():
    a, b, failed = records()
    # a: ttft 100, tpot 66.7, e2e 300; b: ttft 200, tpot 0 (one token), e2e 200
    cases = [({"ttft": 150, "tpot": 70}, 1), ({"ttft": 250, "tpot": 70}, 2),
             ({"tpot": 60}, 1), ({"e2el": 250}, 1), ({"ttft": 200, "e2el": 300}, 2),
             ({"ttft": 99}, 0)]
    for slos, good in cases:
        m = compute_metrics(records(), duration=2.0, slos=slos)
        assert m["goodput"]["good_requests"] == good, slos
        assert m["goodput"]["request_goodput"] == pytest.approx(good / 2.0)
    assert not meets_slos(failed, {"ttft": 1e9})


def test_goodput_slos_parse():
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:2000"]) == \
        {"ttft": 500.0, "tpot": 50.5, "e2el": 2000.0}
    assert parse_goodput([]) == {}
    for bad in ("ttft", "itl:5", "ttft:fast", "tpot:0"):
        with pytest.raises(ValueError, match="goodput SLO"):
            parse_goodput([bad])


def test_arrivals_at_infinite_rate_are_all_at_once():
    assert arrival_times(5, float("inf")) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_the_rate_and_the_burstiness(burstiness):
    times = arrival_times(20_000, request_rate=4.0, burstiness=burstiness, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert times == arrival_times(20_000, 4.0, burstiness, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # gamma(k, 1 / (rate k)): mean 1 / rate, coefficient of variation 1 / sqrt(k)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    cv = statistics.stdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(burstiness ** -0.5, rel=0.05)


def test_arrivals_reject_bad_parameters():
    for rate, burstiness in ((0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)):
        with pytest.raises(ValueError):
            arrival_times(3, rate, burstiness)


def sse(*events: dict | str) -> bytes:
    """An SSE body: dicts as JSON data, "[DONE]" as data, ":..." as a comment line."""
    lines = [f"data: {json.dumps(e)}" if isinstance(e, dict)
             else e if e.startswith(":") else f"data: {e}" for e in events]
    return "".join(f"{line}\n\n" for line in lines).encode()


def token(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def stream(body: bytes, status: int = 200, clock_ticks: list[float] | None = None
           ) -> RequestRecord:
    ticks = iter(clock_ticks or [0.0] * 100)

    async def go() -> RequestRecord:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, "http://test/v1/completions", {}, prompt_len=9,
                                      start=1.5, clock=lambda: next(ticks))

    return asyncio.run(go())


def test_stream_times_chunks_and_takes_tokens_from_usage():
    body = sse(token(" a"), token(" b c"), ": ping", token(" d", "length"),
               {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 5}}, "[DONE]")
    # clock: sent at 10.0; chunks at 10.1, 10.15, 10.3
    r = stream(body, clock_ticks=[10.0, 10.1, 10.15, 10.3])
    assert r.success and r.start == 1.5 and r.error == ""
    assert r.ttft == pytest.approx(0.1)
    assert r.itl == pytest.approx([0.05, 0.15])  # one gap per chunk
    assert r.e2e == pytest.approx(0.3)
    # 5 real tokens in 3 chunks: TPOT over tokens, not chunks
    assert (r.prompt_tokens, r.output_tokens) == (8, 5)
    assert tpot(r) == pytest.approx(0.2 / 4)


def test_stream_without_usage_counts_token_chunks():
    # the closing chunk with no text carries no token and no timestamp
    r = stream(sse(token(" a"), token(""), token(" b"), token("", "stop"), "[DONE]"),
               clock_ticks=[0.0, 1.0, 2.0, 3.0, 99.0])
    assert r.success and (r.prompt_tokens, r.output_tokens) == (9, 3)
    assert r.e2e == pytest.approx(3.0) and r.itl == pytest.approx([1.0, 1.0])


def test_stream_errors_fail_the_request_with_their_message():
    r = stream(sse(token(" a"), {"error": {"message": "engine died", "code": 500}}))
    assert not r.success and r.error == "engine died"
    body = json.dumps({"error": {"message": "max_tokens is too large", "type": "invalid"}})
    r = stream(body.encode(), status=400)
    assert not r.success and r.error == "HTTP 400: max_tokens is too large"
    r = stream(b"Bad Gateway", status=502)
    assert r.error == "HTTP 502: Bad Gateway"
    r = stream(sse("[DONE]"))
    assert not r.success and "no token" in r.error


def test_connection_errors_fail_the_request():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
            return await send_request(client, "http://test/v1/completions", {}, 3, 0.0)

    r = asyncio.run(go())
    assert not r.success and r.error == "ConnectError: connection refused"
