"""AsyncEngine: the engine core in its own process, one async stream per request.

Layout: the core loop runs in a child process with `engine_threads` torch threads, and the
frontend process does HTTP, tokenizing and detokenizing. Messages cross two pipes. In the
frontend, a reader thread receives each step's token outputs, detokenizes them
(OutputProcessor) and hands the deltas to the event loop, which only moves them into each
request's queue: nothing slow runs on the event loop.

Threads: torch with 2 intra-op threads slows badly when another process keeps a core busy, so one
engine thread looked safer on 2 cores. Measured (`treadle bench serve`, 200 ShareGPT-like
requests at once, bf16): 1 engine thread 121 output tok/s, 2 threads 216 (the offline API: 212).
Between steps the frontend's work is short and the engine's steps are long, so the default is
torch's own: one thread per core.

Supervision: the frontend watches its engine. When the process dies (its output pipe closes),
every in-flight request ends at once with EngineUnavailable, the status turns "restarting" and a
fresh process (all KV blocks free) starts after a backoff; past `max_restarts` in a row the
status is "dead" for good. An engine alive but with no step finished for `stall_timeout` while it
has work (or with no heartbeat at all) is "stalled": not ready, but not restarted, since it may
recover and its requests are not lost; the orchestrator's liveness probe decides how long to wait.

Ids: the keys of `generate` are the server's own (frontends make them, e.g. from a uuid), never a
client's string: a client's id is a label its frontend maps to these, so no client can reach or
collide with another's request.

Tenants: each request's tenant (its API key's name, else the client's `user`, else "default";
`resolve_tenant`) goes to the engine (fair share, per-tenant KV caps), the metrics' `tenant`
label, the request log line and the timeline. Names from `user` are client-chosen, so at most
`max_tenants` distinct ones are tracked; later ones all run as the tenant "other". Per-tenant
limits (requests in flight, queued prompt tokens) are checked here, at once, like the queue's.
With `isolate_prefix_cache_by_tenant`, a request's cache salt is its tenant (joined to the
client's own salt, if any), so no tenant can probe another's cached prompts through timing.

Objectives: a request may carry a TTFT and a TPOT objective (seconds; server-wide defaults
apply otherwise). Under the deadline policy the engine process refuses at once a request whose
TTFT it predicts it cannot meet (EngineOverloaded, reason "deadline"); under every policy the
metrics count the samples that finished within their objectives (goodput).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch
from transformers import AutoTokenizer

from treadle.config import DEFAULT_DTYPE, CacheConfig, ModelConfig, SchedulerConfig
from treadle.engine.core import EngineCore, StepStats
from treadle.engine.output_processor import OutputProcessor, RequestState, SampleDelta
from treadle.engine.policies import POLICIES
from treadle.engine.request import DEFAULT_TENANT
from treadle.engine.sampling_params import SamplingParams
from treadle.model.capabilities import torch_dtype
from treadle.model.loader import load_model
from treadle.model.source import resolve_model
from treadle.observability.metrics import DEFAULT_MAX_TENANT_LABELS, ServerMetrics
from treadle.observability.step_trace import StepTraceWriter
from treadle.server.auth import check_tenant_name

logger = logging.getLogger(__name__)

# The engine reports its load at least this often when idle.
HEARTBEAT_SECONDS = 1.0
WATCH_SECONDS = 0.1  # how often the frontend checks for a stall
# Restarts back off 0.5, 1, 2, ... s up to MAX_RESTART_BACKOFF; an engine that ran this long
# since its start counts as healthy again, so its next death starts the count afresh.
RESTART_BACKOFF = 0.5
MAX_RESTART_BACKOFF = 30.0
STABLE_SECONDS = 60.0
# The engine stops after its current step; past this (a slow step on a loaded machine) it is
# killed, so that the server exits within its shutdown timeout and a second.
SHUTDOWN_JOIN_SECONDS = 0.5
# What the frontends say while the engine cannot take requests, by status.
UNAVAILABLE = {"starting": "the engine is starting",
               "restarting": "the engine failed and is restarting; retry later",
               "dead": "the engine failed and will not be restarted",
               "stopping": "the server is shutting down"}


class EngineUnavailable(RuntimeError):
    """The engine cannot serve: it died (restarting, or not), or the server is shutting down.
    `kind` says which to clients: "engine_error" or "server_shutdown"."""

    def __init__(self, message: str, kind: str = "engine_error") -> None:
        super().__init__(message)
        self.kind = kind


# Distinct tenants named by clients' `user` fields that the engine tracks; later ones are OTHER.
DEFAULT_MAX_TENANTS = 1024
OTHER_TENANT = "other"
MAX_CACHE_SALT_CHARS = 256


class EngineOverloaded(Exception):
    """The request cannot be taken now: the client should retry after `retry_after` seconds.
    `reason` names the limit: queue_full, queued_tokens_full, tenant_requests,
    tenant_queued_tokens, or deadline (its TTFT objective cannot be met)."""

    def __init__(self, message: str, retry_after: int = 1, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason


@dataclass
class RequestInfo:
    """What the frontend keeps about one request in flight beyond its tokens."""

    tenant: str
    label: str  # the tenant's metrics label (bounded)
    ttft: float | None  # objectives in seconds
    tpot: float | None


@dataclass
class EngineArgs:
    model: str | None = None
    dtype: str = DEFAULT_DTYPE
    max_model_len: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    policy: str = "fcfs"
    engine_threads: int | None = None  # torch's default: one per core
    trace_file: str | None = None  # a Chrome-trace JSON of every engine step
    quantization: str = "auto"
    scheduler: dict = field(default_factory=dict)  # more SchedulerConfig fields


@dataclass
class RequestUpdate:
    deltas: list[SampleDelta]
    state: RequestState  # live: the reader thread goes on updating it
    finished: bool  # whether this update ends the request, fixed when it was made


@dataclass
class EngineLoad:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    has_work: bool = False
    last_progress: float = field(default_factory=time.monotonic)  # frontend clock
    last_message: float = field(default_factory=time.monotonic)


def engine_process(args: EngineArgs, requests, outputs) -> None:
    """The child: build the core and serve it until told to shut down."""
    # The child's own log lines (the first start's kernel build, a dtype warning) to stderr.
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s treadle-engine %(name)s: %(message)s")
    if args.engine_threads is not None:
        torch.set_num_threads(args.engine_threads)
    try:
        loaded = load_model(args.model, torch_dtype(args.dtype), args.quantization)
        core = EngineCore(
            loaded, ModelConfig(model=args.model, dtype=args.dtype,
                                max_model_len=args.max_model_len,
                                quantization=args.quantization),
            CacheConfig(kv_cache_memory_bytes=args.kv_cache_memory_bytes),
            SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            **args.scheduler),
            policy=args.policy)
    except Exception as e:
        outputs.send(("failed", f"{type(e).__name__}: {e}"))
        return
    # What the frontend learns of the engine: one dict, so that adding a fact is one line.
    outputs.send(("ready", {"max_model_len": core.max_model_len,
                            "num_blocks": core.runner.num_blocks,
                            "vocab_size": core.runner.spec.vocab_size,
                            "platform": core.runner.platform_info()}))
    trace = StepTraceWriter(args.trace_file) if args.trace_file else None
    try:
        serve_engine(core, requests, outputs, trace)
    finally:
        if trace is not None:
            trace.close()
    # Nothing is left to save: skip the interpreter's teardown of torch (seconds), so that a
    # server stops within its shutdown timeout.
    os._exit(0)


def serve_engine(core: EngineCore, requests: Connection, outputs: Connection,
                 trace: StepTraceWriter | None) -> None:
    """The engine process's loop: take messages, step, send outputs and load."""
    last_report = 0.0
    traced: StepStats | None = None
    while True:
        busy = core.has_unfinished_requests()
        if requests.poll(0 if busy else HEARTBEAT_SECONDS):
            while requests.poll(0):
                message = requests.recv()
                kind = message[0]
                if kind == "shutdown":
                    return
                if kind == "abort":
                    core.abort_request(message[1])
                elif kind == "add":
                    _, request_id, prompt_token_ids, params, priority, options = message
                    ttft, tenant = options["ttft"], options["tenant"]
                    # Admission under deadlines: here, against the queue as it is now.
                    if (options["admit_deadline"] and ttft is not None
                            and not core.can_meet_ttft(len(prompt_token_ids), ttft,
                                                       priority=priority, tenant=tenant)):
                        outputs.send(("rejected", request_id,
                                      f"the TTFT objective of {ttft * 1e3:g} ms cannot be met "
                                      f"given the requests queued ahead; retry later",
                                      "deadline"))
                        continue
                    try:
                        core.add_request(request_id, prompt_token_ids, params, priority,
                                         options["cache_salt"], tenant=tenant, ttft=ttft,
                                         tpot=options["tpot"])
                    except ValueError as e:
                        outputs.send(("rejected", request_id, str(e), "invalid_request"))
        step_outputs = core.step() if core.has_unfinished_requests() else []
        iteration_tokens = None
        if core.last_step_stats is not traced:  # a step ran
            traced = core.last_step_stats
            iteration_tokens = traced.num_prefill_tokens + traced.num_decode_tokens
            if trace is not None:
                trace.write(traced.trace_event())
        now = time.monotonic()
        if iteration_tokens is not None or now - last_report >= HEARTBEAT_SECONDS:
            scheduler, kv = core.scheduler, core.kv_cache_manager
            load = (scheduler.num_running, scheduler.num_waiting, kv.block_pool.usage,
                    core.has_unfinished_requests(),
                    (kv.prefix_cache_queries, kv.prefix_cache_hits, scheduler.num_preemptions),
                    iteration_tokens)
            outputs.send(("step", step_outputs, load))
            last_report = now


