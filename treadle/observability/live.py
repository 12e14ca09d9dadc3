"""What the live dashboard shows, kept in the frontend process: the engine's recent steps, its
last load and census, each tenant's share of the KV cache and of the tokens scheduled, each LoRA
adapter's requests and share of the tokens, recent requests (in flight and finished) and a
minute of latencies.

AsyncEngine feeds it (the reader thread: steps, load, tokens, finishes; the event loop: a
request's start and end); the dashboard's feed reads `snapshot()` about once a second. Every
buffer is bounded whatever the load. Times are CLOCK_MONOTONIC, shared with the engine process;
a snapshot gives them as seconds before its `now` (negative), so the page needs no clock of ours.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import Iterable

    from treadle.core.messages import EngineCensus, EngineLoad, StepRecord

K = TypeVar("K")  # a key tokens are counted by

STEP_HISTORY = 4096  # steps kept: over a minute at the tiny model's ~50 steps/s
REQUEST_HISTORY = 200  # finished requests kept for the Gantt, newest first
MAX_ROWS = 60  # requests a snapshot carries (the page's Gantt shows about 40)
LATENCY_WINDOW = 60.0  # seconds the percentiles cover
MAX_LATENCY_SAMPLES = 50_000  # per series (ITL has one per token): bounded under any load
RATE_WINDOW = 5.0  # seconds the step and token rates, and tenants' token shares, average over
PERCENTILES = (50, 90, 99)


class SampleDelta(Protocol):
    """What a sample's update says (frontend/output_processor.py makes them)."""

    request_id: str
    index: int
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    events: list | None


@dataclass
class LiveRequest:
    """One sample of a request, as the Gantt draws it."""

    name: str  # the request id, or `id/index` for one of n samples (as the timelines)
    tenant: str
    priority: int
    prompt_tokens: int
    arrival: float
    lora: str | None = None  # its LoRA adapter's name (None: the base model)
    first_token: float | None = None
    last_token: float | None = None
    output_tokens: int = 0
    finished_at: float | None = None
    finish_reason: str | None = None
    # At the end, from the engine's events: (kind, start, end) and prefill chunk starts.
    segments: list[tuple[str, float, float]] = field(default_factory=list)
    chunks: list[float] = field(default_factory=list)

    def row(self, now: float) -> dict:
        """The Gantt's row: times in seconds before `now`. In flight, only the frontend's view:
        pending until the first token, then decode."""
        segments = self.segments
        if self.finished_at is None or not segments:
            end = self.finished_at or now
            first = self.first_token or end
            segments = [("pending", self.arrival, first)]
            if self.first_token is not None:
                segments.append(("decode", first, end))
        return {"id": self.name, "tenant": self.tenant, "lora": self.lora,
                "priority": self.priority,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "arrival": round(self.arrival - now, 4),
                "ttft": None if self.first_token is None
                else round(self.first_token - self.arrival, 4),
                "end": None if self.finished_at is None else round(self.finished_at - now, 4),
                "finish_reason": self.finish_reason,
                "segments": [[kind, round(start - now, 4), round(end - now, 4)]
                             for kind, start, end in segments],
                "chunks": [round(t - now, 4) for t in self.chunks]}


def timeline_segments(events: list[tuple], arrival: float, finished: float
                      ) -> tuple[list[tuple[str, float, float]], list[float]]:
    """A finished sample's phases from the engine's events (queued, scheduled with its token
    count, preempted, first_token, finished): frontend (arrival to the engine's queue), queued,
    prefill (chunks, and the recompute after a preemption), preempted, decode; and the start of
    each prefill chunk."""
    segments: list[tuple[str, float, float]] = []
    chunks: list[float] = []
    state, since, has_token = "frontend", arrival, False
    for event in events:
        t, kind, num_tokens = event[0], event[1], event[2]
        if kind == "queued":
            new = "queued"
        elif kind == "scheduled":
            new = "decode" if has_token and num_tokens == 1 else "prefill"
            if new == "prefill":
                chunks.append(t)
        elif kind == "preempted":
            new = "preempted"
        elif kind == "first_token":
            has_token, new = True, "decode"
        elif kind == "finished":
            break
        else:  # a kind this view does not draw
            continue
        if new != state:
            if t > since:
                segments.append((state, since, t))
            state, since = new, t
    if finished > since:
        segments.append((state, since, finished))
    return segments, chunks


def percentiles(values: list[float]) -> dict:
    """p50/p90/p99 with linear interpolation between ranks (numpy's default), and the count."""
    ordered = sorted(values)
    out: dict = {"count": len(ordered)}
    for p in PERCENTILES:
        if not ordered:
            out[f"p{p}"] = None
            continue
        rank = (len(ordered) - 1) * p / 100
        low = int(rank)
        high = min(low + 1, len(ordered) - 1)
        out[f"p{p}"] = round(ordered[low] + (ordered[high] - ordered[low]) * (rank - low), 6)
    return out


