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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch
from transformers import AutoTokenizer

from treadle.config import DEFAULT_DTYPE, CacheConfig, ModelConfig, SchedulerConfig
from treadle.engine.core import EngineCore, StepStats
from treadle.engine.output_processor import OutputProcessor, RequestState, SampleDelta
from treadle.engine.sampling_params import SamplingParams
from treadle.model.capabilities import torch_dtype
from treadle.model.loader import load_model, resolve_model
from treadle.observability.metrics import ServerMetrics
from treadle.observability.step_trace import StepTraceWriter

logger = logging.getLogger(__name__)

# The engine reports its load at least this often when idle; /ready goes false when a busy
# engine has not finished a step for STALL_SECONDS.
HEARTBEAT_SECONDS = 1.0
STALL_SECONDS = 30.0


class EngineOverloaded(Exception):
    """The waiting queue is full: the client should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


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


def engine_process(args: EngineArgs, requests, outputs) -> None:
    """The child: build the core and serve it until told to shut down."""
    # The child's own log lines (the first start's kernel build, a dtype warning) to stderr.
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s treadle-engine %(name)s: %(message)s")
    if args.engine_threads is not None:
        torch.set_num_threads(args.engine_threads)
    try:
        loaded = load_model(args.model, torch_dtype(args.dtype))
        core = EngineCore(
            loaded, ModelConfig(model=args.model, dtype=args.dtype,
                                max_model_len=args.max_model_len),
            CacheConfig(kv_cache_memory_bytes=args.kv_cache_memory_bytes),
            SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens),
            policy=args.policy)
    except Exception as e:
        outputs.send(("failed", f"{type(e).__name__}: {e}"))
        return
    outputs.send(("ready", core.max_model_len, core.runner.num_blocks,
                  core.runner.spec.vocab_size, core.runner.platform_info()))
    trace = StepTraceWriter(args.trace_file) if args.trace_file else None
    try:
        serve_engine(core, requests, outputs, trace)
    finally:
        if trace is not None:
            trace.close()


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
                    _, request_id, prompt_token_ids, params, priority = message
                    try:
                        core.add_request(request_id, prompt_token_ids, params, priority)
                    except ValueError as e:
                        outputs.send(("rejected", request_id, str(e)))
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
                 log_prompts: bool = False, max_timelines: int = 1000) -> None:
        self.args = EngineArgs(model, dtype, max_model_len, kv_cache_memory_bytes, max_num_seqs,
                               max_num_batched_tokens, policy, engine_threads, trace_file)
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        # Requests sent to the engine that have produced no token yet, with their prompt tokens
        # (times n): the queue admission bounds, known here at once, unlike the engine's counts.
        self.queued: dict[str, int] = {}
        source = resolve_model(self.args.model)
        self.model_name = source.name
        self.tokenizer = AutoTokenizer.from_pretrained(str(source.folder))
        self.processor = OutputProcessor(self.tokenizer)
        self.lock = threading.Lock()  # the processor and the request pipe, shared with the reader
        self.streams: dict[str, asyncio.Queue] = {}
        self.metrics = ServerMetrics(self.model_name)
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
        self.errored = False
        self.closing = False  # shutdown() has begun: the engine process is meant to stop

    async def start(self) -> None:
        """Spawn the engine process and wait until its model is loaded."""
        context = multiprocessing.get_context("spawn")
        self.requests_out, requests_in = context.Pipe(duplex=False)[::-1]
        outputs_in, outputs_out = context.Pipe(duplex=False)
        self.process = context.Process(target=engine_process, name="treadle-engine",
                                       args=(self.args, requests_in, outputs_out), daemon=True)
        spawned = time.monotonic()
        self.process.start()
        requests_in.close()
        outputs_out.close()
        self.outputs_in = outputs_in
        first = await asyncio.to_thread(outputs_in.recv)
        if first[0] != "ready":
            raise RuntimeError(f"the engine failed to start: {first[1]}")
        _, self.max_model_len, self.num_blocks, self.vocab_size, self.platform = first
        logger.info("engine ready in %.1f s: dtype %s (%s); %s, oneDNN linear %s, native "
                    "attention %s", time.monotonic() - spawned, self.platform["dtype"],
                    self.platform["dtype_reason"], self.platform["isa"],
                    self.platform["onednn_linear"], self.platform["native_attention"])
        self.loop = asyncio.get_running_loop()
        self.reader = threading.Thread(target=self._read_outputs, name="treadle-outputs",
                                       daemon=True)
        self.reader.start()

    async def shutdown(self) -> None:
        if self.process is None:
            return
        self.closing = True
        with self.lock, contextlib.suppress(OSError):  # the engine may be gone already
            self.requests_out.send(("shutdown",))
        await asyncio.to_thread(self.process.join, 10)
        if self.process.is_alive():
            self.process.kill()
        self.process = None

    def timeline(self, request_id: str) -> dict | None:
        """A recently finished request's timeline (`id/index` for one of n samples)."""
        return self.timelines.get(request_id)

    def load(self) -> dict:
        return {"running": self.load_state.running, "waiting": self.load_state.waiting,
                "kv_cache_usage": self.load_state.kv_cache_usage}

    def is_ready(self) -> bool:
        """Alive, and a busy engine finished a step within STALL_SECONDS."""
        if self.errored or self.process is None or not self.process.is_alive():
            return False
        state = self.load_state
        return not state.has_work or time.monotonic() - state.last_progress < STALL_SECONDS

    def check_capacity(self, num_prompt_tokens: int = 0) -> None:
        """Raise EngineOverloaded if a request of that many prompt tokens would overfill the
        queue. Cheap: frontends call it before tokenizing, and generate() again with the count."""
        if self.max_queued_requests is not None and len(self.queued) >= self.max_queued_requests:
            self.metrics.labels(self.metrics.rejections, reason="queue_full").inc()
            raise EngineOverloaded(f"the server has {len(self.queued)} requests queued, its "
                                   f"limit; retry later")
        queued_tokens = sum(self.queued.values())
        # A prompt larger than the limit alone still goes when nothing is queued: it would
        # otherwise never go.
        if (self.max_queued_tokens is not None and queued_tokens
                and queued_tokens + num_prompt_tokens > self.max_queued_tokens):
            self.metrics.labels(self.metrics.rejections, reason="queued_tokens_full").inc()
            raise EngineOverloaded(f"the server has {queued_tokens} prompt tokens queued; "
                                   f"{num_prompt_tokens} more exceed its limit of "
                                   f"{self.max_queued_tokens}; retry later")

    def check_prompt_token_ids(self, prompt_token_ids: list[int]) -> None:
        """ValueError for an id outside the vocabulary. The engine checks too, but the frontend
        decodes prompts first (the detokenizer's context, echo), and the tokenizer overflows on a
        negative id."""
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[0]}")

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0
                       ) -> AsyncIterator[RequestUpdate]:
        """Updates as tokens arrive; ValueError before any update if the engine refuses the
        request, EngineOverloaded if the queue is full. Leaving the iteration early (a
        disconnect) aborts the request."""
        if self.loop is None or self.errored:
            raise RuntimeError("the engine is not running")
        self.check_prompt_token_ids(prompt_token_ids)
        self.check_capacity(len(prompt_token_ids) * params.n)
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            engine_requests = self.processor.add_request(request_id, prompt_token_ids, params)
            self.streams[request_id] = queue
            self.arrivals[request_id] = time.monotonic()
            self.queued[request_id] = len(prompt_token_ids) * params.n
            for engine_id, engine_params in engine_requests:
                self.requests_out.send(("add", engine_id, prompt_token_ids, engine_params,
                                        priority))
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

    async def abort(self, request_id: str) -> None:
        self._forget(request_id, abort=True)

    def _forget(self, request_id: str, abort: bool) -> None:
        with self.lock:
            self.streams.pop(request_id, None)
            self.queued.pop(request_id, None)
            self.arrivals.pop(request_id, None)
            for index in range(len(self.processor.engine_ids(request_id))):
                self.token_times.pop((request_id, index), None)
            if abort and self.process is not None:
                for engine_id in self.processor.engine_ids(request_id):
                    self.requests_out.send(("abort", engine_id))
            self.processor.remove(request_id)

    def _read_outputs(self) -> None:
        """Reader thread: receive engine messages, detokenize, hand updates to the loop."""
        while True:
            try:
                message = self.outputs_in.recv()
            except (EOFError, OSError):
                break
            if message[0] == "rejected":
                self._reject(message[1], message[2])
                continue
            _, step_outputs, (running, waiting, usage, has_work, cumulative,
                              iteration_tokens) = message
            self.metrics.observe_engine(running, waiting, usage, cumulative, iteration_tokens)
            now = time.monotonic()
            state = self.load_state
            if step_outputs or not has_work:
                state.last_progress = now
            state.running, state.waiting, state.kv_cache_usage = running, waiting, usage
            state.has_work = has_work
            if step_outputs:
                self._dispatch(step_outputs)
        self.errored = True
        if not self.closing:
            logger.error("the engine process has stopped")
        for queue in list(self.streams.values()):
            self.loop.call_soon_threadsafe(queue.put_nowait,
                                           RuntimeError("the engine process stopped"))

    def _dispatch(self, step_outputs: list) -> None:
        with self.lock:
            deltas, to_abort = self.processor.process(step_outputs)
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
        if delta.token_ids:
            first, last = self.token_times.get(key, (None, None))
            if last is None:
                m.labels(m.ttft).observe(now - arrival)
                if delta.index == 0:
                    state = self.processor.requests[delta.request_id]
                    m.labels(m.prompt_tokens).inc(len(state.prompt_token_ids))
            else:
                m.labels(m.itl).observe(now - last)
            self.token_times[key] = (first or now, now)
            m.labels(m.generation_tokens).inc(len(delta.token_ids))
        if delta.finished:
            m.labels(m.request_success, finished_reason=delta.finish_reason).inc()
            m.labels(m.e2e).observe(now - arrival)
            if delta.timings is not None:
                for metric, seconds in zip((m.queue_time, m.prefill_time, m.decode_time),
                                           delta.timings, strict=True):
                    m.labels(metric).observe(seconds)
            self._record_finish(delta, arrival, self.token_times.get(key, (None, None))[0], now)

    def _record_finish(self, delta: SampleDelta, arrival: float, first_token: float | None,
                       now: float) -> None:
        state = self.processor.requests[delta.request_id]
        sample = state.samples[delta.index]
        name = delta.request_id if len(state.samples) == 1 else f"{delta.request_id}/{delta.index}"
        ttft = None if first_token is None else round(first_token - arrival, 6)
        # Both clocks are CLOCK_MONOTONIC, shared by the frontend and the engine process.
        self.timelines[name] = {
            "request_id": delta.request_id, "index": delta.index,
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
        logger.info("request %s finished: %s, prompt %d tokens (%d cached), output %d tokens, "
                    "ttft %s s, e2e %.3f s%s", name, delta.finish_reason,
                    len(state.prompt_token_ids), state.num_cached_tokens, len(sample.token_ids),
                    "-" if ttft is None else f"{ttft:.3f}", now - arrival, prompt)

    def _reject(self, engine_id: str, message: str) -> None:
        self.metrics.labels(self.metrics.rejections, reason="invalid_request").inc()
        with self.lock:
            entry = self.processor.samples.get(engine_id)
            if entry is None:
                return
            request_id = entry[0].request_id
            queue = self.streams.get(request_id)
        if queue is not None:
            self.loop.call_soon_threadsafe(queue.put_nowait, ValueError(message))
