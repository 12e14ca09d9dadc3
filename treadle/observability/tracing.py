"""OpenTelemetry spans per request (`--otlp-traces-endpoint`, vLLM's flag).

Each finished sample becomes one `llm_request` span (kind SERVER, from the frontend's arrival to
the last token) with three children from the timeline the engine records: `queue` (the engine
queue until first scheduled), `prefill` (until the first token) and `decode` (until finished);
preemptions are events on the parent. Attributes use the names vLLM's tracing uses (gen_ai.*),
plus the tenant. Both processes stamp CLOCK_MONOTONIC; spans need wall time, so each timestamp
is shifted by one offset read when the span is built. Spans leave through the SDK's
BatchSpanProcessor: its own thread exports them, off the request path.

The SDK and the exporter are an optional extra (`pip install 'treadle[otlp]'`), imported only
when tracing is on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

# vLLM's SpanAttributes (vllm/tracing.py), themselves from OpenTelemetry's GenAI conventions.
REQUEST_ID = "gen_ai.request.id"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_N = "gen_ai.request.n"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
TENANT = "treadle.tenant"
SAMPLE_INDEX = "treadle.sample_index"

INSTALL_HINT = "pip install 'treadle[otlp]'"


def otlp_exporter(endpoint: str) -> SpanExporter:
    """The OTLP span exporter for `endpoint`: over HTTP when it names the /v1/traces path, else
    over gRPC (the collector's port 4317). ValueError saying how to install it when missing."""
    try:
        if endpoint.rstrip("/").endswith("/v1/traces"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise ValueError(f"otlp_traces_endpoint needs the OpenTelemetry SDK and OTLP exporter "
                         f"({e.name} is missing): {INSTALL_HINT}") from None
    return OTLPSpanExporter(endpoint=endpoint)


class RequestTracer:
    """Turns finished samples' timelines into spans, exported in the background."""

    def __init__(self, exporter: SpanExporter, model_name: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.provider = TracerProvider(resource=Resource.create({"service.name": "treadle"}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("treadle")
        self.model_name = model_name

    def record(self, timeline: dict, arrival: float, finished: float, params: Any) -> None:
        """One sample: `timeline` as the observer keeps it (events' `t_s` after `arrival`),
        `arrival` and `finished` on CLOCK_MONOTONIC, `params` the request's SamplingParams
        (max_tokens, temperature, top_p, top_k, n read from it)."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        offset_ns = time.time_ns() - time.monotonic_ns()

        def wall(t_s: float) -> int:
            return int((arrival + t_s) * 1e9) + offset_ns

        events = timeline["events"]
        first = {}  # event kind -> its first time, seconds after arrival
        for event in events:
            first.setdefault(event["event"], event["t_s"])
        end_s = finished - arrival
        queued = first.get("queued", 0.0)
        scheduled, first_token = first.get("scheduled"), first.get("first_token")
        attributes = {
            REQUEST_ID: timeline["request_id"], SAMPLE_INDEX: timeline["index"],
            RESPONSE_MODEL: self.model_name, TENANT: timeline["tenant"],
            RESPONSE_FINISH_REASONS: [str(timeline["finish_reason"])],
            USAGE_PROMPT_TOKENS: timeline["prompt_tokens"],
            USAGE_COMPLETION_TOKENS: timeline["output_tokens"],
            USAGE_CACHED_TOKENS: timeline["cached_tokens"], LATENCY_E2E: end_s,
            LATENCY_TIME_IN_QUEUE: (end_s if scheduled is None else scheduled) - queued,
            **{name: value for name, field in (
                (REQUEST_MAX_TOKENS, "max_tokens"), (REQUEST_TEMPERATURE, "temperature"),
                (REQUEST_TOP_P, "top_p"), (REQUEST_TOP_K, "top_k"), (REQUEST_N, "n"))
               if (value := getattr(params, field, None)) is not None}}
        if first_token is not None:
            attributes[LATENCY_TIME_TO_FIRST_TOKEN] = first_token
            attributes[LATENCY_TIME_IN_MODEL_DECODE] = end_s - first_token
        if scheduled is not None:
            attributes[LATENCY_TIME_IN_MODEL_PREFILL] = (first_token or end_s) - scheduled
            attributes[LATENCY_TIME_IN_MODEL_INFERENCE] = end_s - scheduled
        root = self.tracer.start_span("llm_request", kind=SpanKind.SERVER,
                                      start_time=wall(0.0), attributes=attributes)
        for event in events:
            if event["event"] == "preempted":
                root.add_event("preempted", timestamp=wall(event["t_s"]))
        phases = [("queue", queued, scheduled if scheduled is not None else end_s)]
        if scheduled is not None:
            phases.append(("prefill", scheduled, first_token if first_token is not None
                           else end_s))
        if first_token is not None:
            phases.append(("decode", first_token, end_s))
        parent = set_span_in_context(root)
        for name, start, end in phases:
            self.tracer.start_span(name, context=parent, start_time=wall(start)).end(
                end_time=wall(end))
        root.end(end_time=wall(end_s))

    def shutdown(self) -> None:
        """Export what is buffered, then stop the exporting thread."""
        self.provider.shutdown()


def request_tracer(endpoint: str | None, model_name: str) -> RequestTracer | None:
    """The tracer `--otlp-traces-endpoint` asks for; None when tracing is off."""
    return None if endpoint is None else RequestTracer(otlp_exporter(endpoint), model_name)