def is_idle(load: EngineLoad | None) -> bool:
    """Idle since the census (taken once a second): nobody is left in its classes, and no
    tenant holds blocks."""
    return load is not None and not load.num_running + load.num_waiting


def tokens_since(samples: deque[tuple[float, dict[K, int]]], since: float) -> dict[K, int]:
    """Tokens scheduled per key (a tenant; a tenant and LoRA adapter) after `since`: the newest
    sample less the newest taken at or before `since`; with none that old, the newest whole (the
    engine started in the window)."""
    if not samples:
        return {}
    base: dict[K, int] = {}
    for t, tokens in reversed(samples):
        if t <= since:
            base = tokens
            break
    return {key: n - base.get(key, 0) for key, n in samples[-1][1].items()
            if n > base.get(key, 0)}


def tenant_shares(census: EngineCensus | None, tokens: dict[str, int], pool_blocks: int,
                  tenant: str | None, idle: bool) -> dict:
    """Each tenant's KV blocks held now (and share of the pool) and share of the tokens
    scheduled in the last RATE_WINDOW seconds (None: nothing was scheduled), and the blocks
    shared across tenants; with a `tenant`, its row only (and no shared blocks: they would
    tell of the others)."""
    blocks = dict(census.kv_blocks_by_tenant) if census is not None and not idle else {}
    total_tokens = sum(tokens.values())

    def share(n: int) -> float | None:
        return round(n / pool_blocks, 4) if pool_blocks else None

    names = sorted(t for t in {*blocks, *tokens} if tenant in (None, t) and
                   (blocks.get(t) or tokens.get(t)))
    rows = [{"tenant": t, "kv_blocks": blocks.get(t, 0), "kv_share": share(blocks.get(t, 0)),
             "token_share": round(tokens.get(t, 0) / total_tokens, 4) if total_tokens else None}
            for t in names]
    shared = census.kv_blocks_shared if census is not None and not idle else 0
    return {"tenants": rows, "token_window_s": RATE_WINDOW,
            "kv_shared": {"kv_blocks": shared, "kv_share": share(shared)} if tenant is None
            else None}


def adapter_rows(census: EngineCensus | None, lora_tokens: dict[tuple[str, str], int],
                 total_tokens: int, tenant: str | None, idle: bool) -> list[dict]:
    """Per LoRA adapter, its requests waiting and running now and share of all the tokens
    scheduled in the last RATE_WINDOW seconds (None: nothing was scheduled); with a `tenant`, of
    that tenant's requests only (another's adapters and load are not its to see)."""
    counts: dict[str, dict[str, int]] = {}

    def add(rows: Iterable[tuple[str, str, int]], column: str) -> None:
        for owner, name, n in rows:
            if tenant in (None, owner):
                row = counts.setdefault(name, {"waiting": 0, "running": 0, "tokens": 0})
                row[column] += n

    if census is not None and not idle:
        add(census.lora_waiting, "waiting")
        add(census.lora_running, "running")
    add(((owner, name, n) for (owner, name), n in lora_tokens.items()), "tokens")
    return [{"adapter": name, "waiting": c["waiting"], "running": c["running"],
             "token_share": round(c["tokens"] / total_tokens, 4) if total_tokens else None}
            for name, c in sorted(counts.items())]


