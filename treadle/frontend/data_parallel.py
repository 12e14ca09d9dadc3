"""ReplicaGroup: data-parallel engine replicas on Ray, as the frontend sees them.

`treadle serve --data-parallel-size N` starts N Ray actors (ray_replica.py), each a whole engine
core with its own KV cache, on `engine_threads` CPUs (one by default), spread over the cluster's
nodes: the cluster `RAY_ADDRESS` names, or a local one started here. The group is an
EngineClient, as one engine process is: `send` takes the same typed messages (an AddRequest goes
to the replica the Router picks, an AbortRequest to the one running it), `recv` gives the same
outputs, merged. Per replica, a
sender thread submits its queued messages in one actor call, in order, and a puller thread
fetches its outputs in batches (`pull`: everything since the last call, each message a step's
outputs), so Ray's per-call cost (about a millisecond) is paid per step, not per token.

Load: the frontend counts each replica's outstanding tokens (prompt left to prefill, known
done with the first token, plus max_tokens less the tokens seen) for the least-load and prefix
routers; the load AsyncEngine sees sums the replicas' (KV usage: their mean), its cache
counters summed over every life of every replica; /metrics (`replica` label) and the
dashboard's feed show each replica's running, waiting, KV usage and whether it is in rotation.

Faults: when a replica's actor dies (its pending `pull` fails at once) it leaves the rotation.
Its requests that have streamed no token yet are sent once more, to another replica: the client
has seen nothing, so a retry is invisible and loses no work; one that already streamed ends
with EngineUnavailable (resuming it elsewhere would need its tokens replayed exactly, and a
sampled one could diverge from what the client has), and so does a second failure (a request
that kills every replica it reaches must not go round them all). Ray restarts the actor
(`max_restarts` = max_engine_restarts), and it rejoins the rotation once its model is loaded,
with an empty prefix index. If every replica is gone for good the group ends, and AsyncEngine
restarts it as it restarts a dead engine process.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from treadle.config import AsyncEngineConfig
from treadle.core.messages import (
    AddRequest,
    EngineCensus,
    EngineFailed,
    EngineLoad,
    EngineOutput,
    EngineReady,
    EngineRequest,
    RequestFailed,
    RequestRejected,
    Shutdown,
    StepOutputs,
)
from treadle.frontend.ray_replica import EngineReplica
from treadle.frontend.router import Router
from treadle.model.memory import DEFAULT_KV_MEMORY_FRACTION, available_memory
from treadle.observability.live import LiveFeed
from treadle.observability.metrics import ServerMetrics

logger = logging.getLogger(__name__)

RAY_MISSING = ('data_parallel_size > 1 runs engine replicas on Ray, which is not installed: '
               'pip install -e ".[ray]"')
RAY_NAMESPACE = "treadle"
PULL_SECONDS = 1.0  # a pull's longest wait: the engine reports its load at least this often
REJOIN_BACKOFF = 0.5  # between checks that a dead replica's actor is back
IDLE = EngineLoad(0, 0, 0.0, False, 0, 0, 0)


def import_ray() -> Any:
    """The ray module; ValueError saying how to install it when it is not."""
    try:
        import ray
    except ImportError as e:
        raise ValueError(RAY_MISSING) from e
    return ray


@dataclass
class Flight:
    """An engine request in flight on a replica, as the group counts its load."""

    replica: int
    message: AddRequest
    prompt_left: int
    decode_left: int
    retried: bool = False
    streamed: bool = False  # a token reached the frontend: it cannot be retried

    @property
    def tokens(self) -> int:
        return self.prompt_left + self.decode_left


@dataclass
class Replica:
    index: int
    actor: Any  # a Ray actor handle of EngineReplica
    live: bool = False  # in rotation
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    outstanding: int = 0  # tokens of its flights
    load: EngineLoad = IDLE
    census: EngineCensus | None = None
    earlier_counts: tuple[int, int, int] = (0, 0, 0)  # cache counters of its earlier lives


class ReplicaGroup:
    def __init__(self, config: AsyncEngineConfig, metrics: ServerMetrics, live: LiveFeed) -> None:
        self.ray = import_ray()
        self.config = config
        self.metrics, self.live = metrics, live  # where each replica's state is shown
        self.size = config.data_parallel.data_parallel_size
        self.lock = threading.Lock()  # flights, replicas' state, the router
        self.flights: dict[str, Flight] = {}
        self.replicas: list[Replica] = []
        self.router: Router | None = None
        self.outputs: queue.SimpleQueue[EngineOutput | None] = queue.SimpleQueue()
        self.stopped = threading.Event()
        self.exitcode: int | None = None

    def start(self) -> EngineReady | EngineFailed:
        """Start the replicas and wait until each has loaded its model (blocking: call it in a
        thread); then route and read. EngineFailed if one cannot start."""
        ray = self.ray
        started_locally = False
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or None
            # A local cluster without the dashboard: less to start, and nothing it would show.
            ray.init(address=address, namespace=RAY_NAMESPACE,
                     **({} if address else {"include_dashboard": False}))
            started_locally = address is None
        cpus = self.config.engine.parallel.engine_threads or 1
        total = ray.cluster_resources().get("CPU", 0)
        if total < self.size * cpus:
            return EngineFailed(f"{self.size} replicas of {cpus} CPU each need {self.size * cpus}"
                                f" CPUs; the Ray cluster has {total:g}")
        engine = self.config.engine
        from treadle.model.capabilities import resolve_device

        if resolve_device(engine.model.device) == "cuda":
            return EngineFailed("data-parallel replicas run on CPUs; on a GPU serve one engine "
                                "per GPU, or pass --device cpu")
        cache = engine.cache
        if started_locally and cache.num_blocks is None and cache.kv_cache_memory_bytes is None:
            # Every replica on this machine, all loading at once: each would size its default
            # cache from the same free memory (two took 10.6 GiB each of a 23 GiB machine).
            # Each gets its share of the default's instead.
            share = int(DEFAULT_KV_MEMORY_FRACTION * available_memory() / self.size)
            engine = replace(engine, cache=replace(cache, kv_cache_memory_bytes=share))
        group = uuid.uuid4().hex[:8]
        actor_class = self.ray.remote(EngineReplica)
        for i in range(self.size):
            actor = actor_class.options(
                name=f"treadle-replica-{i}-{group}", namespace=RAY_NAMESPACE, num_cpus=cpus,
                max_restarts=self.config.supervision.max_engine_restarts, max_task_retries=0,
                max_concurrency=2, scheduling_strategy="SPREAD").remote(engine)
            self.replicas.append(Replica(i, actor))
        try:
            firsts = ray.get([replica.actor.ready.remote() for replica in self.replicas])
        except ray.exceptions.RayError as e:
            return EngineFailed(f"a replica died while loading: {e}")
        failed = [first for first in firsts if isinstance(first, EngineFailed)]
        if failed:
            return failed[0]
        first: EngineReady = firsts[0]
        # Overloaded: a step's token budget ahead of the least-loaded replica, enough that the
        # other replica would start the request a step sooner.
        self.router = Router(self.config.data_parallel.router, self.size,
                             self.config.engine.cache.block_size, first.num_blocks,
                             self.config.engine.scheduler.max_num_batched_tokens)
        for replica in self.replicas:
            replica.live = True
            self._observe_replica(replica)
            for target, name in ((self._send_loop, "treadle-replica-send"),
                                 (self._pull_loop, "treadle-replica-pull")):
                threading.Thread(target=target, args=(replica,), name=f"{name}-{replica.index}",
                                 daemon=True).start()
        logger.info("%d engine replicas ready on Ray (router %s)", self.size,
                    self.config.data_parallel.router)
        return first

    # As an EngineClient (engine_client.py).

    def send(self, message: EngineRequest) -> None:
        """Route an AddRequest, pass an AbortRequest to its replica; never blocks."""
        if isinstance(message, Shutdown):
            self.kill()
            return
        failed = None
        with self.lock:
            if isinstance(message, AddRequest):
                if not self._route(message, retried=False):
                    failed = RequestFailed(message.request_id, "no engine replica is available "
                                           "(every one is restarting); retry later")
            elif (flight := self._land(message.request_id)) is not None:
                self.replicas[flight.replica].outbox.put(message)
        if failed is not None:
            self.outputs.put(failed)

    def _route(self, message: AddRequest, retried: bool) -> bool:
        """Queue the request for the replica the router picks (the lock held); False if none
        is live."""
        choice = self.router.pick(message.prompt_token_ids, message.cache_salt,
                                  [r.outstanding for r in self.replicas],
                                  [r.live for r in self.replicas])
        if choice is None:
            return False
        flight = Flight(choice, message, len(message.prompt_token_ids),
                        0 if message.pooling else message.params.max_tokens, retried)
        self.flights[message.request_id] = flight
        replica = self.replicas[choice]
        replica.outstanding += flight.tokens
        replica.outbox.put(message)
        return True

    def _land(self, request_id: str) -> Flight | None:
        """The request is over here (finished, refused, aborted): forget it (the lock held)."""
        flight = self.flights.pop(request_id, None)
        if flight is not None:
            self.replicas[flight.replica].outstanding -= flight.tokens
        return flight

    def recv(self) -> EngineOutput:
        """The next output of any replica; EOFError once the group has stopped."""
        message = self.outputs.get()
        if message is None:
            self.outputs.put(None)  # for any later call
            raise EOFError
        return message

    def kill(self) -> None:
        """Stop every replica now; `recv` ends."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        for replica in self.replicas:
            replica.outbox.put(None)
            if replica.actor is None:  # gone for good
                continue
            try:
                self.ray.kill(replica.actor, no_restart=True)
            except Exception as e:  # the cluster is gone: its actors with it
                logger.warning("could not kill replica %d: %s", replica.index, e)
        self.outputs.put(None)

    def stop(self, timeout: float) -> None:
        """Replicas hold nothing worth a graceful end: stopped at once."""
        self.kill()

    def close(self) -> None:
        """The reader is done with the group (it stopped, or the reader failed): stop it."""
        self.kill()

    def exit_status(self) -> str:
        return "every replica is gone for good" if self.exitcode else "stopped"

    # Per replica: its threads.

    def _send_loop(self, replica: Replica) -> None:
        """Submit what is queued for the replica, in order, one call at a time."""
        while (message := replica.outbox.get()) is not None:
            batch = [message]
            while True:
                try:
                    message = replica.outbox.get_nowait()
                except queue.Empty:
                    break
                if message is None:
                    return
                batch.append(message)
            # Should it die, its puller takes it out of rotation and deals with its requests.
            with contextlib.suppress(self.ray.exceptions.RayError):
                self.ray.get(replica.actor.submit.remote(batch))

    def _pull_loop(self, replica: Replica) -> None:
        while not self.stopped.is_set():
            try:
                batch = self.ray.get(replica.actor.pull.remote(PULL_SECONDS))
            except self.ray.exceptions.RayError as e:
                if self.stopped.is_set():
                    return
                self._replica_died(replica, e)
                if not self._await_rejoin(replica):
                    return
                continue
            for message in batch:
                self._receive(replica, message)

    def _receive(self, replica: Replica, message: EngineOutput) -> None:
        if isinstance(message, RequestRejected):
            with self.lock:
                flight = self.flights.get(message.request_id)
                if flight is None or flight.replica != replica.index:
                    return
                self._land(message.request_id)
            self.outputs.put(message)
            return
        assert isinstance(message, StepOutputs), message
        with self.lock:
            outputs = []
            for output in message.outputs:
                flight = self.flights.get(output.request_id)
                # Not its own: aborted, or failed or retried after an earlier death of this
                # replica (a request it had before it restarted); the frontend is done with it.
                if flight is None or flight.replica != replica.index:
                    continue
                outputs.append(output)
                before = flight.tokens
                if output.new_token_ids:
                    flight.streamed = True
                    flight.prompt_left = 0
                    flight.decode_left = max(0, flight.decode_left - len(output.new_token_ids))
                replica.outstanding -= before - flight.tokens
                if output.finished:
                    self._land(output.request_id)
            replica.load = message.load
            if message.census is not None:
                replica.census = message.census
            merged = StepOutputs(outputs, self._merged_load(), message.step,
                                 None if message.census is None else self._merged_census())
            self._observe_replica(replica)
        self.outputs.put(merged)

    def _replica_died(self, replica: Replica, error: Exception) -> None:
        """Out of rotation at once; its requests retried elsewhere or failed."""
        failed: list[str] = []
        retried = 0
        with self.lock:
            replica.live = False
            while True:  # what was queued for it: its flights are dealt with below
                try:
                    replica.outbox.get_nowait()
                except queue.Empty:
                    break
            self.router.forget(replica.index)
            load = replica.load
            replica.earlier_counts = tuple(
                a + b for a, b in zip(replica.earlier_counts, (
                    load.prefix_cache_queries, load.prefix_cache_hits, load.num_preemptions),
                    strict=True))
            replica.load, replica.census = IDLE, None
            for request_id, flight in list(self.flights.items()):
                if flight.replica != replica.index:
                    continue
                self._land(request_id)
                if flight.streamed or flight.retried or not self._route(flight.message, True):
                    failed.append(request_id)
                else:
                    retried += 1
            merged = StepOutputs([], self._merged_load())
            self._observe_replica(replica)
        logger.error("engine replica %d died (%s): out of rotation; of its requests, %d failed "
                     "and %d were retried on another replica", replica.index,
                     type(error).__name__, len(failed), retried)
        for request_id in failed:
            self.outputs.put(RequestFailed(request_id, f"engine replica {replica.index} died "
                                                       f"while running this request"))
        self.outputs.put(merged)

    def _await_rejoin(self, replica: Replica) -> bool:
        """Wait until Ray has restarted the replica's actor and its model is loaded: back in
        rotation (True); or it is gone for good (False; if every replica is, the group ends)."""
        deaths = 0
        while not self.stopped.is_set():
            try:
                first = self.ray.get(replica.actor.ready.remote())
            except self.ray.exceptions.ActorUnavailableError:  # restarting: loading its model
                time.sleep(REJOIN_BACKOFF)
                continue
            except self.ray.exceptions.RayError:
                # Dead: for good once it has died more often than it may restart.
                deaths += 1
                if deaths > self.config.supervision.max_engine_restarts:
                    break
                time.sleep(REJOIN_BACKOFF)
                continue
            if isinstance(first, EngineFailed):
                logger.error("engine replica %d failed to restart: %s", replica.index,
                             first.error)
                break
            with self.lock:
                replica.live = True
                self._observe_replica(replica)
            logger.info("engine replica %d restarted: back in rotation", replica.index)
            return True
        logger.error("engine replica %d is gone for good", replica.index)
        with self.lock:
            replica.actor = None
            every_one_gone = all(r.actor is None for r in self.replicas)
        if every_one_gone and not self.stopped.is_set():
            self.exitcode = 1
            self.kill()
        return False

    # Load and metrics (the lock held).

    def _merged_load(self) -> EngineLoad:
        loads = [r.load for r in self.replicas]
        live = [r.load.kv_cache_usage for r in self.replicas if r.live]
        counts = [sum(r.earlier_counts[k] for r in self.replicas) for k in range(3)]
        return EngineLoad(sum(x.num_running for x in loads), sum(x.num_waiting for x in loads),
                          sum(live) / len(live) if live else 0.0,
                          any(x.has_work for x in loads),
                          counts[0] + sum(x.prefix_cache_queries for x in loads),
                          counts[1] + sum(x.prefix_cache_hits for x in loads),
                          counts[2] + sum(x.num_preemptions for x in loads),
                          # The live replicas' (a restarted one counts from 0 again).
                          tuple(sum(x.spec_decode[k] for x in loads) for k in range(3)),
                          tuple(map(sum, itertools.zip_longest(
                              *(x.spec_decode_accepted_per_position for x in loads),
                              fillvalue=0))),
                          tuple(sorted({n for x in loads for n in x.running_loras})),
                          tuple(sorted({n for x in loads for n in x.waiting_loras})))

    def _merged_census(self) -> EngineCensus:
        waiting: Counter = Counter()
        running: Counter = Counter()
        blocks: Counter = Counter()
        tokens: Counter = Counter()  # the live replicas' (a restarted one counts from 0 again)
        # By (tenant, LoRA adapter): waiting, running, tokens scheduled.
        loras: tuple[Counter, Counter, Counter] = (Counter(), Counter(), Counter())
        cached_free = shared = 0
        for census in (r.census for r in self.replicas if r.census is not None):
            for counts, rows in ((waiting, census.waiting), (running, census.running),
                                 (loras[0], census.lora_waiting), (loras[1], census.lora_running),
                                 (loras[2], census.scheduled_tokens_by_lora)):
                for tenant, key, n in rows:
                    counts[tenant, key] += n
            cached_free += census.num_cached_free_blocks
            blocks.update(dict(census.kv_blocks_by_tenant))
            shared += census.kv_blocks_shared
            tokens.update(dict(census.scheduled_tokens_by_tenant))
        waiting_rows, running_rows, *lora_rows = (
            tuple((t, k, n) for (t, k), n in sorted(counts.items()))
            for counts in (waiting, running, *loras))
        return EngineCensus(waiting_rows, running_rows, cached_free, tuple(sorted(blocks.items())),
                            shared, tuple(sorted(tokens.items())), *lora_rows)

    def _observe_replica(self, replica: Replica) -> None:
        self.metrics.observe_replica(str(replica.index), replica.live, replica.load.num_running,
                                     replica.load.num_waiting, replica.load.kv_cache_usage)
        self.live.record_replica(replica.index, replica.live, replica.load)
