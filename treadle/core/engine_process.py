"""The engine process: builds the `EngineCore` and serves it over two pipes until told to stop.

Torch-free at import: the frontend imports this module for the spawn target's name only; the
core (and so torch and the kernels) is imported in the child, inside `engine_process`.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from treadle.config import EngineConfig
from treadle.core.messages import (
    INVALID_REQUEST,
    AbortRequest,
    AddRequest,
    EngineCensus,
    EngineFailed,
    EngineLoad,
    EngineReady,
    EngineRequest,
    RequestRejected,
    Shutdown,
    StepOutputs,
)
from treadle.core.step_trace import StepTraceWriter
from treadle.errors import InvalidField

if TYPE_CHECKING:
    from treadle.core.engine_core import EngineCore
    from treadle.core.request import Request
    from treadle.core.step_loop import StepStats

# The engine reports its load at least this often when idle.
HEARTBEAT_SECONDS = 1.0
# With requests but no step to run (they wait on an adapter's load or a grammar's compile, off
# the step), the loop waits this long for messages rather than spinning, which would hold the
# interpreter lock from the loading thread.
STALLED_POLL_SECONDS = 0.001
# Who waits and runs, by tenant and priority, at most this often: the live dashboard's pace.
CENSUS_SECONDS = 1.0


def engine_process(config: EngineConfig, requests: Connection, outputs: Connection) -> None:
    """The child: build the core and serve it until told to shut down."""
    # The child's own log lines (the first start's kernel build, a dtype warning) to stderr.
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s treadle-engine %(name)s: %(message)s")
    try:
        from treadle.core.engine_core import EngineCore

        core = EngineCore(config)
    except Exception as e:
        outputs.send(EngineFailed(f"{type(e).__name__}: {e}"))
        return
    # What startup made lives as long as the process: frozen, a full collection no longer walks
    # it, which otherwise landed in decode steps as pauses (docs/decisions.md).
    gc.collect()
    gc.freeze()
    outputs.send(ready_message(core))
    trace = StepTraceWriter(config.trace_file) if config.trace_file else None
    try:
        serve_engine(core, requests, outputs, trace)
    finally:
        if trace is not None:
            trace.close()
    # Nothing is left to save: skip the interpreter's teardown of torch (seconds), so that a
    # server stops within its shutdown timeout.
    os._exit(0)


def ready_message(core: EngineCore) -> EngineReady:
    """What the frontend learns of a started core."""
    facts = core.executor.facts
    return EngineReady(facts.max_model_len, facts.num_blocks, facts.vocab_size,
                       core.executor.platform_info(),
                       {"weights_bytes": facts.weights_bytes, "parameters": facts.num_parameters,
                        "active_parameters": facts.active_parameters,
                        "kv_cache": facts.kv_cache.as_dict()})


def serve_engine(core: EngineCore, requests: Connection, outputs: Connection,
                 trace: StepTraceWriter | None) -> None:
    """The engine process's loop: take messages, step, send outputs and load."""
    last_report = last_census = 0.0
    traced: StepStats | None = None
    stalled = False  # the last step ran nothing
    while True:
        busy = core.has_unfinished_requests()
        if requests.poll((STALLED_POLL_SECONDS if stalled else 0) if busy
                         else HEARTBEAT_SECONDS):
            while requests.poll(0):
                message: EngineRequest = requests.recv()
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, AbortRequest):
                    core.abort_request(message.request_id)
                elif isinstance(message, AddRequest):
                    add_request(core, message, outputs)
        step_outputs = core.step() if core.has_unfinished_requests() else []
        step = None
        if core.last_step_stats is not traced:  # a step ran
            traced = core.last_step_stats
            step = traced.record()
            if trace is not None:
                trace.write(traced.trace_event())
        stalled = step is None
        now = time.monotonic()
        if step is not None or now - last_report >= HEARTBEAT_SECONDS:
            scheduler, kv = core.scheduler, core.kv_cache_manager
            load = EngineLoad(scheduler.num_running, scheduler.num_waiting, kv.block_pool.usage,
                              core.has_unfinished_requests(), kv.prefix_cache_queries,
                              kv.prefix_cache_hits, scheduler.num_preemptions,
                              core.spec_decode_counts, core.spec_decode_accepted_per_position,
                              *((adapter_names(scheduler.running),
                                 adapter_names(scheduler.waiting)) if core.enable_lora else ()))
            census = None
            if now - last_census >= CENSUS_SECONDS:
                census, last_census = take_census(core), now
            outputs.send(StepOutputs(step_outputs, load, step, census))
            last_report = now


def take_census(core: EngineCore) -> EngineCensus:
    """Requests by (tenant, priority), waiting and running, the cached free blocks, the blocks
    each tenant holds and the tokens each has been scheduled; requests and tokens by (tenant,
    LoRA adapter)."""
    def count(requests: Iterable[Request]) -> tuple[tuple[str, int, int], ...]:
        counts = Counter((r.tenant, r.priority) for r in requests)
        return tuple((tenant, priority, n) for (tenant, priority), n in sorted(counts.items()))

    scheduler = core.scheduler
    pool = core.kv_cache_manager.block_pool
    cached_free = sum(1 for b in pool.cached_block_hash_to_block.values() if b.ref_cnt == 0)
    held, shared = scheduler.kv_blocks_by_tenant()
    return EngineCensus(count(scheduler.waiting), count(scheduler.running), cached_free,
                        tuple(sorted(held.items())), shared,
                        tuple(sorted(core.loop.scheduled_tokens_by_tenant.items())),
                        count_by_lora(scheduler.waiting), count_by_lora(scheduler.running),
                        flat(core.loop.scheduled_tokens_by_lora))


def count_by_lora(requests: Iterable[Request]) -> tuple[tuple[str, str, int], ...]:
    """(tenant, adapter, requests) of the requests with a LoRA adapter, sorted."""
    return flat(Counter((r.tenant, r.lora_request.lora_name) for r in requests
                        if r.lora_request is not None))


def flat(counts: Counter[tuple[str, str]]) -> tuple[tuple[str, str, int], ...]:
    """A counter by (tenant, adapter) as sorted (tenant, adapter, n) rows."""
    return tuple((tenant, name, n) for (tenant, name), n in sorted(counts.items()))


def add_request(core: EngineCore, message: AddRequest, outputs: Connection) -> None:
    """Queue the request, or send why not: its policy refuses it now (RequestRejected, its
    reason the policy's name), or it is invalid."""
    try:
        why = core.refusal(message.prompt_token_ids, priority=message.priority,
                           tenant=message.tenant, ttft=message.ttft, tpot=message.tpot)
        if why is not None:
            outputs.send(RequestRejected(message.request_id, why, core.scheduler.policy.name))
            return
        core.add_request(message.request_id, message.prompt_token_ids, message.params,
                         message.priority, message.cache_salt, tenant=message.tenant,
                         ttft=message.ttft, tpot=message.tpot, pooling=message.pooling,
                         lora_request=message.lora_request, held=message.held)
    except InvalidField as e:
        outputs.send(RequestRejected(message.request_id, str(e), INVALID_REQUEST, e.param))
    except ValueError as e:
        outputs.send(RequestRejected(message.request_id, str(e), INVALID_REQUEST))


def adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    """The distinct LoRA adapters of `requests`, sorted (the lora_requests_info gauge's)."""
    return tuple(sorted({r.lora_request.lora_name for r in requests
                         if r.lora_request is not None}))
