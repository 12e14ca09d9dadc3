"""AsyncEngine: the client of the engine process, one async stream per request.

Layout: the core loop runs in a child process (treadle/core/engine_process.py), and the
frontend process does HTTP, tokenizing and detokenizing; it never imports torch. Typed messages
(treadle/core/messages.py) cross two pipes. In the frontend, a reader thread receives each
step's token outputs, detokenizes them (OutputProcessor) and hands the deltas to the event loop,
which only moves them into each request's queue: nothing slow runs on the event loop. Admission
(treadle/frontend/admission.py) checks each request before it is sent; the RequestObserver
(treadle/frontend/observer.py) records its metrics, timeline and log line.

Threads: torch with 2 intra-op threads slows badly when another process keeps a core busy, so one
engine thread looked safer on 2 cores. Measured (`treadle bench serve`, 200 ShareGPT-like
requests at once, bf16): 1 engine thread 121 output tok/s, 2 threads 216 (the offline API: 212).
Between steps the frontend's work is short and the engine's steps are long, so the default is
torch's own: one thread per core.

Supervision: the frontend watches its engine. When the process dies (its output pipe closes),
every in-flight request ends at once with EngineUnavailable, the status turns "restarting" and a
fresh process (all KV blocks free) starts after a backoff; past `max_engine_restarts` in a row
the status is "dead" for good. An engine alive but with no step finished for
`engine_stall_timeout` while it has work (or with no heartbeat at all) is "stalled": not ready,
but not restarted, since it may recover and its requests are not lost; the orchestrator's
liveness probe decides how long to wait.

Data parallelism (data_parallel_size > 1): a ReplicaGroup (treadle/frontend/data_parallel.py) of
Ray actors stands where the engine process, its pipes and its sender stand; it routes each
request to a replica, retries or fails (RequestFailed) the requests of a replica that dies, and
Ray restarts that replica; the group as a whole is supervised as one engine process is.

Ids: the keys of `generate` come from `reserve_request_id`: a client's X-Request-Id sanitised
(letters, digits and `-_.:@+=~`, at most 128 characters; others become `_`) or a fresh uuid, with
a suffix (`~2`, ...) while another request in flight holds it; held until `release_request_id`.
Derived ids (a prompt of a batch, one of n samples) add `/i`, which no client id contains, so no
client can reach or collide with another's request. gRPC's request_id stays a label its frontend
maps to its own ids.

Objectives: a request may carry a TTFT and a TPOT objective (seconds; server-wide defaults
apply otherwise). The engine process may refuse a request at once by its policy's admission
(under deadlines: a TTFT or TPOT it predicts it cannot meet): EngineOverloaded, its reason the
policy's name; under every policy the metrics count the samples that finished within their
objectives (goodput).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import string
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from treadle.config import AsyncEngineConfig
from treadle.core.engine_process import engine_process
from treadle.core.generation_defaults import sampling_defaults
from treadle.core.messages import (
    INVALID_REQUEST,
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineOutput,
    EngineReady,
    RequestFailed,
    RequestRejected,
    Shutdown,
    StepOutputs,
)
from treadle.core.request import DEFAULT_TENANT
from treadle.core.sampling_params import SamplingParams, check_max_logprobs
from treadle.frontend.admission import Admission, EngineOverloaded
from treadle.frontend.data_parallel import ReplicaGroup, import_ray
from treadle.frontend.observer import RequestObserver
from treadle.frontend.output_processor import OutputProcessor, RequestState, SampleDelta
from treadle.frontend.request_sender import RequestSender
from treadle.model.source import resolve_model
from treadle.observability.live import LiveFeed
from treadle.observability.metrics import ServerMetrics
from treadle.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

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


MAX_REQUEST_ID_CHARS = 128
REQUEST_ID_CHARS = frozenset(string.ascii_letters + string.digits + "-_.:@+=~")


def sanitize_request_id(value: str) -> str:
    """A client's request id as Treadle keys it: at most MAX_REQUEST_ID_CHARS, each character
    outside REQUEST_ID_CHARS (URL-safe, no `/`, which derived ids use) replaced by `_`."""
    return "".join(c if c in REQUEST_ID_CHARS else "_" for c in value[:MAX_REQUEST_ID_CHARS])


class EngineUnavailable(RuntimeError):
    """The engine cannot serve: it died (restarting, or not), or the server is shutting down.
    `kind` says which to clients: "engine_error" or "server_shutdown"."""

    def __init__(self, message: str, kind: str = "engine_error") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class RequestUpdate:
    deltas: list[SampleDelta]
    state: RequestState  # live: the reader thread goes on updating it
    finished: bool  # whether this update ends the request, fixed when it was made


@dataclass
class LoadState:
    """The engine's last reported load, and when it last made progress (frontend clock)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    has_work: bool = False
    last_progress: float = field(default_factory=time.monotonic)
    last_message: float = field(default_factory=time.monotonic)