class LiveFeed:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: deque[tuple[int, StepRecord]] = deque(maxlen=STEP_HISTORY)
        self.num_steps = 0  # steps seen: the feed's cursor
        self.load: EngineLoad | None = None
        self.census: EngineCensus | None = None
        # (time, prefix queries, prefix hits, preemptions), about once a second.
        self.counters: deque[tuple[float, int, int, int]] = deque(maxlen=int(LATENCY_WINDOW) + 5)
        # (time, tokens scheduled per tenant since the engine started) at each census, about
        # once a second: a few more than RATE_WINDOW's worth.
        self.tenant_tokens: deque[tuple[float, dict[str, int]]] = deque(
            maxlen=int(RATE_WINDOW) + 5)
        # The same, by (tenant, LoRA adapter), at the same times.
        self.lora_tokens: deque[tuple[float, dict[tuple[str, str], int]]] = deque(
            maxlen=int(RATE_WINDOW) + 5)
        self.requests: OrderedDict[tuple[str, int], LiveRequest] = OrderedDict()
        self.num_finished = 0  # of those, finished (kept to REQUEST_HISTORY)
        self.latency: dict[str, deque[tuple[float, float]]] = {
            name: deque(maxlen=MAX_LATENCY_SAMPLES) for name in ("ttft", "itl", "e2e")}
        self.rejections: Counter[str] = Counter()  # by reason, since the server started
        self.rejection_times: deque[float] = deque(maxlen=MAX_LATENCY_SAMPLES)
        self.replicas: dict[int, dict] = {}  # under data parallelism: each replica's state

    def record_engine(self, load: EngineLoad, step: StepRecord | None,
                      census: EngineCensus | None, now: float) -> None:
        """One message of the engine: its load, the step it ran, its census when sent."""
        with self.lock:
            if step is not None:
                self.num_steps += 1
                self.steps.append((self.num_steps, step))
            if census is not None:
                self.census = census
                tokens = dict(census.scheduled_tokens_by_tenant)
                last = self.tenant_tokens[-1][1] if self.tenant_tokens else {}
                if any(tokens.get(t, 0) < n for t, n in last.items()):  # a new engine
                    self.tenant_tokens.clear()
                    self.lora_tokens.clear()
                self.tenant_tokens.append((now, tokens))
                self.lora_tokens.append((now, {(t, name): n for t, name, n
                                               in census.scheduled_tokens_by_lora}))
            self.load = load
            counts = (load.prefix_cache_queries, load.prefix_cache_hits, load.num_preemptions)
            last = self.counters[-1][1:] if self.counters else counts
            if any(c < before for c, before in zip(counts, last, strict=True)):  # a new engine
                self.counters.clear()
            if not self.counters or now - self.counters[-1][0] >= 1.0:
                self.counters.append((now, *counts))

    def record_replica(self, index: int, up: bool, load: EngineLoad) -> None:
        """One data-parallel replica's state: in rotation or not, and its load."""
        with self.lock:
            self.replicas[index] = {"replica": index, "up": up, "running": load.num_running,
                                    "waiting": load.num_waiting,
                                    "kv_usage": round(load.kv_cache_usage, 4)}

    def engine_restarted(self) -> None:
        """The engine process died: nothing of its load or census holds any more."""
        with self.lock:
            self.load = self.census = None
            self.counters.clear()
            self.tenant_tokens.clear()
            self.lora_tokens.clear()

    def rejected(self, reason: str, now: float) -> None:
        """Admission (or the engine, under deadlines) refused a request."""
        with self.lock:
            self.rejections[reason] += 1
            self.rejection_times.append(now)

    def start(self, request_id: str, num_samples: int, tenant: str, priority: int,
              prompt_tokens: int, now: float, lora: str | None = None) -> None:
        with self.lock:
            for index in range(num_samples):
                name = request_id if num_samples == 1 else f"{request_id}/{index}"
                self.requests[request_id, index] = LiveRequest(name, tenant, priority,
                                                               prompt_tokens, now, lora)

    def observe(self, delta: SampleDelta, now: float) -> None:
        """One sample's update: its token times (TTFT, ITL) and, at its end, E2E and phases."""
        with self.lock:
            request = self.requests.get((delta.request_id, delta.index))
            if request is None or request.finished_at is not None:
                return
            if delta.token_ids:
                if request.first_token is None:
                    request.first_token = now
                    self.latency["ttft"].append((now, now - request.arrival))
                else:
                    self.latency["itl"].append((now, now - request.last_token))
                request.last_token = now
                request.output_tokens += len(delta.token_ids)
            if delta.finished:
                self.latency["e2e"].append((now, now - request.arrival))
                self._finish(request, delta.finish_reason, now)
                if delta.events:
                    request.segments, request.chunks = timeline_segments(
                        delta.events, request.arrival, now)

    def forget(self, request_id: str, now: float) -> None:
        """The request's stream ended: samples the engine did not finish were aborted (the
        client left, or the engine died)."""
        with self.lock:
            index = 0
            while (request := self.requests.get((request_id, index))) is not None:
                if request.finished_at is None:
                    self._finish(request, "abort", now)
                index += 1

    def _finish(self, request: LiveRequest, reason: str | None, now: float) -> None:
        request.finished_at, request.finish_reason = now, reason
        self.num_finished += 1
        if self.num_finished > REQUEST_HISTORY:  # drop the oldest finished
            for key, old in self.requests.items():
                if old.finished_at is not None:
                    del self.requests[key]
                    self.num_finished -= 1
                    break

    def row(self, name: str, now: float, tenant: str | None = None) -> dict | None:
        """A recent request's Gantt row, by its name (the id, or `id/index`); only `tenant`'s
        (None: anyone's)."""
        with self.lock:
            for request in self.requests.values():
                if request.name == name and tenant in (None, request.tenant):
                    return request.row(now)
        return None

    def snapshot(self, after_step: int, num_blocks: int, now: float | None = None,
                 tenant: str | None = None) -> dict:
        """What the page draws: steps after the cursor `after_step` (0: all kept), the engine
        now, the newest requests first and the last minute's latency percentiles. With a
        `tenant`, the requests, the census by tenant, the tenants' shares and the adapters' rows
        are that tenant's only (the steps, load and latencies stay the whole server's: they name
        no request or tenant)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            steps = [s for seq, s in self.steps if seq > after_step]
            recent = [s for _, s in self.steps if s.scheduled_at > now - RATE_WINDOW]
            rows = [r.row(now) for r in reversed(self.requests.values())
                    if tenant in (None, r.tenant)][:MAX_ROWS]
            windows = {}
            for name, samples in self.latency.items():
                while samples and samples[0][0] < now - LATENCY_WINDOW:
                    samples.popleft()
                windows[name] = [v for _, v in samples]
            load, census, counters = self.load, self.census, list(self.counters)
            tokens = tokens_since(self.tenant_tokens, now - RATE_WINDOW)
            lora_tokens = tokens_since(self.lora_tokens, now - RATE_WINDOW)
            adapters = adapter_rows(census, lora_tokens, sum(tokens.values()), tenant,
                                    idle=is_idle(load))
            if census is not None and tenant is not None:
                census = replace(
                    census, waiting=tuple(c for c in census.waiting if c[0] == tenant),
                    running=tuple(c for c in census.running if c[0] == tenant))
            replicas = [self.replicas[i] for i in sorted(self.replicas)]
            # Under data parallelism num_blocks is one replica's: shares are of the live pools.
            pool_blocks = num_blocks * max(1, sum(r["up"] for r in replicas))
            cursor = self.num_steps
            while self.rejection_times and self.rejection_times[0] < now - LATENCY_WINDOW:
                self.rejection_times.popleft()
            rejections = {"total": sum(self.rejections.values()),
                          "minute": len(self.rejection_times),
                          "by_reason": dict(self.rejections)}
        minute = [c for c in counters if c[0] >= now - LATENCY_WINDOW]
        return {
            "cursor": cursor,
            "now": self._now(load, census, minute, recent, num_blocks) | {"replicas": replicas}
            | tenant_shares(census, tokens, pool_blocks, tenant, idle=is_idle(load))
            | {"adapters": adapters},
            "steps": [[round(s.scheduled_at - now, 4), round(s.duration, 5), s.num_requests,
                       s.num_prefill_tokens, s.num_decode_tokens, s.num_preemptions]
                      for s in steps],
            "rejections": rejections,
            "requests": rows,
            "latency": {name: percentiles(values) for name, values in windows.items()},
        }

    @staticmethod
    def _now(load: EngineLoad | None, census: EngineCensus | None,
             minute: list[tuple[float, int, int, int]], recent: list[StepRecord],
             num_blocks: int) -> dict:
        used = round(load.kv_cache_usage * num_blocks) if load is not None else 0
        cached_free = min(census.num_cached_free_blocks, num_blocks - used) if census else 0
        queries = hits = preemptions = 0
        if load is not None:
            queries, hits = load.prefix_cache_queries, load.prefix_cache_hits
            preemptions = load.num_preemptions
        minute_queries = minute[-1][1] - minute[0][1] if minute else 0
        minute_hits = minute[-1][2] - minute[0][2] if minute else 0

        def by_class(entries: tuple[tuple[str, int, int], ...] | None) -> list[dict]:
            return [{"tenant": t, "priority": p, "requests": n} for t, p, n in entries or ()]

        idle = is_idle(load)

        return {
            "running": load.num_running if load else 0,
            "waiting": load.num_waiting if load else 0,
            "waiting_by": by_class(census.waiting if census and not idle else None),
            "running_by": by_class(census.running if census and not idle else None),
            "kv_blocks": {"total": num_blocks, "used": used, "cached_free": cached_free,
                          "free": num_blocks - used - cached_free},
            "prefix_hit_rate": {"total": hits / queries if queries else None,
                                "minute": minute_hits / minute_queries if minute_queries
                                else None},
            "preemptions": {"total": preemptions,
                            "minute": minute[-1][3] - minute[0][3] if minute else 0},
            "steps_per_s": round(len(recent) / RATE_WINDOW, 2),
            "prefill_tokens_per_s": round(sum(s.num_prefill_tokens for s in recent)
                                          / RATE_WINDOW, 1),
            "decode_tokens_per_s": round(sum(s.num_decode_tokens for s in recent)
                                         / RATE_WINDOW, 1),
        }
