"""OpenTelemetry spans per request: a live in-thread server traced into the SDK's in-memory
exporter, and the OTLP/HTTP exporter against a collector stand-in on loopback."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import openai
import pytest
from frontends import start_frontends, stop_frontends, wait_started
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from treadle.config import AsyncEngineConfig, ServerConfig, build_config
from treadle.frontend.async_engine import AsyncEngine
from treadle.observability.tracing import RequestTracer, otlp_exporter, request_tracer


@pytest.fixture(scope="module")
def traced(tiny_folder):
    engine = AsyncEngine(build_config(AsyncEngineConfig, dict(
        model=str(tiny_folder), dtype="float32", kv_cache_memory_bytes=16 << 20)))
    exporter = InMemorySpanExporter()
    engine.observer.tracer = RequestTracer(exporter, engine.model_name)
    frontends, thread = start_frontends(engine, ServerConfig(port=0, grpc_port=None))
    wait_started(frontends, thread)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{frontends.port}/v1", api_key="none")
    yield client, engine, exporter
    stop_frontends(frontends, thread)


def test_one_span_per_request_with_queue_prefill_decode(traced):
    client, engine, exporter = traced
    before = time.time_ns()
    response = client.completions.create(model=engine.model_name, prompt="The sky is",
                                         max_tokens=6, temperature=0.0, user="alice",
                                         extra_body={"ignore_eos": True})
    after = time.time_ns()
    engine.observer.tracer.provider.force_flush()
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "llm_request"]
    assert len(roots) == 1
    root = roots[0]
    children = sorted((s for s in spans if s.parent is not None
                       and s.parent.span_id == root.context.span_id), key=lambda s: s.start_time)
    assert [s.name for s in children] == ["queue", "prefill", "decode"]
    assert all(s.context.trace_id == root.context.trace_id for s in children)
    # Monotonic stamps mapped to wall time: inside the client's own wall-clock window.
    assert before <= root.start_time <= children[0].start_time
    assert children[-1].end_time == root.end_time <= after
    for earlier, later in zip(children, children[1:], strict=False):
        assert earlier.end_time == later.start_time and earlier.start_time <= earlier.end_time
    a = root.attributes
    assert response.id.endswith(a["gen_ai.request.id"])
    assert a["gen_ai.usage.prompt_tokens"] == response.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == response.usage.completion_tokens == 6
    assert a["gen_ai.response.model"] == engine.model_name
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["treadle.tenant"] == "alice"
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"]) == (6, 0.0)
    e2e = (root.end_time - root.start_time) / 1e9
    assert a["gen_ai.latency.e2e"] == pytest.approx(e2e, abs=1e-5)
    decode = (children[2].end_time - children[2].start_time) / 1e9
    assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(decode, abs=1e-5)
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= e2e


def test_every_sample_of_a_streamed_request_is_traced(traced):
    client, engine, exporter = traced
    exporter.clear()
    stream = client.completions.create(model=engine.model_name, prompt="Once upon", n=2,
                                       max_tokens=3, temperature=1.0, seed=7, stream=True)
    for _ in stream:
        pass
    engine.observer.tracer.provider.force_flush()
    roots = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]
    assert sorted(s.attributes["treadle.sample_index"] for s in roots) == [0, 1]
    assert len({s.attributes["gen_ai.request.id"] for s in roots}) == 1


def test_tracing_is_off_without_an_endpoint():
    assert request_tracer(None, "m") is None


class Collector(BaseHTTPRequestHandler):
    received: list[bytes] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Collector.received.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_otlp_http_exporter_sends_the_spans():
    server = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tracer = request_tracer(f"http://127.0.0.1:{server.server_port}/v1/traces", "m")
        now = time.monotonic()
        timeline = {"request_id": "r1", "index": 0, "tenant": "default", "prompt_tokens": 3,
                    "output_tokens": 2, "cached_tokens": 0, "finish_reason": "stop",
                    "events": [{"t_s": 0.0, "event": "arrival"},
                               {"t_s": 0.01, "event": "queued"},
                               {"t_s": 0.02, "event": "scheduled", "tokens": 3},
                               {"t_s": 0.03, "event": "first_token"},
                               {"t_s": 0.05, "event": "finished"}]}
        tracer.record(timeline, now - 0.05, now, None)
        tracer.shutdown()  # exports what is buffered
    finally:
        server.shutdown()
    request = ExportTraceServiceRequest()
    request.ParseFromString(b"".join(Collector.received))
    spans = [s for r in request.resource_spans for ss in r.scope_spans for s in ss.spans]
    assert sorted(s.name for s in spans) == ["decode", "llm_request", "prefill", "queue"]


def test_otlp_grpc_exporter_is_chosen_for_a_bare_endpoint():
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    assert isinstance(otlp_exporter("http://127.0.0.1:4317"), OTLPSpanExporter)
