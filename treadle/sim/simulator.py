"""The event loop: arrivals and steps of N independent replicas in virtual time.

Each replica's clock is the time its current step ends. The next event is the earliest of the
next arrival and the busy replicas' clocks; arrivals at or before a replica's clock are routed
first, so a step sees every request that arrived before it began (as the engine's loop picks up
new requests between steps). An idle replica's clock jumps to the next request routed to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from treadle.frontend.router import Router
from treadle.sim.profile import StepProfile
from treadle.sim.replica import PolicyRefused, SimReplica, StepRecord, Timeline
from treadle.sim.settings import SimSettings
from treadle.sim.workload import SimRequest


@dataclass
class SimResult:
    settings: SimSettings
    requests: list[SimRequest]
    timelines: list[Timeline]  # one per request, in the order of `requests`
    steps: list[list[StepRecord]]  # per replica
    num_preemptions: int
    rejected: dict[int, str] = field(default_factory=dict)  # index -> why add_request refused
    wall_s: float = 0.0  # real seconds the simulation took
    batches: list[list[list[tuple[str, int, int]]]] | None = None  # per replica, when recorded

    @property
    def duration(self) -> float:
        """Virtual seconds from the first arrival to the last request's end."""
        ends = [t.finished for t in self.timelines if t.finished is not None]
        start = min((r.arrival for r in self.requests), default=0.0)
        return max(ends, default=start) - start


def simulate(requests: list[SimRequest], settings: SimSettings, profile: StepProfile,
             record_batches: bool = False, check_invariants: bool = False) -> SimResult:
    """Run `requests` (sorted by arrival) to their ends; every request ends exactly once."""
    began = time.perf_counter()
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    replicas = [SimReplica(settings, profile, i, record_batches) for i in range(settings.replicas)]
    # The data-parallel server's own router (treadle/frontend/router.py), over the simulated
    # replicas' outstanding tokens; every simulated replica stays live.
    engine = settings.engine
    router = Router(settings.router, settings.replicas, engine.cache.block_size,
                    index_blocks=engine.cache.num_blocks,
                    overload_tokens=engine.scheduler.max_num_batched_tokens)
    live = [True] * settings.replicas
    timelines: list[Timeline | None] = [None] * len(requests)
    rejected: dict[int, str] = {}
    pos = 0

    while True:
        busy = [r for r in replicas if r.busy()]
        next_step = min(busy, key=lambda r: (r.now, r.index)) if busy else None
        if pos < len(order) and (next_step is None or
                                 requests[order[pos]].arrival <= next_step.now):
            index = order[pos]
            pos += 1
            request = requests[index]
            choice = router.pick(request.prompt_token_ids, None,
                                 [r.outstanding_tokens for r in replicas], live)
            replica = replicas[choice]
            try:
                timelines[index] = replica.add(index, request)
            except ValueError as e:
                rejected[index] = str(e)
                reason = e.reason if isinstance(e, PolicyRefused) else "rejected"
                timelines[index] = Timeline(index, replica.index, request.arrival,
                                            finished=request.arrival, finish_reason=reason)
            continue
        if next_step is None:
            break
        before = next_step.now
        next_step.step()  # ended requests' timelines (ours too) are filled in
        if check_invariants:
            next_step.scheduler.check_invariants()
        if next_step.now == before and next_step.busy():
            # Nothing could be scheduled: wait for the next arrival (or give up: stuck).
            if pos >= len(order):
                raise RuntimeError(f"replica {next_step.index} is stuck with "
                                   f"{len(next_step.scheduler.requests)} requests")
            next_step.now = max(before, requests[order[pos]].arrival)
    done = [t for t in timelines if t is not None]
    assert len(done) == len(requests) and all(t.finished is not None for t in done)
    return SimResult(settings, requests, done, [r.steps for r in replicas],
                     sum(r.scheduler.num_preemptions for r in replicas), rejected,
                     time.perf_counter() - began,
                     [r.batches for r in replicas] if record_batches else None)
