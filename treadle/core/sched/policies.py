"""Queue policies: the order of the waiting queue, of the running list, and who gives way.

A policy is a small object; `make_policy(name, config)` builds one per scheduler (fair share
keeps counters, so one policy object serves one scheduler). It answers:

- `sort_key(request)`: a key fixed when the request is queued. It orders the running list (the
  scheduler hands out tokens front to back) and, within a lane, the waiting queue.
- `new_queue()`: the waiting queue, which may order lanes by keys that change as the engine runs
  (fair share: per-tenant service counters; deadline: slack, from the clock and the measured
  step time).
- `victim(candidates)`: whom to preempt when a running request is short of blocks.
- `displace(head, candidates)`: whether the waiting queue's head may take a running request's
  blocks and batch slot (priority, fair share), and whose.
- `defers_prefill(running, head)`: whether a running request's prefill chunk waits, within a
  step, until the waiting queue's head has been admitted (priority, fair share), so a long
  prompt's remaining chunks do not take the token budget ahead of a better-ranked newcomer.
- `yielding_tenants(head, running)`: tenants whose running requests sit out a step that admits
  the waiting queue's head (fair share), so a light tenant's first token waits for one short
  step, not for a full batch of the heavy tenant's decodes and chunks.
- `chunk_tokens(request, threshold)`: the most prompt tokens a request computes in one step
  (fair share may cap a tenant served more than others, to keep the steps short).
- `on_admitted` / `on_tokens_generated`: service accounting (fair share).

How schedule() stays O(log n) per step at n waiting requests: no key that changes is ever
stored in a sorted list. Static keys live in binary heaps (O(log n) add and pop; removal marks
the entry, dropped when it surfaces). Fair share keeps one heap per tenant in arrival order and a
heap of backlogged tenants by counter; a counter only grows, so an entry whose counter went
stale is re-pushed when it surfaces (O(log T) per counter change, T tenants). Deadline keeps
EDF heaps; slack only decides, at the head, whether a request moves to the late lane, once. The
scheduler pops what it admits (O(log n) each), and passes over at most MAX_LOOKAHEAD requests
that do not fit per step. The running list (at most max_num_seqs) is walked in full each step
anyway, so choosing a victim over it (O(max_num_seqs)) adds nothing in order. Measured by
tests/test_policies.py (printed): schedule() takes about the same time at 10,000 waiting as at
1,000, under every policy. Admission under deadlines (`ahead`) is O(n), once per new request,
not per step.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple, Protocol

from treadle.config import SchedulerConfig
from treadle.core.request import Request


class WaitingQueue(Protocol):
    """The waiting requests, best first. `restore` hands back a request popped this step and not
    admitted (no accounting), `add` queues one that arrives or was preempted."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...  # a snapshot, in the order of now; for tests
    def add(self, request: Request) -> None: ...
    def restore(self, request: Request) -> None: ...
    def remove(self, request: Request) -> None: ...
    def peek(self) -> Request | None: ...
    def pop(self) -> Request: ...
    def refresh(self, now: float, seconds_per_token: float | None) -> None: ...
    def ahead(self, probe: Request) -> tuple[int, int]: ...  # (requests, their uncomputed tokens)
    def check_invariants(self) -> None: ...