class AsyncEngine:
    def __init__(self, model: str | None = None, dtype: str = DEFAULT_DTYPE,
                 max_model_len: int | None = None, kv_cache_memory_bytes: int = 1 << 30,
                 max_num_seqs: int = 128, max_num_batched_tokens: int = 512,
                 policy: str = "fcfs", engine_threads: int | None = None,
                 max_queued_requests: int | None = None,
                 max_queued_tokens: int | None = None, trace_file: str | None = None,
                 log_prompts: bool = False, max_timelines: int = 1000,
                 max_restarts: int = 5, stall_timeout: float = 30.0,
                 quantization: str = "auto", scheduler_options: dict | None = None,
                 max_requests_per_tenant: int | None = None,
                 max_queued_tokens_per_tenant: int | None = None,
                 max_tenants: int = DEFAULT_MAX_TENANTS,
                 max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS,
                 isolate_prefix_cache_by_tenant: bool = False,
                 default_ttft: float | None = None, default_tpot: float | None = None
                 ) -> None:
        """`max_restarts`: engine restarts in a row before the status is "dead" (0: never
        restart); `stall_timeout`: seconds without a finished step, while the engine has work,
        before it counts as stalled; `scheduler_options`: more SchedulerConfig fields
        (max_num_partial_prefills, max_queue_wait, tenant_weights, ...); the per-tenant limits,
        `max_tenants`, `max_tenant_labels`, `isolate_prefix_cache_by_tenant`: see the module's
        doc; `default_ttft`, `default_tpot`: objectives (seconds) of requests that set none.
        ValueError for a bad setting, before anything starts."""
        scheduler_options = dict(scheduler_options or {})
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        **scheduler_options)  # ValueError now, not in the engine process
        for name, value in (("max_requests_per_tenant", max_requests_per_tenant),
                            ("max_queued_tokens_per_tenant", max_queued_tokens_per_tenant)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None: no limit)")
        if max_tenants < 1:
            raise ValueError("max_tenants must be >= 1")
        for name, value in (("default_ttft", default_ttft), ("default_tpot", default_tpot)):
            if value is not None and not (value > 0 and value != float("inf")):
                raise ValueError(f"{name} must be > 0 seconds")
        self.args = EngineArgs(model, dtype, max_model_len, kv_cache_memory_bytes, max_num_seqs,
                               max_num_batched_tokens, policy, engine_threads, trace_file,
                               quantization, scheduler_options)
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.max_requests_per_tenant = max_requests_per_tenant
        self.max_queued_tokens_per_tenant = max_queued_tokens_per_tenant
        self.max_tenants = max_tenants
        self.tenants: set[str] = set()  # the distinct `user` tenants tracked so far
        self.isolate_prefix_cache_by_tenant = isolate_prefix_cache_by_tenant
        self.default_ttft, self.default_tpot = default_ttft, default_tpot
        self.requests_info: dict[str, RequestInfo] = {}  # per request in flight
        self.tenant_in_flight: dict[str, int] = {}
        # Requests sent to the engine that have produced no token yet, with their prompt tokens
        # (times n): the queue admission bounds, known here at once, unlike the engine's counts.
        self.queued: dict[str, int] = {}
        source = resolve_model(self.args.model)
        self.model_name = source.name
        self.tokenizer = AutoTokenizer.from_pretrained(str(source.folder))
        self.processor = OutputProcessor(self.tokenizer)
        self.lock = threading.Lock()  # the processor and the request pipe, shared with the reader
        self.streams: dict[str, asyncio.Queue] = {}
        self.metrics = ServerMetrics(self.model_name, max_tenant_labels)
        self.arrivals: dict[str, float] = {}  # frontend clock, for TTFT and E2E
        # Per sample: (first, last) token times, for TTFT, ITL and the request log.
        self.token_times: dict[tuple[str, int], tuple[float, float]] = {}
        # The last finished samples' timelines, for GET /debug/requests/{id}.
        self.timelines: OrderedDict[str, dict] = OrderedDict()
        self.max_timelines = max_timelines
        self.log_prompts = log_prompts
        self.load_state = EngineLoad()
        self.max_model_len = 0  # these three are known once the engine has started
        self.num_blocks = 0
        self.vocab_size = 0
        self.platform: dict = {}  # dtype served and why, fast paths: from the engine process
        self.process: multiprocessing.process.BaseProcess | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # starting → ok ⇄ stalled; a death: restarting → ok, or dead; shutdown: stopping.
        self.status = "starting"
        self.listeners: list[Callable[[str], None]] = []  # called on the loop at each change
        self.max_restarts = max_restarts
        self.stall_timeout = stall_timeout
        self.restarts = 0  # in a row, since the engine last ran STABLE_SECONDS
        self.started_at = 0.0
        self.tasks: set[asyncio.Task] = set()  # the stall watcher, a restart in progress
        self.closing = False  # shutdown() has begun: the engine process is meant to stop

    async def start(self) -> None:
        """Start the engine process and wait until its model is loaded; then watch it."""
        self.loop = asyncio.get_running_loop()
        await self._spawn()
        self._set_status("ok")
        self._spawn_task(self._watch())

    async def _spawn(self) -> None:
        """Start an engine process, wait for its ready message, start reading its outputs."""
        context = multiprocessing.get_context("spawn")
        requests_in, requests_out = context.Pipe(duplex=False)
        outputs_in, outputs_out = context.Pipe(duplex=False)
        process = context.Process(target=engine_process, name="treadle-engine",
                                  args=(self.args, requests_in, outputs_out), daemon=True)
        spawned = time.monotonic()
        process.start()
        requests_in.close()
        outputs_out.close()
        try:
            first = await asyncio.to_thread(outputs_in.recv)
        except EOFError:
            await asyncio.to_thread(process.join, 1)
            first = ("failed", f"the engine process exited while loading ({exit_status(process)})")
        except BaseException:  # cancelled by a shutdown: the reading thread ends at EOF
            process.kill()
            raise
        if first[0] != "ready":
            process.kill()
            raise RuntimeError(f"the engine failed to start: {first[1]}")
        info = first[1]
        self.max_model_len, self.num_blocks = info["max_model_len"], info["num_blocks"]
        self.metrics.labels(self.metrics.kv_blocks).set(self.num_blocks)
        self.vocab_size, self.platform = info["vocab_size"], info["platform"]
        logger.info("engine ready in %.1f s: dtype %s (%s); %s, oneDNN linear %s, native "
                    "attention %s, quantization %s (%s; integer kernel up to rows: %s)",
                    time.monotonic() - spawned, self.platform["dtype"],
                    self.platform["dtype_reason"], self.platform["isa"],
                    self.platform["onednn_linear"], self.platform["native_attention"],
                    self.platform["quantization"], self.platform["quantized_types"],
                    self.platform["gemv_rows"])
        with self.lock:
            self.process, self.requests_out = process, requests_out
            self.load_state = EngineLoad()
        self.started_at = time.monotonic()
        threading.Thread(target=self._read_outputs, args=(outputs_in, process),
                         name="treadle-outputs", daemon=True).start()

    def _spawn_task(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def shutdown(self) -> None:
        """End what is in flight (server_shutdown), stop the engine process (killed if it does
        not stop within SHUTDOWN_JOIN_SECONDS)."""
        self.closing = True
        self.drain()
        self.fail_all(EngineUnavailable(UNAVAILABLE["stopping"], "server_shutdown"))
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        process, self.process = self.process, None
        if process is None:
            return
        with self.lock, contextlib.suppress(OSError):  # the engine may be gone already
            self.requests_out.send(("shutdown",))
        await asyncio.to_thread(process.join, SHUTDOWN_JOIN_SECONDS)
        if process.is_alive():
            process.kill()

    def add_listener(self, listener: Callable[[str], None]) -> None:
        """Call `listener(status)` on the event loop at each status change."""
        self.listeners.append(listener)

    def _set_status(self, status: str) -> None:
        if status == self.status:
            return
        logger.log(logging.INFO if status in ("ok", "stopping") else logging.ERROR,
                   "engine status: %s (was %s)", status, self.status)
        self.status = status
        for listener in self.listeners:
            listener(status)

    async def _watch(self) -> None:
        """Turn the status to stalled and back as the engine stops and resumes progress."""
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            if self.status in ("ok", "stalled"):
                self._set_status("stalled" if self._stalled() else "ok")

    def _stalled(self) -> bool:
        state, now = self.load_state, time.monotonic()
        if now - state.last_message > self.stall_timeout:  # not even a heartbeat
            return True
        return state.has_work and now - state.last_progress > self.stall_timeout

    def _engine_exited(self, process: multiprocessing.process.BaseProcess) -> None:
        """On the loop, when an engine process's outputs end: unless it was told to stop, end
        every request in flight and restart the engine, or declare it dead."""
        if process is not self.process:  # shutdown() stopped it
            return
        how = exit_status(process)
        logger.error("the engine process died (%s)", how)
        self.process = None
        self._fail_streams(EngineUnavailable(f"the engine process died ({how}) while running "
                                             f"this request"), engine_gone=True)
        self.metrics.observe_engine(0, 0, 0.0, (0, 0, 0), None)  # a fresh engine counts from 0
        self.load_state = EngineLoad()
        if self.status == "stopping":
            return
        if time.monotonic() - self.started_at > STABLE_SECONDS:
            self.restarts = 0
        if self.restarts < self.max_restarts:
            self._set_status("restarting")
            self._spawn_task(self._restart())
        else:
            self._set_status("dead")

    async def _restart(self) -> None:
        """Start a new engine after a backoff, doubling it after each failed start, until one
        starts or `max_restarts` in a row have been tried."""
        while self.restarts < self.max_restarts:
            delay = min(RESTART_BACKOFF * 2 ** self.restarts, MAX_RESTART_BACKOFF)
            self.restarts += 1
            logger.error("restarting the engine in %.1f s (restart %d of at most %d in a row)",
                         delay, self.restarts, self.max_restarts)
            await asyncio.sleep(delay)
            try:
                await self._spawn()
            except Exception as e:  # whatever the cause, the next try backs off further
                logger.error("the engine failed to restart: %s", e)
                continue
            self._set_status("ok")
            return
        self._set_status("dead")

    def drain(self) -> None:
        """The server is stopping: refuse new requests; those in flight go on."""
        self._set_status("stopping")

    def fail_all(self, error: EngineUnavailable) -> None:
        """End every request in flight now with `error`, each stream's last item (the server
        is shutting down)."""
        self._fail_streams(error, engine_gone=False)

    def _fail_streams(self, error: Exception, engine_gone: bool) -> None:
        with self.lock:
            queues = list(self.streams.values())
            if engine_gone:  # nothing to abort: forget every request here at once
                for request_id in list(self.processor.requests):
                    self.processor.remove(request_id)
                for table in (self.streams, self.queued, self.arrivals, self.token_times):
                    table.clear()
        for queue in queues:
            queue.put_nowait(error)

    def timeline(self, request_id: str) -> dict | None:
        """A recently finished request's timeline (`id/index` for one of n samples)."""
        return self.timelines.get(request_id)

    def load(self) -> dict:
        return {"running": self.load_state.running, "waiting": self.load_state.waiting,
                "kv_cache_usage": self.load_state.kv_cache_usage}

    def is_ready(self) -> bool:
        """Serving and making progress."""
        return self.status == "ok"

    def check_available(self) -> None:
        """EngineUnavailable unless the engine takes requests (a stalled one does: it may
        recover). Cheap: frontends call it first, so a request to a dead engine fails at once."""
        if self.status not in ("ok", "stalled"):
            raise EngineUnavailable(UNAVAILABLE[self.status], "server_shutdown"
                                    if self.status == "stopping" else "engine_error")

    def resolve_tenant(self, key_name: str | None, user: str | None) -> str:
        """A request's tenant: its API key's name, else the client's `user` (ValueError if
        malformed), else "default". At most max_tenants distinct `user` names are tracked;
        past that, new ones are "other"."""
        if key_name:
            return key_name
        if not user:
            return DEFAULT_TENANT
        check_tenant_name(user, "user")
        if user in self.tenants:
            return user
        if len(self.tenants) < self.max_tenants:
            self.tenants.add(user)
            return user
        return OTHER_TENANT

    def _overloaded(self, reason: str, tenant: str, message: str) -> EngineOverloaded:
        self.metrics.labels(self.metrics.rejections, reason=reason,
                            tenant=self.metrics.tenant_label(tenant)).inc()
        return EngineOverloaded(message, reason=reason)

    def check_capacity(self, num_prompt_tokens: int = 0, tenant: str = DEFAULT_TENANT) -> None:
        """Raise EngineOverloaded if a request of that many prompt tokens would overfill the
        queue, or pass its tenant's limits. Cheap: frontends call it before tokenizing, and
        generate() again with the count."""
        if self.max_queued_requests is not None and len(self.queued) >= self.max_queued_requests:
            raise self._overloaded("queue_full", tenant, f"the server has {len(self.queued)} "
                                   f"requests queued, its limit; retry later")
        queued_tokens = sum(self.queued.values())
        # A prompt larger than the limit alone still goes when nothing is queued: it would
        # otherwise never go.
        if (self.max_queued_tokens is not None and queued_tokens
                and queued_tokens + num_prompt_tokens > self.max_queued_tokens):
            raise self._overloaded("queued_tokens_full", tenant,
                                   f"the server has {queued_tokens} prompt tokens queued; "
                                   f"{num_prompt_tokens} more exceed its limit of "
                                   f"{self.max_queued_tokens}; retry later")
        limit = self.max_requests_per_tenant
        in_flight = self.tenant_in_flight.get(tenant, 0)
        if limit is not None and in_flight >= limit:
            raise self._overloaded("tenant_requests", tenant,
                                   f"tenant {tenant!r} has {in_flight} requests in flight, the "
                                   f"limit per tenant (max_requests_per_tenant {limit}); retry "
                                   f"later")
        limit = self.max_queued_tokens_per_tenant
        if limit is not None:
            info = self.requests_info
            mine = sum(n for request_id, n in self.queued.items()
                       if (r := info.get(request_id)) is not None and r.tenant == tenant)
            if mine and mine + num_prompt_tokens > limit:
                raise self._overloaded("tenant_queued_tokens", tenant,
                                       f"tenant {tenant!r} has {mine} prompt tokens queued; "
                                       f"{num_prompt_tokens} more exceed the limit per tenant "
                                       f"(max_queued_tokens_per_tenant {limit}); retry later")

    def check_prompt_token_ids(self, prompt_token_ids: list[int]) -> None:
        """ValueError for an id outside the vocabulary. The engine checks too, but the frontend
        decodes prompts first (the detokenizer's context, echo), and the tokenizer overflows on a
        negative id."""
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[0]}")

    def cache_salt(self, tenant: str, cache_salt: str | None) -> str | None:
        """The salt the engine gets: the client's, or with isolation by tenant, the tenant's
        joined to it (NUL cannot occur in a tenant name, so no two pairs collide)."""
        if cache_salt is not None and len(cache_salt) > MAX_CACHE_SALT_CHARS:
            raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters")
        cache_salt = cache_salt or None
        if not self.isolate_prefix_cache_by_tenant:
            return cache_salt
        return tenant if cache_salt is None else f"{tenant}\x00{cache_salt}"

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0, *,
                       tenant: str = DEFAULT_TENANT, cache_salt: str | None = None,
                       ttft: float | None = None, tpot: float | None = None
                       ) -> AsyncIterator[RequestUpdate]:
        """Updates as tokens arrive. `request_id` is the server's own, unique among requests in
        flight (ValueError otherwise). `tenant`: from resolve_tenant; `ttft`, `tpot`: objectives
        in seconds (None: the server's defaults). ValueError before any update if the engine
        refuses the request, EngineOverloaded if the queue is full, a tenant limit is reached
        or (deadline policy) its TTFT cannot be met, EngineUnavailable if the engine is down or
        dies, or the server shuts down. Leaving the iteration early (a disconnect) aborts the
        request; one that waits past max_queue_wait finishes with finish_reason
        "queue_timeout"."""
        self.check_available()
        self.check_prompt_token_ids(prompt_token_ids)
        salt = self.cache_salt(tenant, cache_salt)
        self.check_capacity(len(prompt_token_ids) * params.n, tenant)
        ttft = self.default_ttft if ttft is None else ttft
        tpot = self.default_tpot if tpot is None else tpot
        options = {"tenant": tenant, "cache_salt": salt, "ttft": ttft, "tpot": tpot,
                   "admit_deadline": self.args.policy == "deadline"}
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            engine_requests = self.processor.add_request(request_id, prompt_token_ids, params)
            self.streams[request_id] = queue
            self.arrivals[request_id] = time.monotonic()
            self.queued[request_id] = len(prompt_token_ids) * params.n
            self.requests_info[request_id] = RequestInfo(
                tenant, self.metrics.tenant_label(tenant), ttft, tpot)
            self.tenant_in_flight[tenant] = self.tenant_in_flight.get(tenant, 0) + 1
            # A dead engine's pipe: the reader has seen its end, or is about to, and then fails
            # this stream with the others.
            with contextlib.suppress(OSError):
                for engine_id, engine_params in engine_requests:
                    self.requests_out.send(("add", engine_id, prompt_token_ids, engine_params,
                                            priority, options))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                self.queued.pop(request_id, None)
                yield item
        finally:
            self._forget(request_id, abort=not finished)

    async def abort(self, request_id: str) -> bool:
        """End a request now: its stream's last update finishes each unfinished sample with
        finish_reason "abort". False if no such request is in flight."""
        with self.lock:
            state, queue = self.processor.requests.get(request_id), self.streams.get(request_id)
            if state is None or queue is None or state.finished:
                return False
            deltas = []
            for sample in state.samples:
                if sample.finished:
                    continue
                sample.finish_reason = "abort"  # the reader drops this sample's later tokens
                with contextlib.suppress(OSError):
                    self.requests_out.send(("abort", sample.engine_request_id))
                deltas.append(SampleDelta(request_id, sample.index, "", [], None, True, "abort"))
                self._observe(deltas[-1])
        # call_soon, not put_nowait: after the updates the reader has already scheduled.
        self.loop.call_soon(queue.put_nowait, RequestUpdate(deltas, state, True))
        return True

    def _forget(self, request_id: str, abort: bool) -> None:
        with self.lock:
            info = self.requests_info.pop(request_id, None)
            if info is not None:
                left = self.tenant_in_flight[info.tenant] - 1
                if left:
                    self.tenant_in_flight[info.tenant] = left
                else:
                    del self.tenant_in_flight[info.tenant]
            self.streams.pop(request_id, None)
            self.queued.pop(request_id, None)
            self.arrivals.pop(request_id, None)
            for index in range(len(self.processor.engine_ids(request_id))):
                self.token_times.pop((request_id, index), None)
            if abort and self.process is not None:
                with contextlib.suppress(OSError):  # the engine died: nothing to abort
                    for engine_id in self.processor.engine_ids(request_id):
                        self.requests_out.send(("abort", engine_id))
            self.processor.remove(request_id)

    def _read_outputs(self, outputs: Connection, process: multiprocessing.process.BaseProcess
                      ) -> None:
        """Reader thread of one engine process: receive its messages, detokenize, hand updates
        to the loop; at their end, tell the loop."""
        while True:
            try:
                message = outputs.recv()
            except (EOFError, OSError):
                break
            try:
                self._receive(message)
            except Exception:  # a fault of ours: fail what is in flight, restart, never hang
                logger.exception("reading the engine's outputs failed; restarting the engine")
                process.kill()
                break
        outputs.close()
        if not self.closing:  # shutdown() joins it itself
            process.join(1)  # for its exit code: a dead process's end comes at once
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server has exited
            self.loop.call_soon_threadsafe(self._engine_exited, process)

    def _receive(self, message: tuple) -> None:
        self.load_state.last_message = time.monotonic()
        if message[0] == "rejected":
            self._reject(*message[1:])
            return
        _, step_outputs, (running, waiting, usage, has_work, cumulative,
                          iteration_tokens) = message
        self.metrics.observe_engine(running, waiting, usage, cumulative, iteration_tokens)
        state = self.load_state
        if iteration_tokens is not None or not has_work:  # a step ran, or nothing to do
            state.last_progress = state.last_message
        state.running, state.waiting, state.kv_cache_usage = running, waiting, usage
        state.has_work = has_work
        if step_outputs:
            self._dispatch(step_outputs)

    def _dispatch(self, step_outputs: list) -> None:
        with self.lock:
            deltas, to_abort = self.processor.process(step_outputs)
            with contextlib.suppress(OSError):  # a dead engine: the reader sees its end next
                for engine_id in to_abort:
                    self.requests_out.send(("abort", engine_id))
            updates: dict[str, list[SampleDelta]] = {}
            for delta in deltas:
                updates.setdefault(delta.request_id, []).append(delta)
                self._observe(delta)
            for request_id, request_deltas in updates.items():
                queue = self.streams.get(request_id)
                if queue is not None:
                    state = self.processor.requests[request_id]
                    update = RequestUpdate(request_deltas, state, state.finished)
                    self.loop.call_soon_threadsafe(queue.put_nowait, update)

    def _observe(self, delta: SampleDelta) -> None:
        """Latency metrics on the frontend's clock, as a client would measure them; at a
        sample's end, its timeline and one log line."""
        m, now = self.metrics, time.monotonic()
        arrival = self.arrivals.get(delta.request_id, now)
        key = (delta.request_id, delta.index)
        info = self.requests_info.get(delta.request_id) or RequestInfo(
            DEFAULT_TENANT, m.tenant_label(DEFAULT_TENANT), None, None)
        tenant = info.label
        if delta.token_ids:
            first, last = self.token_times.get(key, (None, None))
            if last is None:
                m.labels(m.ttft, tenant=tenant).observe(now - arrival)
                if delta.index == 0:
                    state = self.processor.requests[delta.request_id]
                    m.labels(m.prompt_tokens, tenant=tenant).inc(len(state.prompt_token_ids))
            else:
                m.labels(m.itl, tenant=tenant).observe(now - last)
            self.token_times[key] = (first or now, now)
            m.labels(m.generation_tokens, tenant=tenant).inc(len(delta.token_ids))
        if delta.finished:
            m.labels(m.request_success, finished_reason=delta.finish_reason,
                     tenant=tenant).inc()
            m.labels(m.e2e, tenant=tenant).observe(now - arrival)
            if delta.finish_reason == "queue_timeout":
                m.labels(m.queue_timeouts, tenant=tenant).inc()
            if delta.timings is not None:
                for metric, seconds in zip((m.queue_time, m.prefill_time, m.decode_time),
                                           delta.timings, strict=True):
                    m.labels(metric, tenant=tenant).observe(seconds)
            first_token = self.token_times.get(key, (None, None))[0]
            if info.ttft is not None or info.tpot is not None:
                m.labels(m.with_objectives, tenant=tenant).inc()
                state = self.processor.requests[delta.request_id]
                num_tokens = len(state.samples[delta.index].token_ids)
                if delta.finish_reason in ("stop", "length") and meets_objectives(
                        info, arrival, first_token, now, num_tokens):
                    m.labels(m.goodput, tenant=tenant).inc()
            self._record_finish(delta, arrival, first_token, now, info.tenant)

    def _record_finish(self, delta: SampleDelta, arrival: float, first_token: float | None,
                       now: float, tenant: str) -> None:
        state = self.processor.requests[delta.request_id]
        sample = state.samples[delta.index]
        name = delta.request_id if len(state.samples) == 1 else f"{delta.request_id}/{delta.index}"
        ttft = None if first_token is None else round(first_token - arrival, 6)
        # Both clocks are CLOCK_MONOTONIC, shared by the frontend and the engine process.
        self.timelines[name] = {
            "request_id": delta.request_id, "index": delta.index, "tenant": tenant,
            "prompt_tokens": len(state.prompt_token_ids), "output_tokens": len(sample.token_ids),
            "cached_tokens": state.num_cached_tokens, "finish_reason": delta.finish_reason,
            "ttft_s": ttft, "e2e_s": round(now - arrival, 6),
            "events": [{"t_s": 0.0, "event": "arrival"}] + [
                {"t_s": round(t - arrival, 6), "event": kind, **({"tokens": n} if n else {})}
                for t, kind, n in delta.events or ()]}
        while len(self.timelines) > self.max_timelines:
            self.timelines.popitem(last=False)
        prompt = (f" prompt={self.tokenizer.decode(state.prompt_token_ids)!r}"
                  if self.log_prompts else "")
        logger.info("request %s finished: %s, tenant %s, prompt %d tokens (%d cached), output "
                    "%d tokens, ttft %s s, e2e %.3f s%s", name, delta.finish_reason, tenant,
                    len(state.prompt_token_ids), state.num_cached_tokens, len(sample.token_ids),
                    "-" if ttft is None else f"{ttft:.3f}", now - arrival, prompt)

    def _reject(self, engine_id: str, message: str, reason: str) -> None:
        """The engine refused a request: invalid (ValueError) or, under deadlines, one whose
        TTFT it cannot meet (EngineOverloaded, reason deadline)."""
        with self.lock:
            entry = self.processor.samples.get(engine_id)
            request_id = entry[0].request_id if entry is not None else None
            info = self.requests_info.get(request_id) if request_id is not None else None
            queue = self.streams.get(request_id) if request_id is not None else None
        self.metrics.labels(self.metrics.rejections, reason=reason, tenant=self.metrics
                            .tenant_label(info.tenant if info else DEFAULT_TENANT)).inc()
        if queue is not None:
            error = (EngineOverloaded(message, reason=reason) if reason == "deadline"
                     else ValueError(message))
            self.loop.call_soon_threadsafe(queue.put_nowait, error)


def meets_objectives(info: RequestInfo, arrival: float, first_token: float | None,
                     finished: float, num_tokens: int) -> bool:
    """Whether a sample met its TTFT (arrival to first token) and TPOT ((finish - first token)
    / (tokens - 1); 0 for one token) objectives, on the frontend's clock."""
    if first_token is None:
        return False
    tpot = (finished - first_token) / (num_tokens - 1) if num_tokens > 1 else 0.0
    return ((info.ttft is None or first_token - arrival <= info.ttft)
            and (info.tpot is None or tpot <= info.tpot))


def exit_status(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
