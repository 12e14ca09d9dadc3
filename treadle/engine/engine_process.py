"""The engine process: builds the `EngineCore` and serves it over two pipes until told to stop.

Torch-free at import: the frontend imports this module for the spawn target's name only; the
core (and so torch and the kernels) is imported in the child, inside `engine_process`.
"""

from __future__ import annotations

import logging
import os
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from treadle.config import EngineConfig
from treadle.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineLoad,
    EngineReady,
    EngineRequest,
    RequestRejected,
    Shutdown,
    StepOutputs,
)
from treadle.observability.step_trace import StepTraceWriter

if TYPE_CHECKING:
    from treadle.engine.core import EngineCore, StepStats

# The engine reports its load at least this often when idle.
HEARTBEAT_SECONDS = 1.0


def engine_process(config: EngineConfig, requests: Connection, outputs: Connection) -> None:
    """The child: build the core and serve it until told to shut down."""
    # The child's own log lines (the first start's kernel build, a dtype warning) to stderr.
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s treadle-engine %(name)s: %(message)s")
    try:
        from treadle.engine.core import EngineCore

        core = EngineCore(config)
    except Exception as e:
        outputs.send(EngineFailed(f"{type(e).__name__}: {e}"))
        return
    facts = core.executor.facts
    outputs.send(EngineReady(facts.max_model_len, facts.num_blocks, facts.vocab_size,
                             core.executor.platform_info()))
    trace = StepTraceWriter(config.trace_file) if config.trace_file else None
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
                message: EngineRequest = requests.recv()
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, AbortRequest):
                    core.abort_request(message.request_id)
                elif isinstance(message, AddRequest):
                    add_request(core, message, outputs)
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
            load = EngineLoad(scheduler.num_running, scheduler.num_waiting, kv.block_pool.usage,
                              core.has_unfinished_requests(), kv.prefix_cache_queries,
                              kv.prefix_cache_hits, scheduler.num_preemptions, iteration_tokens)
            outputs.send(StepOutputs(step_outputs, load))
            last_report = now


def add_request(core: EngineCore, message: AddRequest, outputs: Connection) -> None:
    """Queue the request, or send why not: its TTFT objective cannot be met (deadline
    admission, against the queue as it is now), or it is invalid."""
    ttft = message.ttft
    if (message.admit_deadline and ttft is not None
            and not core.can_meet_ttft(len(message.prompt_token_ids), ttft,
                                       priority=message.priority, tenant=message.tenant)):
        outputs.send(RequestRejected(message.request_id,
                                     f"the TTFT objective of {ttft * 1e3:g} ms cannot be met "
                                     f"given the requests queued ahead; retry later",
                                     "deadline"))
        return
    try:
        core.add_request(message.request_id, message.prompt_token_ids, message.params,
                         message.priority, message.cache_salt, tenant=message.tenant,
                         ttft=ttft, tpot=message.tpot)
    except ValueError as e:
        outputs.send(RequestRejected(message.request_id, str(e), "invalid_request"))