def uncomputed_tokens(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


class KeyedQueue:
    """Requests in order of a static key: a binary heap with lazy removal. Equal keys leave in
    the order they came."""

    def __init__(self, key: Callable[[Request], tuple]) -> None:
        self.key = key
        # [key, sequence number, request or None once removed, its uncomputed tokens]
        self.heap: list[list] = []
        self.entries: dict[str, list] = {}
        self.counter = itertools.count()
        # What `ahead` reads at every arrival: the queued requests' uncomputed tokens (a queued
        # request's tokens do not change) and the largest key ever queued. A scan of every
        # entry at each arrival was quadratic in overload: 10,000 requests at 8 req/s under
        # fair took 183 s to simulate, 75 s now (the same 33,149 steps).
        self.tokens = 0
        self.max_key: tuple | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in sorted(self.entries.values()))

    def add(self, request: Request) -> None:
        entry = [self.key(request), next(self.counter), request, uncomputed_tokens(request)]
        self.entries[request.request_id] = entry
        heapq.heappush(self.heap, entry)
        self.tokens += entry[3]
        if self.max_key is None or entry[0] > self.max_key:
            self.max_key = entry[0]

    restore = add

    def remove(self, request: Request) -> None:
        entry = self.entries.pop(request.request_id)
        entry[2] = None
        self.tokens -= entry[3]
        if not self.entries:
            self.max_key = None
        if len(self.heap) > 2 * len(self.entries) + 16:  # too many dead entries: compact
            self.heap = [entry for entry in self.heap if entry[2] is not None]
            heapq.heapify(self.heap)

    def peek(self) -> Request | None:
        while self.heap and self.heap[0][2] is None:
            heapq.heappop(self.heap)
        return self.heap[0][2] if self.heap else None

    def pop(self) -> Request:
        request = self.peek()
        assert request is not None, "pop from an empty queue"
        heapq.heappop(self.heap)
        self.tokens -= self.entries.pop(request.request_id)[3]
        if not self.entries:  # empty: any key may take the O(1) path of `ahead` again
            self.max_key = None
        return request

    def refresh(self, now: float, seconds_per_token: float | None) -> None:
        pass

    def ahead(self, probe: Request) -> tuple[int, int]:
        key = self.key(probe)
        if self.max_key is None or key >= self.max_key:  # all of them (fcfs: always)
            return len(self.entries), self.tokens
        tokens = [e[3] for e in self.entries.values() if e[0] <= key]
        return len(tokens), sum(tokens)

    def check_invariants(self) -> None:
        live = [entry for entry in self.heap if entry[2] is not None]
        assert len(live) == len(self.entries), "heap and entries disagree"
        assert self.tokens == sum(uncomputed_tokens(e[2]) for e in live), "tokens changed"
        assert all(self.max_key >= e[0] for e in live), "max_key is off"
        for entry in live:
            assert self.entries[entry[2].request_id] is entry
            assert entry[0] == self.key(entry[2]), f"{entry[2]}: key changed while queued"


class SchedulingPolicy:
    """The defaults the others override: arrival order, the newest running request is preempted
    first, no running request is displaced, no accounting."""

    name = "base"

    def sort_key(self, request: Request) -> tuple:
        return (request.arrival_time,)

    def new_queue(self) -> WaitingQueue:
        return KeyedQueue(self.sort_key)

    def victim(self, candidates: Sequence[Request]) -> Request:
        """The running request to preempt for blocks: the one that sorts last."""
        return candidates[-1]

    def displace(self, head: Request, candidates: Sequence[Request]) -> Request | None:
        """A running request the waiting `head` may preempt when blocks or batch slots keep it
        out; `candidates` (running, in order) are those the preemption guard allows."""
        return None

    def defers_prefill(self, running: Request, head: Request) -> bool:
        """Whether `running`'s prefill chunk goes after the waiting `head`'s admission."""
        return False

    def yielding_tenants(self, head: Request, running: Sequence[Request]) -> frozenset[str]:
        """Tenants whose running requests get no tokens in a step that admits `head`."""
        return frozenset()

    def chunk_tokens(self, request: Request, threshold: int) -> int:
        """The most prompt tokens `request` computes in one step (`threshold`: the engine's)."""
        return threshold

    def on_admitted(self, request: Request) -> None:
        """The request's first admission (not a readmission after preemption)."""

    def on_tokens_generated(self, request: Request, num_tokens: int) -> None:
        pass


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: the newest running request is preempted first."""

    name = "fcfs"


class PriorityPolicy(SchedulingPolicy):
    """Lower priority value first, then arrival. A waiting request of strictly better priority
    takes the place of the worst running one (recompute), as vLLM's priority scheduling."""

    name = "priority"

    def sort_key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)

    def displace(self, head: Request, candidates: Sequence[Request]) -> Request | None:
        if candidates and candidates[-1].priority > head.priority:
            return candidates[-1]
        return None

    def defers_prefill(self, running: Request, head: Request) -> bool:
        return running.priority > head.priority