class AsyncEngine:
    def __init__(self, config: AsyncEngineConfig) -> None:
        """Finds the model's tokenizer (ValueError for a bad model path); `start()` starts the
        engine process."""
        self.config = config
        source = resolve_model(config.engine.model.model)
        self.model_name = source.name
        self.tokenizer = Tokenizer.from_folder(source.folder)
        if config.data_parallel.data_parallel_size > 1:
            import_ray()  # ValueError now, saying how to install it, if it is missing
        # For requests that leave them out (--generation-config).
        self.sampling_defaults = sampling_defaults(source.folder,
                                                   config.engine.model.generation_config)
        self.processor = OutputProcessor(self.tokenizer)
        # The processor, admission, observer and the request pipe: shared with the reader.
        self.lock = threading.Lock()
        self.streams: dict[str, asyncio.Queue] = {}
        self.request_ids: set[str] = set()  # held by reserve_request_id
        self.metrics = ServerMetrics(self.model_name, config.observability.max_tenant_labels)
        self.admission = Admission(config.admission)
        self.observer = RequestObserver(self.metrics, config.observability, self.tokenizer)
        self.live = LiveFeed()  # recent steps, requests and latencies: the dashboard's
        self.load_state = LoadState()
        self.max_model_len = 0  # these three are known once the engine has started
        self.num_blocks = 0
        self.vocab_size = 0
        self.platform: dict = {}  # dtype served and why, fast paths: from the engine process
        self.memory: dict = {}  # weights and KV cache (EngineReady.memory)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # starting → ok ⇄ stalled; a death: restarting → ok, or dead; shutdown: stopping.
        self.status = "starting"
        self.listeners: list[Callable[[str], None]] = []  # called on the loop at each change
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
        """Start an engine process (with data_parallel_size > 1: the Ray replicas, which stand
        where the process, its pipes and its sender stand), wait for its ready message, start
        reading its outputs."""
        if self.config.data_parallel.data_parallel_size > 1:
            group = ReplicaGroup(self.config, self.metrics, self.live)
            spawned = time.monotonic()
            try:
                first = await asyncio.to_thread(group.start)
            except BaseException:  # cancelled by a shutdown, or Ray failed
                group.kill()
                raise
            self._started(first, spawned, group, group, group)
            return
        context = multiprocessing.get_context("spawn")
        requests_in, requests_out = context.Pipe(duplex=False)
        outputs_in, outputs_out = context.Pipe(duplex=False)
        process = context.Process(target=engine_process, name="treadle-engine",
                                  args=(self.config.engine, requests_in, outputs_out),
                                  daemon=True)
        spawned = time.monotonic()
        process.start()
        requests_in.close()
        outputs_out.close()
        try:
            first = await asyncio.to_thread(outputs_in.recv)
        except EOFError:
            await asyncio.to_thread(process.join, 1)
            first = EngineFailed(f"the engine process exited while loading "
                                 f"({exit_status(process)})")
        except BaseException:  # cancelled by a shutdown: the reading thread ends at EOF
            process.kill()
            raise
        sender = RequestSender(requests_out) if isinstance(first, EngineReady) else None
        self._started(first, spawned, process, outputs_in, sender)

    def _started(self, first: EngineReady | EngineFailed, spawned: float, process,
                 outputs_in, sender) -> None:
        """Take the engine's ready message (RuntimeError for a failure) and start reading."""
        if not isinstance(first, EngineReady):
            process.kill()
            raise RuntimeError(f"the engine failed to start: {first.error}")
        self.max_model_len, self.num_blocks = first.max_model_len, first.num_blocks
        self.metrics.labels(self.metrics.kv_blocks).set(self.num_blocks)
        self.vocab_size, self.platform = first.vocab_size, first.platform
        self.memory = first.memory
        logger.info("engine ready in %.1f s: dtype %s (%s); %s, oneDNN linear %s, native "
                    "attention %s, quantization %s (%s; integer kernel up to rows: %s)",
                    time.monotonic() - spawned, self.platform["dtype"],
                    self.platform["dtype_reason"], self.platform["isa"],
                    self.platform["onednn_linear"], self.platform["native_attention"],
                    self.platform["quantization"], self.platform["quantized_types"],
                    self.platform["gemv_rows"])
        with self.lock:
            self.process, self.sender = process, sender
            self.load_state = LoadState()
        self.started_at = time.monotonic()
        threading.Thread(target=self._read_outputs, args=(outputs_in, process, self.sender),
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
        with self.lock:
            self.sender.send(Shutdown())
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
        timeout = self.config.supervision.engine_stall_timeout
        if now - state.last_message > timeout:  # not even a heartbeat
            return True
        return state.has_work and now - state.last_progress > timeout

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
        self.live.engine_restarted()
        self.load_state = LoadState()
        if self.status == "stopping":
            return
        if time.monotonic() - self.started_at > STABLE_SECONDS:
            self.restarts = 0
        if self.restarts < self.config.supervision.max_engine_restarts:
            self._set_status("restarting")
            self._spawn_task(self._restart())
        else:
            self._set_status("dead")

    async def _restart(self) -> None:
        """Start a new engine after a backoff, doubling it after each failed start, until one
        starts or `max_engine_restarts` in a row have been tried."""
        max_restarts = self.config.supervision.max_engine_restarts
        while self.restarts < max_restarts:
            delay = min(RESTART_BACKOFF * 2 ** self.restarts, MAX_RESTART_BACKOFF)
            self.restarts += 1
            logger.error("restarting the engine in %.1f s (restart %d of at most %d in a row)",
                         delay, self.restarts, max_restarts)
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
                self.streams.clear()
                self.admission.queued.clear()
        for queue in queues:
            queue.put_nowait(error)

    def timeline(self, request_id: str) -> dict | None:
        """A recently finished request's timeline (`id/index` for one of n samples), by its id
        or its response's (`cmpl-`, `chatcmpl-`)."""
        with self.lock:
            return self.observer.find(request_id)

    def response_finished(self, request_ids: list[str]) -> list[dict]:
        """A REST response is written: its engine requests' sample timelines, marked so."""
        with self.lock:
            return [t for request_id in request_ids
                    for t in self.observer.response_finished(request_id)]

    def reserve_request_id(self, wanted: str | None) -> str:
        """The id a request's records are keyed by: `wanted` (a client's) sanitised, or a fresh
        one, made unique among the ids held and the requests in flight."""
        base = sanitize_request_id(wanted) if wanted else uuid.uuid4().hex
        request_id, suffix = base, 1
        with self.lock:
            while (request_id in self.request_ids or request_id in self.processor.requests
                   or f"{request_id}/0" in self.processor.requests):
                suffix += 1
                request_id = f"{base[:MAX_REQUEST_ID_CHARS - 8]}~{suffix}"
            self.request_ids.add(request_id)
        return request_id

    def release_request_id(self, request_id: str) -> None:
        with self.lock:
            self.request_ids.discard(request_id)

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
        """A request's tenant: see `Admission.resolve_tenant`."""
        with self.lock:
            return self.admission.resolve_tenant(key_name, user)

    def cache_salt(self, tenant: str, cache_salt: str | None) -> str | None:
        """The salt the engine gets: see `Admission.cache_salt`."""
        return self.admission.cache_salt(tenant, cache_salt)

    def check_capacity(self, num_prompt_tokens: int = 0, tenant: str = DEFAULT_TENANT) -> None:
        """Raise EngineOverloaded if a request of that many prompt tokens would overfill the
        queue, or pass its tenant's limits; counted in the rejection metrics. Cheap: frontends
        call it before tokenizing, and generate() again with the count."""
        try:
            with self.lock:
                self.admission.check_capacity(num_prompt_tokens, tenant)
        except EngineOverloaded as e:
            self.metrics.labels(self.metrics.rejections, reason=e.reason,
                                tenant=self.metrics.tenant_label(tenant)).inc()
            self.live.rejected(e.reason, time.monotonic())
            raise

    def check_prompt_token_ids(self, prompt_token_ids: list[int]) -> None:
        """ValueError for an id outside the vocabulary. The engine checks too, but the frontend
        decodes prompts first (the detokenizer's context, echo), and the tokenizer overflows on a
        negative id."""
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[0]}")

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0, *,
                       tenant: str = DEFAULT_TENANT, cache_salt: str | None = None,
                       ttft: float | None = None, tpot: float | None = None,
                       received: float | None = None, pooling: bool = False
                       ) -> AsyncIterator[RequestUpdate]:
        """Updates as tokens arrive. `request_id` is the server's own, unique among requests in
        flight (ValueError otherwise); `received`: when the frontend received the request
        (time.monotonic(); None: now), where its breakdown starts. `tenant`: from
        resolve_tenant; `ttft`, `tpot`: objectives in seconds (None: the server's defaults).
        ValueError before any update if the engine refuses the request, EngineOverloaded if the
        queue is full, a tenant limit is reached or (deadline policy) its TTFT or TPOT cannot be
        met, EngineUnavailable if the engine is down or dies, or the server shuts down. Leaving the
        iteration early (a disconnect) aborts the request; one that waits past max_queue_wait
        finishes with finish_reason "queue_timeout". `pooling`: an embedding request (prefill
        only, sharing batches with generation; of `params` only n=1 matters): its one update
        finishes it, with its state's `embedding`."""
        self.check_available()
        self.check_prompt_token_ids(prompt_token_ids)
        check_max_logprobs(params, self.config.engine.model.max_logprobs)
        salt = self.cache_salt(tenant, cache_salt)
        num_tokens = len(prompt_token_ids) * params.n
        self.check_capacity(num_tokens, tenant)
        ttft, tpot = self.admission.objectives(ttft, tpot)
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            engine_requests = self.processor.add_request(request_id, prompt_token_ids, params)
            self.streams[request_id] = queue
            self.admission.admit(request_id, tenant, num_tokens)
            self.observer.start(request_id, tenant, ttft, tpot, received)
            self.live.start(request_id, params.n, tenant, priority, len(prompt_token_ids),
                            time.monotonic() if received is None else received)
            # To a dead engine they are dropped: the reader has seen its end, or is about to,
            # and then fails this stream with the others.
            for engine_id, engine_params in engine_requests:
                self.sender.send(AddRequest(
                    engine_id, prompt_token_ids, engine_params, priority, tenant, salt,
                    ttft, tpot, pooling))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                with self.lock:
                    self.admission.started(request_id)
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
                self.sender.send(AbortRequest(sample.engine_request_id))
                deltas.append(SampleDelta(request_id, sample.index, "", [], None, True, "abort"))
                self.observer.observe(deltas[-1], state)
        # call_soon, not put_nowait: after the updates the reader has already scheduled.
        self.loop.call_soon(queue.put_nowait, RequestUpdate(deltas, state, True))
        return True

    def _forget(self, request_id: str, abort: bool) -> None:
        with self.lock:
            self.admission.release(request_id)
            self.observer.forget(request_id)
            self.live.forget(request_id, time.monotonic())
            self.streams.pop(request_id, None)
            if abort and self.process is not None:
                for engine_id in self.processor.engine_ids(request_id):
                    self.sender.send(AbortRequest(engine_id))
            self.processor.remove(request_id)

    def _read_outputs(self, outputs: Connection, process: multiprocessing.process.BaseProcess,
                      sender: RequestSender) -> None:
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
        sender.close()
        if not self.closing:  # shutdown() joins it itself
            process.join(1)  # for its exit code: a dead process's end comes at once
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server has exited
            self.loop.call_soon_threadsafe(self._engine_exited, process)

    def _receive(self, message: EngineOutput) -> None:
        self.load_state.last_message = time.monotonic()
        if isinstance(message, RequestRejected):
            self._reject(message)
            return
        if isinstance(message, RequestFailed):
            self._fail_request(message)
            return
        load, step = message.load, message.step
        self.metrics.observe_engine(
            load.num_running, load.num_waiting, load.kv_cache_usage,
            (load.prefix_cache_queries, load.prefix_cache_hits, load.num_preemptions),
            None if step is None else step.num_prefill_tokens + step.num_decode_tokens)
        self.live.record_engine(load, step, message.census, self.load_state.last_message)
        state = self.load_state
        if step is not None or not load.has_work:  # a step ran, or no work
            state.last_progress = state.last_message
        state.running, state.waiting = load.num_running, load.num_waiting
        state.kv_cache_usage, state.has_work = load.kv_cache_usage, load.has_work
        if message.outputs:
            self._dispatch(message)

    def _dispatch(self, message: StepOutputs) -> None:
        with self.lock:
            deltas, to_abort = self.processor.process(message.outputs)
            for engine_id in to_abort:
                self.sender.send(AbortRequest(engine_id))
            updates: dict[str, list[SampleDelta]] = {}
            now = time.monotonic()
            for delta in deltas:
                updates.setdefault(delta.request_id, []).append(delta)
                self.observer.observe(delta, self.processor.requests[delta.request_id])
                self.live.observe(delta, now)
            for request_id, request_deltas in updates.items():
                queue = self.streams.get(request_id)
                if queue is not None:
                    state = self.processor.requests[request_id]
                    update = RequestUpdate(request_deltas, state, state.finished)
                    self.loop.call_soon_threadsafe(queue.put_nowait, update)

    def _reject(self, message: RequestRejected) -> None:
        """The engine refused a request: invalid (ValueError), or refused by its policy
        (EngineOverloaded, the reason its name: under deadlines, a TTFT or TPOT it cannot
        meet)."""
        with self.lock:
            entry = self.processor.samples.get(message.request_id)
            request_id = entry[0].request_id if entry is not None else None
            label = self.observer.tenant_label(request_id)
            queue = self.streams.get(request_id) if request_id is not None else None
        self.metrics.labels(self.metrics.rejections, reason=message.reason, tenant=label).inc()
        self.live.rejected(message.reason, time.monotonic())
        if queue is not None:
            error = (ValueError(message.message) if message.reason == INVALID_REQUEST
                     else EngineOverloaded(message.message, reason=message.reason))
            self.loop.call_soon_threadsafe(queue.put_nowait, error)

    def _fail_request(self, message: RequestFailed) -> None:
        """The replica running one of a request's samples died: the request ends with
        EngineUnavailable (its other samples are aborted as it ends)."""
        with self.lock:
            entry = self.processor.samples.get(message.request_id)
            queue = self.streams.get(entry[0].request_id) if entry is not None else None
        if queue is not None:
            self.loop.call_soon_threadsafe(queue.put_nowait, EngineUnavailable(message.message))


def exit_status(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
