"""AsyncEngine: the engine's client in the frontend process, one async stream per request.

The engine runs elsewhere (an EngineClient: a child process by default, Ray replicas under
data parallelism; engine_client.py); this process does HTTP, tokenizing and detokenizing, and
never imports torch. A reader thread receives each step's token outputs, detokenizes them
(OutputProcessor) and hands the deltas to the event loop, which only moves them into each
request's queue: nothing slow runs on the event loop. `admit` decides once, for REST and gRPC
alike, who a request is for and whether the queue can take it (admission.py); the
RequestObserver records its metrics, timeline and log line; the EngineSupervisor restarts a dead
engine and reports a stalled one (supervisor.py); RequestIds keys every request's records
(request_ids.py).

Threads: torch's intra-op threads default to one per core. Between steps the frontend's work is
short and the engine's steps are long, so the engine may take every core.

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
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from treadle.config import AsyncEngineConfig
from treadle.core.generation_defaults import sampling_defaults
from treadle.core.lora_request import LoRARequest
from treadle.core.messages import (
    INVALID_REQUEST,
    AbortRequest,
    AddRequest,
    EngineOutput,
    EngineReady,
    RequestFailed,
    RequestRejected,
    StepOutputs,
)
from treadle.core.request import DEFAULT_TENANT
from treadle.core.sampling_params import SamplingParams, check_max_logprobs
from treadle.errors import PROMPT, InvalidField
from treadle.frontend.admission import Admission, Admitted, EngineOverloaded, objective_seconds
from treadle.frontend.data_parallel import ReplicaGroup, import_ray
from treadle.frontend.engine_client import EngineClient
from treadle.frontend.observer import RequestObserver
from treadle.frontend.output_processor import OutputProcessor, RequestState, SampleDelta
from treadle.frontend.process_client import ProcessEngineClient
from treadle.frontend.request_ids import RequestIds
from treadle.frontend.supervisor import UNAVAILABLE, EngineSupervisor, EngineUnavailable
from treadle.model.source import resolve_model
from treadle.observability.live import LiveFeed
from treadle.observability.metrics import ServerMetrics
from treadle.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The engine stops after its current step; past this (a slow step on a loaded machine) it is
# killed, so that the server exits within its shutdown timeout and a second.
SHUTDOWN_JOIN_SECONDS = 0.5


@dataclass
class RequestUpdate:
    deltas: list[SampleDelta]
    state: RequestState  # live: the reader thread goes on updating it
    finished: bool  # whether this update ends the request, fixed when it was made


@dataclass(frozen=True)
class Stream:
    """Where one engine request's updates go: its client request's queue, with its prompt's
    index there."""

    queue: asyncio.Queue
    index: int

    def put(self, item: RequestUpdate | Exception) -> None:
        self.queue.put_nowait((self.index, item))


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
        engine."""
        self.config = config
        source = resolve_model(config.engine.model.model)
        self.model_name = source.name
        self.tokenizer = Tokenizer.from_folder(source.folder)
        self.tokenizer_file = source.folder / "tokenizer.json"  # for the frontend's grammars
        if config.data_parallel.data_parallel_size > 1:
            import_ray()  # ValueError now, saying how to install it, if it is missing
        # For requests that leave them out (--generation-config).
        self.sampling_defaults = sampling_defaults(source.folder,
                                                   config.engine.model.generation_config)
        self.processor = OutputProcessor(self.tokenizer)
        # The processor, admission, observer, request ids and the client: shared with the reader.
        self.lock = threading.Lock()
        self.streams: dict[str, Stream] = {}
        # A request's samples held back until sample 0 (by its engine id) has prefilled the
        # prompt: asking for prompt logprobs, only it computes them, and it shares no prefix; a
        # prompt longer than one step's chunk, else each sample computes it again (samples in
        # one step hit only the blocks of sample 0's first chunk).
        # Samples held until their request's sample 0 has prefilled, by sample 0's engine id,
        # with when it was sent.
        self.after_prefill: dict[str, tuple[float, list[AddRequest]]] = {}
        engine = config.engine
        self.one_chunk = min(engine.scheduler.long_prefill_token_threshold,
                             engine.scheduler.max_num_batched_tokens) \
            if engine.cache.enable_prefix_caching else None
        self.request_ids = RequestIds(self.lock, self._holds_id)
        self.metrics = ServerMetrics(self.model_name, config.observability.max_tenant_labels)
        self.admission = Admission(config.admission)
        self.observer = RequestObserver(self.metrics, config.observability, self.tokenizer)
        self.live = LiveFeed()  # recent steps, requests and latencies: the dashboard's
        self.load_state = LoadState()
        self.max_model_len = 0  # these three are known once the engine has started
        self.num_blocks = 0
        self.vocab_size = 0
        self.platform: dict = {}  # dtype served and why, fast paths: from the engine
        self.memory: dict = {}  # weights and KV cache (EngineReady.memory)
        self.client: EngineClient | None = None  # the engine serving now
        self.loop: asyncio.AbstractEventLoop | None = None
        self.supervisor = EngineSupervisor(config.supervision, self._spawn, self._stalled)
        self.closing = False  # shutdown() has begun: the engine is meant to stop

    @property
    def status(self) -> str:
        """starting, ok, stalled, restarting, dead or stopping (supervisor.py)."""
        return self.supervisor.status

    async def start(self) -> None:
        """Start the engine and wait until its model is loaded; then watch it."""
        self.loop = asyncio.get_running_loop()
        await self.supervisor.start()

    def _new_client(self) -> EngineClient:
        if self.config.data_parallel.data_parallel_size > 1:
            return ReplicaGroup(self.config, self.metrics, self.live)
        return ProcessEngineClient(self.config.engine)

    async def _spawn(self) -> None:
        """Start an engine, wait for its ready message (RuntimeError for a failure), start
        reading its outputs."""
        client = self._new_client()
        spawned = time.monotonic()
        try:
            first = await asyncio.to_thread(client.start)
        except BaseException:  # cancelled by a shutdown
            client.kill()
            raise
        if not isinstance(first, EngineReady):
            client.kill()
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
            self.client = client
            self.load_state = LoadState()
        threading.Thread(target=self._read_outputs, args=(client,), name="treadle-outputs",
                         daemon=True).start()

    async def shutdown(self) -> None:
        """End what is in flight (server_shutdown), stop the engine (killed if it does not stop
        within SHUTDOWN_JOIN_SECONDS)."""
        self.closing = True
        self.drain()
        self.fail_all(EngineUnavailable(UNAVAILABLE["stopping"], "server_shutdown"))
        await self.supervisor.shutdown()
        with self.lock:
            client, self.client = self.client, None
        if client is not None:
            await asyncio.to_thread(client.stop, SHUTDOWN_JOIN_SECONDS)

    def add_listener(self, listener: Callable[[str], None]) -> None:
        """Call `listener(status)` on the event loop at each status change."""
        self.supervisor.add_listener(listener)

    def _stalled(self) -> bool:
        state, now = self.load_state, time.monotonic()
        timeout = self.config.supervision.engine_stall_timeout
        if now - state.last_message > timeout:  # not even a heartbeat
            return True
        return state.has_work and now - state.last_progress > timeout

    def _engine_exited(self, client: EngineClient) -> None:
        """On the loop, when an engine's outputs end: unless it was told to stop, end every
        request in flight and let the supervisor restart it."""
        if client is not self.client:  # shutdown() stopped it
            return
        how = client.exit_status()
        logger.error("the engine died (%s)", how)
        with self.lock:
            self.client = None
        self._fail_streams(EngineUnavailable(f"the engine died ({how}) while running this "
                                             f"request"), engine_gone=True)
        self.metrics.observe_engine(0, 0, 0.0, (0, 0, 0), None)  # a fresh engine counts from 0
        self.metrics.observe_spec_decode((0, 0, 0))
        self.live.engine_restarted()
        self.load_state = LoadState()
        self.supervisor.engine_died()

    def drain(self) -> None:
        """The server is stopping: refuse new requests; those in flight go on."""
        self.supervisor.drain()

    def fail_all(self, error: EngineUnavailable) -> None:
        """End every request in flight now with `error`, each stream's last item (the server
        is shutting down)."""
        self._fail_streams(error, engine_gone=False)

    def _fail_streams(self, error: Exception, engine_gone: bool) -> None:
        with self.lock:
            streams = list(self.streams.values())
            if engine_gone:  # nothing to abort: forget every request here at once
                for request_id in list(self.processor.requests):
                    self.processor.remove(request_id)
                self.streams.clear()
                self.after_prefill.clear()
                self.admission.drop_queued()
        for stream in streams:
            stream.put(error)

    def timeline(self, request_id: str, tenant: str | None = None) -> dict | None:
        """A recently finished request's timeline (`id/index` for one of n samples), by its id
        or its response's (`cmpl-`, `chatcmpl-`); only `tenant`'s (None: anyone's)."""
        with self.lock:
            return self.observer.find(request_id, tenant)

    def response_finished(self, request_ids: list[str]) -> list[dict]:
        """A REST response is written: its engine requests' sample timelines, marked so."""
        with self.lock:
            return [t for request_id in request_ids
                    for t in self.observer.response_finished(request_id)]

    def _holds_id(self, request_id: str) -> bool:
        """A request in flight, or a recently finished one's timeline, is keyed by `request_id`
        (the lock held): a client reusing a finished request's id gets another, so that the
        first request's records stay its own."""
        return request_id in self.processor.requests or \
            f"{request_id}/0" in self.processor.requests or self.observer.holds(request_id)

    def load(self) -> dict:
        return {"running": self.load_state.running, "waiting": self.load_state.waiting,
                "kv_cache_usage": self.load_state.kv_cache_usage}

    def is_ready(self) -> bool:
        """Serving and making progress."""
        return self.status == "ok"

    def check_available(self) -> None:
        """EngineUnavailable unless the engine takes requests (a stalled one does: it may
        recover). Cheap: frontends call it first, so a request to a dead engine fails at once."""
        self.supervisor.check_available()

    def admit(self, key_name: str | None = None, user: str | None = None, *,
              ttft_ms: float | str | None = None, tpot_ms: float | str | None = None,
              cache_salt: str | None = None, num_prompts: int = 1,
              prompt_field: str = PROMPT) -> Admitted:
        """What both frontends decide before any costly work: EngineUnavailable for a down
        engine, first; its tenant (the key's name, else `user`), its objectives (ms, a number or
        a header's text) and salt (InvalidField naming a bad one); InvalidField naming
        `prompt_field` for more prompts than a tenant may ever have in flight; EngineOverloaded
        when the queue or the tenant's limits cannot take it now. `generate_batch` checks the
        limits again with the prompts' size."""
        self.check_available()
        with self.lock:
            tenant = self.admission.resolve_tenant(key_name, user)
        admitted = Admitted(tenant, cache_salt or None, objective_seconds("ttft_ms", ttft_ms),
                            objective_seconds("tpot_ms", tpot_ms))
        self.admission.cache_salt(tenant, cache_salt)  # its length
        try:
            self.check_capacity(tenant=tenant, num_requests=num_prompts)
        except InvalidField as e:
            raise e.renamed({PROMPT: prompt_field}) from None
        return admitted

    def check_capacity(self, num_prompt_tokens: int = 0, tenant: str = DEFAULT_TENANT,
                       num_requests: int = 1) -> None:
        """Raise EngineOverloaded if a client request of `num_requests` prompts and that many
        prompt tokens would overfill the queue, or pass its tenant's limits now (counted in
        the rejection metrics); InvalidField if it has more prompts than its tenant may ever
        have in flight. Cheap: frontends call it before tokenizing, and generate_batch() again
        with the counts."""
        try:
            with self.lock:
                self.admission.check_capacity(num_prompt_tokens, tenant, num_requests)
        except EngineOverloaded as e:
            self.metrics.labels(self.metrics.rejections, reason=e.reason,
                                tenant=self.metrics.tenant_label(tenant)).inc()
            self.live.rejected(e.reason, time.monotonic())
            raise

    def check_prompt_token_ids(self, prompt_token_ids: list[int], field: str = PROMPT) -> None:
        """InvalidField naming `field` (the request's name of its prompt) for an id outside the
        vocabulary. The engine checks too, but the frontend decodes prompts first (the
        detokenizer's context, echo), and the tokenizer overflows on a negative id."""
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidField(field, f"prompt token ids must be in [0, {self.vocab_size}); got "
                               f"{bad[0]}")

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0, **options: Any
                       ) -> AsyncIterator[RequestUpdate]:
        """One prompt's updates as tokens arrive: `generate_batch` of that prompt alone
        (`options`: its keywords)."""
        async with aclosing(self.generate_batch([request_id], [prompt_token_ids], params,
                                                priority, **options)) as updates:
            async for _, update in updates:
                yield update

    async def generate_batch(self, request_ids: list[str], prompts: list[list[int]],
                             params: SamplingParams, priority: int = 0, *,
                             tenant: str = DEFAULT_TENANT, cache_salt: str | None = None,
                             ttft: float | None = None, tpot: float | None = None,
                             received: float | None = None, pooling: bool = False,
                             prompt_field: str = PROMPT, lora_request: LoRARequest | None = None
                             ) -> AsyncIterator[tuple[int, RequestUpdate]]:
        """A client request's prompts (a completions batch, embedding inputs; each its own
        engine request under `request_ids`, the server's own, unique among requests in flight),
        admitted together, and their updates as tokens arrive: (prompt index, update).
        `received`: when the frontend received the request (time.monotonic(); None: now), where
        its breakdown starts. `tenant`, `ttft`, `tpot` (seconds; None: the server's defaults):
        from `admit`. Before any update: InvalidField if the engine refuses the request (the
        prompt named `prompt_field`, the request's name of it) or it has more prompts than a
        tenant may ever have in flight, EngineOverloaded if the queue or a tenant limit cannot
        take it now or (deadline policy) its TTFT or TPOT cannot be met; EngineUnavailable if
        the engine is down or dies, or the server shuts down. Leaving the iteration early (a
        disconnect) aborts every prompt; one that waits past max_queue_wait finishes with
        finish_reason "queue_timeout". `pooling`: embedding requests (prefill only, sharing
        batches with generation; of `params` only n=1 matters): each one's single update
        finishes it, with its state's `embedding`. `lora_request`: the adapter its prompts run
        with (None: the base model)."""
        names = {PROMPT: prompt_field}
        try:
            queue = self._start(request_ids, prompts, params, priority, tenant, cache_salt, ttft,
                                tpot, received, pooling, lora_request)
        except InvalidField as e:
            raise e.renamed(names) from None
        unfinished = set(range(len(request_ids)))
        try:
            while unfinished:
                index, item = await queue.get()
                if isinstance(item, InvalidField):
                    raise item.renamed(names)
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    unfinished.discard(index)
                with self.lock:
                    self.admission.started(request_ids[index])
                yield index, item
        finally:
            for index, request_id in enumerate(request_ids):
                self._forget(request_id, abort=index in unfinished)

    def _start(self, request_ids: list[str], prompts: list[list[int]], params: SamplingParams,
               priority: int, tenant: str, cache_salt: str | None, ttft: float | None,
               tpot: float | None, received: float | None, pooling: bool,
               lora_request: LoRARequest | None = None) -> asyncio.Queue:
        """Check a client request's prompts, admit them as one and send them to the engine;
        the queue their updates arrive on."""
        self.check_available()
        for prompt in prompts:
            self.check_prompt_token_ids(prompt)
        check_max_logprobs(params, self.config.engine.model.max_logprobs)
        salt = self.admission.cache_salt(tenant, cache_salt)
        num_tokens = [len(prompt) * params.n for prompt in prompts]
        self.check_capacity(sum(num_tokens), tenant, len(prompts))
        ttft, tpot = self.admission.objectives(ttft, tpot)
        arrival = time.monotonic() if received is None else received
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            taken = [r for r in request_ids if r in self.processor.requests]
            if taken:
                raise ValueError(f"request id {taken[0]!r} is already in use")
            for index, (request_id, prompt) in enumerate(zip(request_ids, prompts, strict=True)):
                engine_requests = self.processor.add_request(request_id, prompt, params)
                self.streams[request_id] = Stream(queue, index)
                lora = None if lora_request is None else lora_request.lora_name
                self.observer.start(request_id, tenant, ttft, tpot, received, lora)
                self.live.start(request_id, params.n, tenant, priority, len(prompt), arrival,
                                lora)
                messages = [AddRequest(engine_id, prompt, engine_params, priority, tenant, salt,
                                       ttft, tpot, pooling, lora_request)
                            for engine_id, engine_params in engine_requests]
                if len(messages) > 1 and (params.prompt_logprobs is not None or (
                        self.one_chunk is not None and len(prompt) > self.one_chunk)):
                    # The other samples go once sample 0 has prefilled: they find its whole
                    # prompt in the prefix cache, and its prompt logprobs come first.
                    self.after_prefill[messages[0].request_id] = (time.monotonic(),
                                                                  messages[1:])
                    messages = messages[:1]
                # To a dead engine they are dropped: the reader has seen its end, or is about
                # to, and then fails this stream with the others.
                for message in messages:
                    self._send(message)
            self.admission.admit(request_ids[0], request_ids, tenant, num_tokens)
        return queue

    async def abort(self, request_id: str) -> bool:
        """End a request now: its stream's last update finishes each unfinished sample with
        finish_reason "abort". False if no such request is in flight."""
        with self.lock:
            state, stream = self.processor.requests.get(request_id), self.streams.get(request_id)
            if state is None or stream is None or state.finished:
                return False
            self.after_prefill.pop(state.samples[0].engine_request_id, None)
            deltas = []
            for sample in state.samples:
                if sample.finished:
                    continue
                sample.finish_reason = "abort"  # the reader drops this sample's later tokens
                self._send(AbortRequest(sample.engine_request_id))
                deltas.append(SampleDelta(request_id, sample.index, "", [], None, True, "abort"))
                self.observer.observe(deltas[-1], state)
        # call_soon, not put_nowait: after the updates the reader has already scheduled.
        self.loop.call_soon(stream.put, RequestUpdate(deltas, state, True))
        return True

    def _forget(self, request_id: str, abort: bool) -> None:
        with self.lock:
            self.admission.release(request_id)
            self.observer.forget(request_id)
            self.live.forget(request_id, time.monotonic())
            self.streams.pop(request_id, None)
            engine_ids = self.processor.engine_ids(request_id)
            if engine_ids:
                self.after_prefill.pop(engine_ids[0], None)
            if abort:
                for engine_id in engine_ids:
                    self._send(AbortRequest(engine_id))
            self.processor.remove(request_id)

    def _send(self, message: AddRequest | AbortRequest) -> None:
        """To the engine serving now (the lock held); to none, while it restarts, dropped: its
        requests have ended."""
        if self.client is not None:
            self.client.send(message)

    def _read_outputs(self, client: EngineClient) -> None:
        """Reader thread of one engine: receive its messages, detokenize, hand updates to the
        loop; at their end, tell the loop."""
        while True:
            try:
                message = client.recv()
            except EOFError:
                break
            try:
                self._receive(message)
            except Exception:  # a fault of ours: fail what is in flight, restart, never hang
                logger.exception("reading the engine's outputs failed; restarting the engine")
                client.kill()
                break
        client.close()
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server has exited
            self.loop.call_soon_threadsafe(self._engine_exited, client)

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
        self.metrics.observe_spec_decode(load.spec_decode, load.spec_decode_accepted_per_position)
        if self.config.engine.model.enable_lora:
            self.metrics.observe_loras(load.running_loras, load.waiting_loras,
                                       self.config.engine.scheduler.max_loras)
        if message.census is not None:
            self.metrics.observe_tenants(message.census.kv_blocks_by_tenant,
                                         message.census.scheduled_tokens_by_tenant)
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
                self._send(AbortRequest(engine_id))
            now = time.monotonic()
            for out in message.outputs:  # a sample 0 that prefilled: its request's other samples
                waiting = self.after_prefill.pop(out.request_id, None)
                if waiting is not None:
                    sent, samples = waiting
                    for sample in samples:
                        self._send(replace(sample, held=now - sent))
            updates: dict[str, list[SampleDelta]] = {}
            for delta in deltas:
                updates.setdefault(delta.request_id, []).append(delta)
                self.observer.observe(delta, self.processor.requests[delta.request_id])
                self.live.observe(delta, now)
            for request_id, request_deltas in updates.items():
                stream = self.streams.get(request_id)
                if stream is not None:
                    state = self.processor.requests[request_id]
                    update = RequestUpdate(request_deltas, state, state.finished)
                    self.loop.call_soon_threadsafe(stream.put, update)

    def _reject(self, message: RequestRejected) -> None:
        """The engine refused a request: invalid (InvalidField), or refused by its policy
        (EngineOverloaded, the reason its name: under deadlines, a TTFT or TPOT it cannot
        meet)."""
        with self.lock:
            entry = self.processor.samples.get(message.request_id)
            request_id = entry[0].request_id if entry is not None else None
            label = self.observer.tenant_label(request_id)
            stream = self.streams.get(request_id) if request_id is not None else None
        self.metrics.labels(self.metrics.rejections, reason=message.reason, tenant=label).inc()
        self.live.rejected(message.reason, time.monotonic())
        if stream is not None:
            error = (InvalidField(message.param, message.message)
                     if message.reason == INVALID_REQUEST
                     else EngineOverloaded(message.message, reason=message.reason))
            self.loop.call_soon_threadsafe(stream.put, error)

    def _fail_request(self, message: RequestFailed) -> None:
        """The replica running one of a request's samples died: the request ends with
        EngineUnavailable (its other samples are aborted as it ends)."""
        with self.lock:
            entry = self.processor.samples.get(message.request_id)
            stream = self.streams.get(entry[0].request_id) if entry is not None else None
        if stream is not None:
            self.loop.call_soon_threadsafe(stream.put, EngineUnavailable(message.message))