class FairPolicy(SchedulingPolicy):
    """Fair share between tenants: the Virtual Token Counter (Sheng et al., OSDI 2024).

    Each tenant's counter grows by w_p per prompt token (charged at first admission) and w_q per
    output token, divided by the tenant's weight. The backlogged tenant with the least counter
    goes first, its requests in arrival order. A tenant that becomes backlogged has its counter
    lifted to the least of the other backlogged tenants (or, with none, to the counter of the
    last tenant served), so idle time banks no credit. The paper's bound: between two
    continuously backlogged tenants, service differs by at most 2 * max(w_p * L_in, w_q * M),
    L_in the longest prompt, M the most tokens the KV cache holds.

    When blocks or batch slots bind, the head (its tenant least served) may preempt the newest
    running request of the most served tenant, while either that tenant's counter exceeds the
    head tenant's by more than the head's own charge (admitting it cannot flip the order), or it
    is served at least as much and holds at least two more running requests (admitting one
    cannot flip that either): so two requests cannot preempt each other back and forth; over
    time, max_policy_preemptions bounds how often one request is displaced. The second rule is
    what lets a light tenant in at once: a newcomer's counter is lifted to the heavy tenant's,
    so the first rule alone made it wait for a slot to free (`treadle sim`, a heavy tenant
    sending 10x each of three light ones, saturated, max_num_seqs=48 and a 256-token budget:
    light p99 TTFT 0.77-1.24 s without the rule, 0.70-1.0 s with it).
    """

    name = "fair"

    def __init__(self, weights: Mapping[str, float] | None = None,
                 prompt_token_weight: float = 1.0, output_token_weight: float = 2.0,
                 chunk_tokens_shared: int | None = None) -> None:
        self.weights = dict(weights or {})
        self.prompt_token_weight = prompt_token_weight
        self.output_token_weight = output_token_weight
        self.chunk_tokens_shared = chunk_tokens_shared
        self.counters: dict[str, float] = {}
        self.virtual_time = 0.0  # counter of the last tenant served from the queue

    def sort_key(self, request: Request) -> tuple:
        return (request.arrival_time,)

    def new_queue(self) -> WaitingQueue:
        return FairQueue(self)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def admission_charge(self, request: Request) -> float:
        if request.num_preemptions:  # a readmission: its prompt was charged the first time
            return 0.0
        weight = self.weights.get(request.tenant, 1.0)
        return self.prompt_token_weight * request.num_prompt_tokens / weight

    def on_admitted(self, request: Request) -> None:
        self.counters[request.tenant] = self.counter(request.tenant) + \
            self.admission_charge(request)

    def on_tokens_generated(self, request: Request, num_tokens: int) -> None:
        weight = self.weights.get(request.tenant, 1.0)
        self.counters[request.tenant] = (self.counter(request.tenant)
                                         + self.output_token_weight * num_tokens / weight)

    def _most_served(self, candidates: Sequence[Request], exclude: str | None) -> Request | None:
        """The newest request of the tenant with the largest counter."""
        best: Request | None = None
        for request in candidates:
            if request.tenant == exclude:
                continue
            if best is None or (self.counter(request.tenant), request.arrival_time) >= \
                    (self.counter(best.tenant), best.arrival_time):
                best = request
        return best

    def defers_prefill(self, running: Request, head: Request) -> bool:
        # A tenant served more than the head's tenant, even once the head is charged, sends its
        # prompt chunks after the head (the same margin as displace: the two cannot defer to
        # each other). Measured in `treadle sim` (a heavy tenant 10x three light ones,
        # saturated): light requests queued behind heavy chunks, one per step.
        return running.tenant != head.tenant and \
            self.counter(running.tenant) - self.counter(head.tenant) > \
            self.admission_charge(head)

    def yielding_tenants(self, head: Request, running: Sequence[Request]) -> frozenset[str]:
        # The tenants displace() may take a slot from (served more by over the head's charge,
        # or at least as much while holding two more running requests) and, when the head's
        # tenant holds nothing running, every tenant served at least as much, sit out the head's
        # admission step: its first token then waits for that one short step instead of a
        # step of every heavy decode plus chunks. `treadle sim`, a heavy tenant sending 10x
        # each of three light ones, saturated (48 seqs, 256-token budget): light TTFT p50
        # 0.34-0.46 s -> 0.23-0.25 s, p99 0.70-1.0 s -> 0.52-1.0 s (what is left is the light
        # tenant's own charge: a second request right after its first waits for the heavy
        # tenant to be served as much); heavy throughput -1%. A tenant with nothing running
        # gets its step from any tenant served at least as much, even one holding a single
        # request: one long prompt of a heavy tenant capped to one request's worth of KV
        # (max_kv_blocks_per_tenant) otherwise put its chunk in every light admission step
        # (`treadle sim`, heavy prompts of 1,500 tokens, 200 blocks, cap 100, 128-token chunks:
        # light p99 TTFT 1.9-2.5 s -> 0.83-1.2 s, 0.43 s alone; heavy throughput unchanged).
        held = Counter(r.tenant for r in running)
        base, charge = self.counter(head.tenant), self.admission_charge(head)
        return frozenset(
            tenant for tenant, count in held.items() if tenant != head.tenant
            and (gap := self.counter(tenant) - base) >= 0
            and (gap > charge or count - held[head.tenant] >= 2 or not held[head.tenant]))

    def chunk_tokens(self, request: Request, threshold: int) -> int:
        # A step in flight cannot be interrupted: a light tenant's request that arrives during
        # a heavy tenant's long chunk waits for it, then for its own step. So while more than
        # one tenant is known, long prompts go in short chunks. `treadle sim`, a heavy tenant's
        # 1,000-token prompts filling a 128-block cache beside three light tenants' 100-token
        # ones, 8 arrival seeds: light p99 TTFT within 2x of alone for 29% of the tenants with
        # 128-token chunks, 96% with the heavy chunks at 32; the heavy work took 14% longer.
        # Cutting only the prompts of a tenant served more than another (the rule before)
        # left the heavy tenant its long chunks whenever the light tenants' lifted counters
        # passed its own, for seconds at a time: on the Zen 3 profile, 6 seeds, the worst
        # light p99 went from 3.3x to 2.4x of alone, the heavy work took no longer (it is
        # served more nearly always). A prompt that fits one chunk is never cut: in pieces,
        # a light prompt held the only prefill slot (light p99 10x worse in the same runs).
        if self.chunk_tokens_shared is None or self.chunk_tokens_shared >= threshold or \
                request.num_tokens <= threshold:
            return threshold
        if any(tenant != request.tenant for tenant in self.counters):
            return self.chunk_tokens_shared
        return threshold

    def victim(self, candidates: Sequence[Request]) -> Request:
        victim = self._most_served(candidates, exclude=None)
        assert victim is not None
        return victim

    def displace(self, head: Request, candidates: Sequence[Request]) -> Request | None:
        victim = self._most_served(candidates, exclude=head.tenant)
        if victim is None:
            return None
        gap = self.counter(victim.tenant) - self.counter(head.tenant)
        if gap > self.admission_charge(head):
            return victim
        if gap < 0:
            return None
        held = sum(1 for r in candidates if r.tenant == victim.tenant) - \
            sum(1 for r in candidates if r.tenant == head.tenant)
        return victim if held >= 2 else None


