"""Prometheus metrics, named `treadle:<name>` with vLLM's meaning where vLLM has the metric.

The frontend owns them: the engine process reports each step's stats and its cumulative cache
counters; request latencies come from the frontend's clock (TTFT, ITL, E2E: what a client sees)
and from the engine's (queue, prefill, decode time: where the time went).

Request-level counters and histograms, and the engine census's per-tenant KV blocks and tokens
scheduled, carry a `tenant` label (the API key's name, the `user` field, or "default"). Its
values are bounded: the first `max_tenant_labels` tenants seen get a label of their own, every
later one shares "other", so no client-chosen `user` can grow the series without bound.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics_exposition

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
OTHER_TENANT = "other"


class ServerMetrics:
    def __init__(self, model_name: str, max_tenant_labels: int) -> None:
        if max_tenant_labels < 0:
            raise ValueError("max_tenant_labels must be >= 0")
        self.registry = CollectorRegistry()  # one per server: tests run several in a process
        self.model_name = model_name
        self.max_tenant_labels = max_tenant_labels
        self.tenant_labels: set[str] = set()
        self.tenant_lock = threading.Lock()  # the reader thread and the event loop both label
        label = ["model_name"]
        tenant = ("tenant",)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"treadle:{name}", doc, label + list(extra), registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"treadle:{name}", doc, label + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple, per_tenant: bool = True
                      ) -> Histogram:
            return Histogram(f"treadle:{name}", doc, label + list(tenant if per_tenant else ()),
                             buckets=buckets, registry=self.registry)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.kv_blocks = gauge("kv_cache_num_blocks", "KV cache blocks in the engine's pool.")
        # Data parallelism: each replica's (the gauges above sum them; KV usage: their mean).
        replica = ("replica",)
        self.replica_up = gauge("replica_up", "1 while the engine replica is in rotation.",
                                replica)
        self.replica_running = gauge("replica_num_requests_running",
                                     "Requests in the replica's running batch.", replica)
        self.replica_waiting = gauge("replica_num_requests_waiting",
                                     "Requests waiting in the replica.", replica)
        self.replica_kv_usage = gauge("replica_kv_cache_usage_perc",
                                      "Fraction of the replica's KV cache blocks in use.", replica)
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (by recompute).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.",
                                     tenant)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.", tenant)
        # Each tenant's share of the steps: rate(scheduled_tokens) over the sum of the rates.
        self.scheduled_tokens = counter("scheduled_tokens", "Tokens scheduled in engine steps "
                                        "(prompt chunks, recompute, decode, proposed).", tenant)
        self.tenant_kv_blocks = gauge("tenant_kv_cache_blocks", "KV cache blocks held by the "
                                      "tenant's running requests alone (blocks shared across "
                                      "tenants count for none).", tenant)
        self.request_success = counter("request_success", "Requests finished, by reason.",
                                       ("finished_reason", *tenant))
        self.rejections = counter("admission_rejections", "Requests refused before queuing.",
                                  ("reason", *tenant))
        self.queue_timeouts = counter("request_queue_timeouts",
                                      "Requests that waited past --max-queue-wait, never run.",
                                      tenant)
        self.with_objectives = counter("requests_with_objectives",
                                       "Finished samples that carried a TTFT or TPOT objective.",
                                       tenant)
        self.goodput = counter("request_goodput",
                               "Finished samples (stop or length) that met every objective they "
                               "carried (TTFT, TPOT), on the frontend's clock.", tenant)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.",
                              LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between streamed tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.",
                             LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time waiting before the first schedule.", LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "First schedule to first token.", LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "First token to the last.", LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total",
                                          "Tokens computed per engine step.",
                                          ITERATION_TOKEN_BUCKETS, per_tenant=False)
        # vLLM's names: proposals checked, their tokens, and of those the tokens accepted.
        self.spec_decode = (counter("spec_decode_num_drafts",
                                    "Speculative proposals checked (a request's in one step)."),
                            counter("spec_decode_num_draft_tokens",
                                    "Speculative tokens proposed and checked."),
                            counter("spec_decode_num_accepted_tokens",
                                    "Speculative tokens accepted."))
        self.spec_decode_per_position = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Speculative proposals whose token at this position (0: the first) was accepted.",
            ("position",))
        # vLLM's gauge: the adapters as labels (comma-separated), the time of the update its value.
        self.lora_info = Gauge("treadle:lora_requests_info", "Running and waiting LoRA "
                               "adapters, and the most a step may hold.",
                               [*label, "running_lora_adapters", "waiting_lora_adapters",
                                "max_lora"], registry=self.registry)
        self._cache_counts = (0, 0, 0)  # last cumulative (queries, hits, preemptions) seen
        self._spec_decode_counts = (0, 0, 0)
        self._spec_decode_per_position: tuple[int, ...] = ()
        self._scheduled_tokens: dict[str, int] = {}  # last cumulative count per tenant seen
        self._kv_block_labels: set[str] = set()  # tenant labels the KV gauge has set

    def labels(self, metric, **extra):
        return metric.labels(model_name=self.model_name, **extra)

    def tenant_label(self, tenant: str) -> str:
        """The label value for `tenant`: its own name for the first max_tenant_labels tenants
        seen, "other" for the rest."""
        if tenant in self.tenant_labels:
            return tenant
        with self.tenant_lock:
            if len(self.tenant_labels) < self.max_tenant_labels and tenant != OTHER_TENANT:
                self.tenant_labels.add(tenant)
                return tenant
        return tenant if tenant in self.tenant_labels else OTHER_TENANT

    def observe_loras(self, running: tuple[str, ...], waiting: tuple[str, ...],
                      max_loras: int) -> None:
        """The lora_requests_info gauge: one series, the latest adapters as its labels."""
        self.lora_info.clear()
        self.lora_info.labels(model_name=self.model_name, running_lora_adapters=",".join(running),
                              waiting_lora_adapters=",".join(waiting),
                              max_lora=str(max_loras)).set(time.time())

    def observe_engine(self, running: int, waiting: int, kv_usage: float,
                       cumulative: tuple[int, int, int], iteration_tokens: int | None) -> None:
        """The engine's load, its cumulative (prefix queries, prefix hits, preemptions), and the
        tokens of the step just run (None: a heartbeat, no step)."""
        self.labels(self.running).set(running)
        self.labels(self.waiting).set(waiting)
        self.labels(self.kv_usage).set(kv_usage)
        for metric, now, before in zip((self.prefix_queries, self.prefix_hits, self.preemptions),
                                       cumulative, self._cache_counts, strict=True):
            if now > before:
                self.labels(metric).inc(now - before)
        self._cache_counts = cumulative
        if iteration_tokens is not None:
            self.labels(self.iteration_tokens).observe(iteration_tokens)

    def observe_tenants(self, kv_blocks: tuple[tuple[str, int], ...],
                        scheduled_tokens: tuple[tuple[str, int], ...]) -> None:
        """A census's KV blocks held and cumulative tokens scheduled, (tenant, count) each; a
        fresh engine counts from 0."""
        blocks: dict[str, int] = {}  # by label: tenants past max_tenant_labels share "other"
        for tenant, n in kv_blocks:
            label = self.tenant_label(tenant)
            blocks[label] = blocks.get(label, 0) + n
        for label in self._kv_block_labels - blocks.keys():  # its requests have all left
            self.labels(self.tenant_kv_blocks, tenant=label).set(0)
        for label, n in blocks.items():
            self.labels(self.tenant_kv_blocks, tenant=label).set(n)
        self._kv_block_labels |= blocks.keys()
        for tenant, now in scheduled_tokens:
            before = self._scheduled_tokens.get(tenant, 0)
            if now != before:
                self.labels(self.scheduled_tokens, tenant=self.tenant_label(tenant)).inc(
                    now - before if now > before else now)
        self._scheduled_tokens = dict(scheduled_tokens)

    def observe_spec_decode(self, cumulative: tuple[int, int, int],
                            per_position: tuple[int, ...] = ()) -> None:
        """The engine's cumulative speculative (proposals, proposed tokens, accepted tokens),
        and per position the proposals accepted up to it; a fresh engine counts from 0."""
        if cumulative != self._spec_decode_counts:
            for metric, now, before in zip(self.spec_decode, cumulative,
                                           self._spec_decode_counts, strict=True):
                if now > before:
                    self.labels(metric).inc(now - before)
            self._spec_decode_counts = cumulative
        if per_position != self._spec_decode_per_position:
            before = self._spec_decode_per_position
            for position, now in enumerate(per_position):
                earlier = before[position] if position < len(before) else 0
                if now > earlier:
                    self.labels(self.spec_decode_per_position,
                                position=str(position)).inc(now - earlier)
            self._spec_decode_per_position = per_position

    def observe_replica(self, replica: str, up: bool, running: int, waiting: int,
                        kv_usage: float) -> None:
        """One data-parallel replica's state."""
        for metric, value in ((self.replica_up, int(up)), (self.replica_running, running),
                              (self.replica_waiting, waiting), (self.replica_kv_usage, kv_usage)):
            self.labels(metric, replica=replica).set(value)

    def render(self, openmetrics: bool = False) -> bytes:
        """Prometheus text, or OpenMetrics (with the latency histograms' request-id exemplars)."""
        if openmetrics:
            return openmetrics_exposition.generate_latest(self.registry)
        return generate_latest(self.registry)
