"""RequestObserver: what the frontend records of each request as its tokens arrive.

Latency metrics (TTFT, ITL, E2E, the engine's queue/prefill/decode split) on the frontend's
clock, as a client would measure them; goodput against each request's objectives; at a sample's
end its timeline (for GET /debug/requests/{id} and /v1/requests/{id}/explain) and one log line
with its breakdown (observability/explain.py). A REST route marks when its response finished
(`response_finished`), which ends the breakdown's stream part.

Timelines are keyed by the request's id (a client's sanitised X-Request-Id, or the server's), or
`id/index` for one of n samples; `find` also takes a response's id (`cmpl-` or `chatcmpl-` and
the id).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from treadle.config import ObservabilityConfig
from treadle.core.request import DEFAULT_TENANT, RequestStats
from treadle.frontend.output_processor import RequestState, SampleDelta
from treadle.observability.explain import part_seconds
from treadle.observability.metrics import ServerMetrics
from treadle.observability.tracing import request_tracer
from treadle.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class RequestInfo:
    """What the observer keeps about one request in flight beyond its tokens."""

    tenant: str
    label: str  # the tenant's metrics label (bounded)
    ttft: float | None  # objectives in seconds
    tpot: float | None
    arrival: float = field(default_factory=time.monotonic)  # frontend clock: handed over
    received: float | None = None  # when the frontend received it (None: at `arrival`)
    lora: str | None = None  # its LoRA adapter's name, for the log line and timeline (None: the
    # base model)
    # Per sample index: (first, last) token times, for TTFT, ITL and the request log.
    token_times: dict[int, tuple[float, float]] = field(default_factory=dict)


class RequestObserver:
    """Not thread-safe: the caller locks."""

    def __init__(self, metrics: ServerMetrics, config: ObservabilityConfig,
                 tokenizer: Tokenizer) -> None:
        self.metrics = metrics
        self.config = config
        self.tracer = request_tracer(config.otlp_traces_endpoint, metrics.model_name)
        self.tokenizer = tokenizer  # decodes the prompt for the log line, with log_prompts
        self.requests: dict[str, RequestInfo] = {}
        # The last finished samples' timelines, by `id` (or `id/index` for one of n samples),
        # and how many each request id (before any `/`) holds, so that no new request takes it.
        self.timelines: OrderedDict[str, dict] = OrderedDict()
        self.held_ids: dict[str, int] = {}

    def start(self, request_id: str, tenant: str, ttft: float | None, tpot: float | None,
              received: float | None = None, lora: str | None = None) -> None:
        """`received`: when the frontend received the request (time.monotonic()), for the
        breakdown's frontend part; None: now. `lora`: its adapter's name (None: the base)."""
        self.requests[request_id] = RequestInfo(tenant, self.metrics.tenant_label(tenant),
                                                ttft, tpot, received=received, lora=lora)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def find(self, name: str, tenant: str | None = None) -> dict | None:
        """A recently finished sample's timeline by its id (`id/index` for one of n samples),
        or by the response's id (`cmpl-` or `chatcmpl-` and the id); only `tenant`'s (None:
        anyone's)."""
        names = [name] + [name.removeprefix(prefix) for prefix in ("cmpl-", "chatcmpl-")
                          if name.startswith(prefix)]
        return next((t for t in map(self.timelines.get, names)
                     if t is not None and tenant in (None, t["tenant"])), None)

    def holds(self, request_id: str) -> bool:
        """A recently finished request's timeline is kept under `request_id`."""
        return request_id in self.held_ids

    def response_finished(self, request_id: str) -> list[dict]:
        """The REST response of engine request `request_id` is written: mark the timelines of
        its samples (those not yet evicted); returns them."""
        now = time.monotonic()
        samples, index = [self.timelines.get(request_id)], 0
        while (sample := self.timelines.get(f"{request_id}/{index}")) is not None:
            samples.append(sample)
            index += 1
        timelines = [t for t in samples if t is not None]
        for timeline in timelines:
            timeline["response_end_s"] = round(now - timeline["arrival_monotonic"], 6)
        return timelines

    def tenant_label(self, request_id: str | None) -> str:
        info = self.requests.get(request_id) if request_id is not None else None
        return info.label if info is not None else self.metrics.tenant_label(DEFAULT_TENANT)

    def observe(self, delta: SampleDelta, state: RequestState) -> None:
        """One sample's update: latency metrics; at its end, goodput, timeline and log line."""
        m, now = self.metrics, time.monotonic()
        info = self.requests.get(delta.request_id)
        if info is None:  # not started here (cannot happen while the caller holds its lock)
            return
        tenant = info.label
        if delta.token_ids:
            first, last = info.token_times.get(delta.index, (None, None))
            if last is None:
                m.labels(m.ttft, tenant=tenant).observe(now - info.arrival,
                                                        exemplar(delta.request_id))
                if delta.index == 0:
                    m.labels(m.prompt_tokens, tenant=tenant).inc(len(state.prompt_token_ids))
            else:
                m.labels(m.itl, tenant=tenant).observe(now - last)
            info.token_times[delta.index] = (first or now, now)
            m.labels(m.generation_tokens, tenant=tenant).inc(len(delta.token_ids))
        if not delta.finished:
            return
        m.labels(m.request_success, finished_reason=delta.finish_reason, tenant=tenant).inc()
        m.labels(m.e2e, tenant=tenant).observe(now - info.arrival, exemplar(delta.request_id))
        if delta.finish_reason == "queue_timeout":
            m.labels(m.queue_timeouts, tenant=tenant).inc()
        if delta.timings is not None:
            for metric, seconds in zip((m.queue_time, m.prefill_time, m.decode_time),
                                       delta.timings, strict=True):
                m.labels(metric, tenant=tenant).observe(seconds)
        first_token = info.token_times.get(delta.index, (None, None))[0]
        if info.ttft is not None or info.tpot is not None:
            m.labels(m.with_objectives, tenant=tenant).inc()
            num_tokens = len(state.samples[delta.index].token_ids)
            if delta.finish_reason in ("stop", "length") and meets_objectives(
                    info, first_token, now, num_tokens):
                m.labels(m.goodput, tenant=tenant).inc()
        self._record_finish(delta, state, info, first_token, now)

    def _record_finish(self, delta: SampleDelta, state: RequestState, info: RequestInfo,
                       first_token: float | None, now: float) -> None:
        sample, arrival = state.samples[delta.index], info.arrival
        name = delta.request_id if len(state.samples) == 1 else f"{delta.request_id}/{delta.index}"
        ttft = None if first_token is None else round(first_token - arrival, 6)
        received = arrival if info.received is None else info.received
        # Both clocks are CLOCK_MONOTONIC, shared by the frontend and the engine process.
        if name not in self.timelines:
            self._count_id(name, 1)
        self.timelines[name] = timeline = {
            "request_id": delta.request_id, "index": delta.index, "tenant": info.tenant,
            "lora": info.lora,
            "prompt_tokens": len(state.prompt_token_ids), "output_tokens": len(sample.token_ids),
            "cached_tokens": state.num_cached_tokens, "finish_reason": delta.finish_reason,
            "ttft_s": ttft, "e2e_s": round(now - arrival, 6),
            "events": [{"t_s": 0.0, "event": "arrival"}] + [
                {"t_s": round(t - arrival, 6), "event": kind, **({"tokens": n} if n else {})}
                for t, kind, n in delta.events or ()],
            # For explain (observability/explain.py): the t_s origin on CLOCK_MONOTONIC, the
            # frontend's time before it, the engine's stats, the REST response's end.
            "arrival_monotonic": round(arrival, 6), "frontend_s": round(arrival - received, 6),
            **stats_fields(delta.stats, arrival,
                           sum(kind == "preempted" for _, kind, _ in delta.events or ())),
            "response_end_s": None}
        if self.tracer is not None:  # spans built here, exported by the SDK's own thread
            self.tracer.record(self.timelines[name], arrival, now, state.params)
        while len(self.timelines) > self.config.max_timelines:
            self._count_id(self.timelines.popitem(last=False)[0], -1)
        prompt = (f" prompt={self.tokenizer.decode(state.prompt_token_ids)!r}"
                  if self.config.log_prompts else "")
        parts = ", ".join(f"{part} {seconds:.3f}"
                          for part, seconds in part_seconds(timeline).items())
        adapter = "" if info.lora is None else f", lora {info.lora}"
        logger.info("request %s finished: %s, tenant %s%s, prompt %d tokens (%d cached), "
                    "output %d tokens, ttft %s s, e2e %.3f s (s: %s)%s", name,
                    delta.finish_reason, info.tenant, adapter, len(state.prompt_token_ids),
                    state.num_cached_tokens, len(sample.token_ids),
                    "-" if ttft is None else f"{ttft:.3f}", now - arrival, parts, prompt)


    def _count_id(self, name: str, change: int) -> None:
        request_id = name.partition("/")[0]
        left = self.held_ids.get(request_id, 0) + change
        if left:
            self.held_ids[request_id] = left
        else:
            del self.held_ids[request_id]


def stats_fields(stats: RequestStats | None, arrival: float, num_preemptions: int) -> dict:
    """The engine's RequestStats as timeline fields (times relative to `arrival`); None (the
    frontend aborted it before the engine reported): zeros."""
    stats = stats or RequestStats()
    steps = stats.decode_steps
    return {
        "queue": {"waiting_ahead": stats.waiting_ahead, "running_ahead": stats.running_ahead,
                  "tokens_ahead": stats.tokens_ahead, "top_tenant": stats.top_tenant,
                  "top_tenant_kv_share": round(stats.top_tenant_kv_share, 4),
                  "lora_cap_steps": stats.lora_cap_steps},
        "prefill_chunks": [{"t_s": round(t - arrival, 6), "tokens": tokens, "others": others,
                            "others_prefill_tokens": others_prefill, "step_s": round(step, 6)}
                           for t, tokens, others, others_prefill, step in stats.prefill_chunks],
        "preemptions": {"count": num_preemptions, "recompute_tokens": stats.recompute_tokens,
                        "prefill_s": round(stats.preempted_prefill_s, 6),
                        "decode_s": round(stats.preempted_decode_s, 6)},
        "decode": {"steps": steps,
                   "avg_batch": round(stats.decode_batch_sum / steps, 3) if steps else 0.0,
                   "steps_with_prefill": stats.decode_mixed_steps,
                   "with_prefill_s": round(stats.decode_mixed_s, 6),
                   "decode_only_s": round(stats.decode_only_s, 6),
                   "draft_tokens": stats.draft_tokens,
                   "accepted_tokens": stats.accepted_tokens}}


def exemplar(request_id: str) -> dict[str, str]:
    """The request id as an OpenMetrics exemplar (shown on /metrics to a client that asks for
    OpenMetrics): from a slow bucket to its `explain`. A label set holds at most 128 characters,
    and ids may have 128."""
    return {"request_id": request_id[:118]}


def meets_objectives(info: RequestInfo, first_token: float | None, finished: float,
                     num_tokens: int) -> bool:
    """Whether a sample met its TTFT (arrival to first token) and TPOT ((finish - first token)
    / (tokens - 1); 0 for one token) objectives, on the frontend's clock."""
    if first_token is None:
        return False
    tpot = (finished - first_token) / (num_tokens - 1) if num_tokens > 1 else 0.0
    return ((info.ttft is None or first_token - info.arrival <= info.ttft)
            and (info.tpot is None or tpot <= info.tpot))