class FairQueue:
    """Per-tenant queues in arrival order, and a heap of backlogged tenants by counter.

    Counters only grow, so a heap entry is never too large: one found stale at the top is
    re-pushed with the tenant's counter, one whose tenant has nothing waiting is dropped.
    """

    def __init__(self, policy: FairPolicy) -> None:
        self.policy = policy
        self.lanes: dict[str, KeyedQueue] = {}
        self.tenants: list[tuple[float, str]] = []  # (counter when pushed, tenant)
        self.in_heap: set[str] = set()
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Request]:
        for tenant in sorted(self.lanes, key=lambda t: (self.policy.counter(t), t)):
            yield from self.lanes[tenant]

    def _top(self) -> str | None:
        counters = self.policy.counters
        while self.tenants:
            counter, tenant = self.tenants[0]
            if not self.lanes.get(tenant):
                heapq.heappop(self.tenants)
                self.in_heap.discard(tenant)
                self.lanes.pop(tenant, None)
            elif counter != counters.get(tenant, 0.0):
                heapq.heapreplace(self.tenants, (counters.get(tenant, 0.0), tenant))
            else:
                return tenant
        return None

    def add(self, request: Request) -> None:
        tenant = request.tenant
        if not self.lanes.get(tenant):  # newly backlogged: no credit for the time away
            top = self._top()
            floor = self.policy.counter(top) if top is not None else self.policy.virtual_time
            self.policy.counters[tenant] = max(self.policy.counter(tenant), floor)
        self.restore(request)

    def restore(self, request: Request) -> None:
        tenant = request.tenant
        self.lanes.setdefault(tenant, KeyedQueue(self.policy.sort_key)).add(request)
        self.size += 1
        if tenant not in self.in_heap:
            self.in_heap.add(tenant)
            heapq.heappush(self.tenants, (self.policy.counter(tenant), tenant))

    def remove(self, request: Request) -> None:
        self.lanes[request.tenant].remove(request)
        self.size -= 1

    def peek(self) -> Request | None:
        tenant = self._top()
        return None if tenant is None else self.lanes[tenant].peek()

    def pop(self) -> Request:
        tenant = self._top()
        assert tenant is not None, "pop from an empty queue"
        self.policy.virtual_time = max(self.policy.virtual_time, self.policy.counter(tenant))
        self.size -= 1
        return self.lanes[tenant].pop()

    def refresh(self, now: float, seconds_per_token: float | None) -> None:
        pass

    def ahead(self, probe: Request) -> tuple[int, int]:
        # The order ahead changes as counters do: count everything waiting (an upper bound).
        return self.size, sum(lane.tokens for lane in self.lanes.values())

    def check_invariants(self) -> None:
        for tenant, lane in self.lanes.items():
            lane.check_invariants()
            assert all(r.tenant == tenant for r in lane), f"a request in {tenant!r}'s lane"
            assert not lane or tenant in self.in_heap, f"{tenant!r} backlogged, not in the heap"
        assert len(self.in_heap) == len(self.tenants), "one heap entry per backlogged tenant"
        assert self.size == sum(len(lane) for lane in self.lanes.values()), "size is off"


