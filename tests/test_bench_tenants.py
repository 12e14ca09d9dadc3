"""`treadle bench serve --tenants/--slo`: tenant assignment, objectives on the wire, Jain's
fairness index over normalised service, the tenant report."""

from __future__ import annotations

import pytest

from treadle.bench.metrics import (
    RequestRecord,
    jain_index,
    max_min_shares,
    normalised_service,
    tenant_metrics,
)
from treadle.bench.serve import (
    OpenAIBackend,
    assign_tenants,
    format_tenants,
    parse_slo,
    parse_tenants,
)
from treadle.bench.workloads import BenchRequest


def test_jain_index():
    assert jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([1.0, 2.0]) == pytest.approx(9 / 10)
    assert jain_index([0.0, 0.0]) == 1.0
    with pytest.raises(ValueError):
        jain_index([])


def test_max_min_shares_water_fills():
    assert max_min_shares(10, {"a": 2, "b": 100, "c": 100}) == \
        pytest.approx({"a": 2, "b": 4, "c": 4})
    assert max_min_shares(9, {"a": 5, "b": 5, "c": 5}) == pytest.approx({"a": 3, "b": 3, "c": 3})
    assert max_min_shares(100, {"a": 1, "b": 2}) == pytest.approx({"a": 1, "b": 2})


def record(tenant: str, start: float, ttft: float, e2e: float, prompt: int = 10,
           output: int = 10) -> RequestRecord:
    return RequestRecord(start=start, prompt_tokens=prompt, success=True, output_tokens=output,
                         ttft=ttft, e2e=e2e, tenant=tenant)


def test_normalised_service_tells_fair_from_fcfs():
    # A light tenant (one request) and a heavy one (several), all sent at 0, each 20 tokens.
    # Fair: both served at the same rate while both have work (the window, to 2 s): the light
    # tenant gets its whole demand, the heavy one the rest: J = 1.
    fair = [record("light", 0, 1.0, 2.0), record("heavy", 0, 1.0, 2.0),
            record("heavy", 0, 3.0, 4.0)]
    x = normalised_service(fair)
    assert x["light"] == pytest.approx(1.0) and x["heavy"] == pytest.approx(1.0)
    assert jain_index(list(x.values())) == pytest.approx(1.0)
    # FCFS behind the heavy tenant: the light request's first token comes at 4.5 s; the window
    # ends when heavy is done (4 s), by which light got nothing, heavy all: J = 1/2.
    fcfs = [record("heavy", 0, i, i + 1.0) for i in range(4)] + [record("light", 0, 4.5, 5.0)]
    x = normalised_service(fcfs)
    assert x["light"] == pytest.approx(0.0)
    assert jain_index(list(x.values())) == pytest.approx(0.5)


def test_tenant_metrics_report():
    records = [record("a", 0, 0.1, 1.0), record("a", 0, 0.2, 1.0), record("b", 0, 0.3, 1.0),
               RequestRecord(start=0, prompt_tokens=5, error="HTTP 429", tenant="b")]
    report = tenant_metrics(records, 2.0, {"ttft": 250})
    assert set(report["tenants"]) == {"a", "b"}
    a, b = report["tenants"]["a"], report["tenants"]["b"]
    assert (a["successful"], a["failed"], b["successful"], b["failed"]) == (2, 0, 1, 1)
    assert a["output_throughput"] == pytest.approx(10.0)
    assert a["goodput"]["good_requests"] == 2 and b["goodput"]["good_requests"] == 0
    assert a["ttft_ms"]["median"] == pytest.approx(150.0)
    assert 0 < report["jain_fairness"] <= 1
    text = format_tenants({"tenants": report["tenants"],
                           "jain_fairness": report["jain_fairness"]})
    assert "Jain" in text and "\na " in text


def test_tenants_and_objectives_go_on_the_wire():
    assert parse_tenants("heavy:10,light:1") == {"heavy": 10.0, "light": 1.0}
    for bad in ("heavy", "heavy:0", "heavy:x", ":1"):
        with pytest.raises(ValueError):
            parse_tenants(bad)
    assert parse_slo("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError):
        parse_slo("e2el:5")
    names = assign_tenants(2000, {"heavy": 10, "light": 1}, seed=3)
    assert names == assign_tenants(2000, {"heavy": 10, "light": 1}, seed=3)
    assert 0.85 < names.count("heavy") / 2000 < 0.95
    requests = [BenchRequest(prompt_token_ids=[1, 2], output_len=4) for _ in range(2)]
    backend = OpenAIBackend("http://x", "m", requests, "ids", True, tenants=["a", "b"],
                            tenant_keys={"b": "kb"}, objectives={"ttft": 500.0})
    assert backend.payloads[0]["user"] == "a" and "user" not in backend.payloads[1]
    assert backend.request_headers == [None, {"Authorization": "Bearer kb"}]
    assert all(p["ttft_ms"] == 500.0 for p in backend.payloads)
