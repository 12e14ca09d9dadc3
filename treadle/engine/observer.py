"""RequestObserver: what the frontend records of each request as its tokens arrive.

Latency metrics (TTFT, ITL, E2E, the engine's queue/prefill/decode split) on the frontend's
clock, as a client would measure them; goodput against each request's objectives; at a sample's
end its timeline (for GET /debug/requests/{id}) and one log line.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from treadle.config import ObservabilityConfig
from treadle.engine.output_processor import RequestState, SampleDelta
from treadle.engine.request import DEFAULT_TENANT
from treadle.observability.metrics import ServerMetrics
from treadle.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class RequestInfo:
    """What the observer keeps about one request in flight beyond its tokens."""

    tenant: str
    label: str  # the tenant's metrics label (bounded)
    ttft: float | None  # objectives in seconds
    tpot: float | None
    arrival: float = field(default_factory=time.monotonic)  # frontend clock
    # Per sample index: (first, last) token times, for TTFT, ITL and the request log.
    token_times: dict[int, tuple[float, float]] = field(default_factory=dict)


class RequestObserver:
    """Not thread-safe: the caller locks."""

    def __init__(self, metrics: ServerMetrics, config: ObservabilityConfig,
                 tokenizer: Tokenizer) -> None:
        self.metrics = metrics
        self.config = config
        self.tokenizer = tokenizer  # decodes the prompt for the log line, with log_prompts
        self.requests: dict[str, RequestInfo] = {}
        # The last finished samples' timelines, by `id` (or `id/index` for one of n samples).
        self.timelines: OrderedDict[str, dict] = OrderedDict()

    def start(self, request_id: str, tenant: str, ttft: float | None, tpot: float | None
              ) -> None:
        self.requests[request_id] = RequestInfo(tenant, self.metrics.tenant_label(tenant),
                                                ttft, tpot)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

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
                m.labels(m.ttft, tenant=tenant).observe(now - info.arrival)
                if delta.index == 0:
                    m.labels(m.prompt_tokens, tenant=tenant).inc(len(state.prompt_token_ids))
            else:
                m.labels(m.itl, tenant=tenant).observe(now - last)
            info.token_times[delta.index] = (first or now, now)
            m.labels(m.generation_tokens, tenant=tenant).inc(len(delta.token_ids))
        if not delta.finished:
            return
        m.labels(m.request_success, finished_reason=delta.finish_reason, tenant=tenant).inc()
        m.labels(m.e2e, tenant=tenant).observe(now - info.arrival)
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
        # Both clocks are CLOCK_MONOTONIC, shared by the frontend and the engine process.
        self.timelines[name] = {
            "request_id": delta.request_id, "index": delta.index, "tenant": info.tenant,
            "prompt_tokens": len(state.prompt_token_ids), "output_tokens": len(sample.token_ids),
            "cached_tokens": state.num_cached_tokens, "finish_reason": delta.finish_reason,
            "ttft_s": ttft, "e2e_s": round(now - arrival, 6),
            "events": [{"t_s": 0.0, "event": "arrival"}] + [
                {"t_s": round(t - arrival, 6), "event": kind, **({"tokens": n} if n else {})}
                for t, kind, n in delta.events or ()]}
        while len(self.timelines) > self.config.max_timelines:
            self.timelines.popitem(last=False)
        prompt = (f" prompt={self.tokenizer.decode(state.prompt_token_ids)!r}"
                  if self.config.log_prompts else "")
        logger.info("request %s finished: %s, tenant %s, prompt %d tokens (%d cached), output "
                    "%d tokens, ttft %s s, e2e %.3f s%s", name, delta.finish_reason, info.tenant,
                    len(state.prompt_token_ids), state.num_cached_tokens, len(sample.token_ids),
                    "-" if ttft is None else f"{ttft:.3f}", now - arrival, prompt)


def meets_objectives(info: RequestInfo, first_token: float | None, finished: float,
                     num_tokens: int) -> bool:
    """Whether a sample met its TTFT (arrival to first token) and TPOT ((finish - first token)
    / (tokens - 1); 0 for one token) objectives, on the frontend's clock."""
    if first_token is None:
        return False
    tpot = (finished - first_token) / (num_tokens - 1) if num_tokens > 1 else 0.0
    return ((info.ttft is None or first_token - info.arrival <= info.ttft)
            and (info.tpot is None or tpot <= info.tpot))