# Deadline classes: a TTFT objective (earliest deadline first), only a TPOT objective, none.
WITH_TTFT, WITH_TPOT, NO_OBJECTIVE = 0, 1, 2


class DeadlinePolicy(SchedulingPolicy):
    """Earliest TTFT deadline (arrival + ttft) first; then requests with only a TPOT objective,
    then requests without objectives, each in arrival order. Slack: a waiting request that has
    not produced its first token and can no longer meet its deadline (deadline - now < its
    uncomputed tokens times the fitted seconds per token of a full step) moves to a late lane
    behind all the others, so a lost cause does not push the next request past its deadline
    too. Running requests without objectives are preempted first."""

    name = "deadline"

    def sort_key(self, request: Request) -> tuple:
        if request.ttft is not None:
            return (WITH_TTFT, request.arrival_time + request.ttft, request.arrival_time)
        cls = WITH_TPOT if request.tpot is not None else NO_OBJECTIVE
        return (cls, request.arrival_time, request.arrival_time)

    def new_queue(self) -> WaitingQueue:
        return DeadlineQueue(self.sort_key)


class DeadlineQueue:
    def __init__(self, key: Callable[[Request], tuple]) -> None:
        self.main = KeyedQueue(key)
        self.late = KeyedQueue(key)
        self.now = -math.inf
        self.seconds_per_token = 0.0

    def __len__(self) -> int:
        return len(self.main) + len(self.late)

    def __iter__(self) -> Iterator[Request]:
        yield from self.main
        yield from self.late

    def _is_late(self, request: Request) -> bool:
        if request.ttft is None or request.num_output_tokens:
            return False
        slack = (request.arrival_time + request.ttft - self.now
                 - uncomputed_tokens(request) * self.seconds_per_token)
        return slack < 0

    def add(self, request: Request) -> None:
        self.main.add(request)

    restore = add  # a late request handed back is found late again at the head

    def remove(self, request: Request) -> None:
        (self.late if request.request_id in self.late.entries else self.main).remove(request)

    def peek(self) -> Request | None:
        head = self.main.peek()
        while head is not None and self._is_late(head):
            self.late.add(self.main.pop())
            head = self.main.peek()
        return head if head is not None else self.late.peek()

    def pop(self) -> Request:
        head = self.peek()
        assert head is not None, "pop from an empty queue"
        return (self.main if head.request_id in self.main.entries else self.late).pop()

    def refresh(self, now: float, seconds_per_token: float | None) -> None:
        self.now, self.seconds_per_token = now, seconds_per_token or 0.0

    def ahead(self, probe: Request) -> tuple[int, int]:
        return self.main.ahead(probe)

    def check_invariants(self) -> None:
        self.main.check_invariants()
        self.late.check_invariants()
        assert not self.main.entries.keys() & self.late.entries.keys(), "queued twice"


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": FCFSPolicy, "priority": PriorityPolicy, "fair": FairPolicy,
    "deadline": DeadlinePolicy}


def make_policy(name: str, config: SchedulerConfig | None = None) -> SchedulingPolicy:
    """The policy called `name`, with its settings from `config`."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    if name == "fair":
        config = config or SchedulerConfig()
        return FairPolicy(config.tenant_weights, config.fair_prompt_token_weight,
                          config.fair_output_token_weight, config.fair_chunk_tokens)
    return POLICIES[name]()


MIN_RELATIVE_SPREAD = 0.01  # variance of step sizes / mean square, below which: no intercept


class StepFit(NamedTuple):
    """A step's seconds as fixed + per_token * its batched tokens."""

    fixed: float
    per_token: float

    def seconds(self, num_tokens: float) -> float:
        return self.fixed + self.per_token * num_tokens


class StepTimeModel:
    """An online fit of step seconds = fixed + per_token * tokens over the engine's measured
    steps: least squares on (tokens, seconds), each past step's weight multiplied by
    `forgetting` per new step (about the last 1 / (1 - forgetting) steps count), so the fit
    follows the load. Deliberately small: five running sums, O(1) per step. The fixed term is
    what a step costs whatever its size (weights read once, launch overheads), the per-token
    term what each batched token adds; one average per token made small steps look dearer per
    token than large ones, and could not say what a step of 60 decodes costs.

    A fit that would be unphysical falls back to a simpler one: steps all of about one size (no
    spread to separate the terms) or a negative intercept -> through the origin (per token
    only); a negative slope -> a constant. `fit` is None until a step is measured."""

    def __init__(self, forgetting: float = 0.95) -> None:
        self.forgetting = forgetting
        self.weight = self.sum_x = self.sum_y = self.sum_xx = self.sum_xy = 0.0
        self.fit: StepFit | None = None

    def update(self, duration: float, num_tokens: int) -> None:
        if num_tokens <= 0:  # an empty step says nothing
            return
        f, x = self.forgetting, float(num_tokens)
        self.weight = f * self.weight + 1.0
        self.sum_x = f * self.sum_x + x
        self.sum_y = f * self.sum_y + duration
        self.sum_xx = f * self.sum_xx + x * x
        self.sum_xy = f * self.sum_xy + x * duration
        self.fit = self._solve()

    def _solve(self) -> StepFit:
        spread = self.weight * self.sum_xx - self.sum_x ** 2
        # Token counts spread by less than a tenth of their size: the slope would be mostly
        # timing noise; one ratio predicts steps of that size as well.
        if spread > MIN_RELATIVE_SPREAD * self.weight * self.sum_xx:
            per_token = (self.weight * self.sum_xy - self.sum_x * self.sum_y) / spread
            fixed = (self.sum_y - per_token * self.sum_x) / self.weight
            if per_token < 0:
                return StepFit(max(0.0, self.sum_y / self.weight), 0.0)
            if fixed >= 0:
                return StepFit(fixed, per_token)
        return StepFit(0.0, max(0.0, self.sum_xy / self.sum_xx))

    @property
    def recent_step_seconds(self) -> float | None:
        """The mean of the recent steps (the same forgetting): what a step costs under the
        load the engine has now, arrivals' prefill chunks included."""
        return self.sum_y / self.weight if self.weight else None

    def seconds_per_token(self, num_tokens: int) -> float | None:
        """Seconds each token of a step of `num_tokens` costs (the fixed cost shared out)."""
        if self.fit is None:
            return None
        return self.fit.seconds(num_tokens) / max(1, num_tokens)


def predict_ttft(num_tokens_ahead: int, num_prompt_tokens: int, num_decoding: int,
                 token_budget: int, fit: StepFit) -> float:
    """Seconds until a new request's prompt has been computed, when `num_tokens_ahead` tokens
    go first and each step, of at most `token_budget` tokens, also carries `num_decoding`
    decode tokens: every step pays the fixed cost, every token the per-token one."""
    work = num_tokens_ahead + num_prompt_tokens
    steps = math.ceil(work / max(1, token_budget - num_decoding))
    return steps * fit.fixed + (work + steps * num_decoding) * fit.per_token


def predict_tpot(num_decoding: int, num_prefill_tokens: int, token_budget: int,
                 fit: StepFit) -> float:
    """Seconds of one step once a request decodes: `num_decoding` decode tokens (it among
    them) and as many of `num_prefill_tokens` as the token budget leaves beside them."""
    prefill = min(num_prefill_tokens, max(0, token_budget - num_decoding))
    return fit.seconds(num_decoding + prefill)
