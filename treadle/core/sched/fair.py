"""Fair share between tenants: the Virtual Token Counter (Sheng et al., OSDI 2024), its
settings, and its queue (per-tenant lanes, the least-served backlogged tenant first)."""

from __future__ import annotations

import heapq
import statistics
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from treadle.config import SchedulerConfig, setting
from treadle.core.request import Request
from treadle.core.sched.policy import (
    KeyedQueue,
    SchedulingPolicy,
    WaitingQueue,
    context_weight,
    is_prefill,
    register_policy,
)

# The least derived cut (the tenants issue measured light tenants protected at 16): a chunk of
# 16 costs 1.4x a full chunk's per token, more below (docs/decisions.md, issue 34).
MIN_DERIVED_CHUNK = 16
# The derived cut follows the upper median of this many short prompts last admitted beside
# another tenant's requests: enough to ride out a few odd prompts (a client's one-token probe
# held the cut at its floor), few enough to follow a change of workload (docs/decisions.md).
SHORT_PROMPTS_SEEN = 16
# A cut step weighs this many short prompts (their upper median), the running decodes in it
# counted by their context: one arriving during it waits about that many of its own prefills,
# then its own step (3x alone in all). One prompt's worth paid a step's fixed cost twice as
# often (docs/decisions.md, issue 34).
CUT_SHORT_PROMPTS = 2
# A tenant's decodes sit out a short request's admission step (its tenant waiting for nothing
# else, or only for short requests that fit the same step), whatever the counters, when they
# weigh this share of its prompt or more: decode rows deep in a context cost about twice
# their weight (their attention reads the KV at memory speed), so the step would take about
# twice the request's own time (docs/decisions.md, issue 34).
DECODES_SIT_OUT_SHARE = 0.5
# A tenant counts as present this long after it last had a request: one whose requests come
# one at a time is still there when the next arrives (seconds).
PRESENCE_SECONDS = 10.0


@dataclass(frozen=True)
class FairSettings:
    """A tenant's service is w_p per prompt token plus w_q per output token, divided by its
    weight (SchedulerConfig.tenant_weights)."""

    fair_prompt_token_weight: float = setting(1.0, "under --policy fair, the service a prompt "
                                              "token costs")
    fair_output_token_weight: float = setting(2.0, "under --policy fair, the service an output "
                                              "token costs")
    fair_chunk_tokens: int | None = setting(
        None, "under --policy fair, while more than one tenant is present, the most prompt "
        "tokens per step of long prompts, so steps stay short for the others' arrivals",
        none=f"the upper median tokens the last {SHORT_PROMPTS_SEEN} short prompts computed at "
        f"admission times {CUT_SHORT_PROMPTS}, less the running decodes (each weighted by its "
        f"context), at least {MIN_DERIVED_CHUNK}")

    def __post_init__(self) -> None:
        if not (self.fair_prompt_token_weight >= 0 and self.fair_output_token_weight >= 0):
            raise ValueError("fair token weights must be >= 0")
        if self.fair_chunk_tokens is not None and self.fair_chunk_tokens < 1:
            raise ValueError("fair_chunk_tokens must be >= 1 (or None: derived)")


@register_policy
class FairPolicy(SchedulingPolicy):
    """Fair share between tenants: the Virtual Token Counter.

    Each tenant's counter grows by w_p per prompt token (charged at first admission) and w_q per
    output token, divided by the tenant's weight. The backlogged tenant with the least counter
    goes first, its requests in arrival order. A tenant that becomes backlogged has its counter
    lifted, so idle time banks no credit, to the service the least served backlogged tenant has
    received: its counter less the prompt tokens it was charged for and has not yet computed
    (with nobody backlogged, the least of that for the last tenant admitted and the counter
    the queue last served at). Lifted to the counter itself, a light tenant passed a heavy one
    whose long prompts were charged at admission, for the whole prefill, and the heavy tenant
    stopped giving way to it.
    The paper's bound: between two continuously backlogged tenants, service differs by at most
    2 * max(w_p * L_in, w_q * M), L_in the longest prompt, M the most tokens the KV cache holds.

    When blocks or batch slots bind, the head (its tenant least served) may preempt the newest
    running request of the most served tenant, while either that tenant's counter exceeds the
    head tenant's by more than the head's own charge (admitting it cannot flip the order), or it
    is served at least as much and holds at least two more running requests (admitting one
    cannot flip that either): so two requests cannot preempt each other back and forth; over
    time, max_policy_preemptions bounds how often one request is displaced. The second rule is
    what lets a light tenant in at once when the heavy tenant's prompts are computed: a
    newcomer's counter is then lifted to the heavy tenant's, so the first rule alone made it
    wait for a slot to free.
    """

    name = "fair"
    summary = "fair share between tenants"
    settings_class = FairSettings
    # A step in flight holds up whoever arrives, a newcomer's first request too (issue 34).
    weighs_context = True

    def __init__(self, weights: Mapping[str, float] | None = None,
                 settings: FairSettings | None = None) -> None:
        settings = settings or FairSettings()
        self.weights = dict(weights or {})
        self.prompt_token_weight = settings.fair_prompt_token_weight
        self.output_token_weight = settings.fair_output_token_weight
        self.chunk_tokens_shared = settings.fair_chunk_tokens
        self.counters: dict[str, float] = {}
        self.virtual_time = 0.0  # counter of the last tenant served from the queue
        self.last_admitted: str | None = None  # tenant of the last request admitted
        self.queue = FairQueue(self)  # the scheduler's waiting queue, once bound (new_queue)
        # Derived KV caps, by tenant, until the demands change (a step starts, a request is
        # queued or removed): admitting a request moves its demand from waiting to running.
        self.caps: dict[str, int] = {}
        # The tokens the last short prompts computed at admission (past a cached prefix), and
        # the cut derived from them and the running decodes as of the step's start
        # (FairQueue.refresh): one cut a step.
        self.short_prompt_tokens: deque[int] = deque(maxlen=SHORT_PROMPTS_SEEN)
        self.step_cut = MIN_DERIVED_CHUNK

    @classmethod
    def from_config(cls, config: SchedulerConfig, settings: FairSettings) -> FairPolicy:
        return cls(config.tenant_weights, settings)

    def sort_key(self, request: Request) -> tuple:
        return (request.arrival_time,)

    def new_queue(self) -> WaitingQueue:
        self.queue = FairQueue(self)
        return self.queue

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def admission_charge(self, request: Request) -> float:
        if request.num_preemptions:  # a readmission: its prompt was charged the first time
            return 0.0
        weight = self.weights.get(request.tenant, 1.0)
        return self.prompt_token_weight * request.num_prompt_tokens / weight

    def delivered(self, tenant: str) -> float:
        """The tenant's counter less the prompt tokens its running requests were charged for
        and have not yet computed (a readmission's, past what it had computed before its
        preemption; one waiting to be readmitted is left out)."""
        running = [] if self.scheduler is None else self.scheduler.running
        prepaid = sum(max(0, r.num_prompt_tokens - max(r.num_computed_tokens,
                                                       r.stats.recompute_until))
                      for r in running if r.tenant == tenant)
        return self.counter(tenant) - \
            self.prompt_token_weight * prepaid / self.weights.get(tenant, 1.0)

    def lift_floor(self, top: str | None) -> float:
        """What a newly backlogged tenant's counter is lifted to: the service received by the
        least served backlogged tenant `top`; with none, by the last tenant admitted, or the
        counter the queue last served at if that is less."""
        if top is not None:
            return self.delivered(top)
        if self.last_admitted is None:
            return self.virtual_time
        return min(self.virtual_time, self.delivered(self.last_admitted))

    def on_admitted(self, request: Request) -> None:
        self.last_admitted = request.tenant
        # Only beside another tenant's requests, whom the cut is for; a held sample's prompt is
        # cached.
        if self._is_short(request) and not request.held and len(self.scheduler.tenants) > 1:
            self.short_prompt_tokens.append(request.num_prompt_tokens - request.num_cached_tokens)
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
        if head.num_preemptions:  # nobody defers to a readmission (deferral cycles livelocked)
            return False
        # A tenant served more than the head's tenant, even once the head is charged, sends its
        # prompt chunks after the head (the same margin as displace: the two cannot defer to
        # each other); else light requests queue behind heavy chunks, one per step.
        return running.tenant != head.tenant and \
            self.counter(running.tenant) - self.counter(head.tenant) > \
            self.admission_charge(head)

    def may_pass(self, request: Request, passed: Request) -> bool:
        # Another tenant's request goes around one that does not fit only while, charged, it
        # stays within the passed tenant's counter plus the passed prompt's charge (a
        # readmission's too): passing without end breaks the paper's bound (docs/decisions.md).
        margin = self.prompt_token_weight * passed.num_prompt_tokens / \
            self.weights.get(passed.tenant, 1.0)
        return request.tenant == passed.tenant or \
            self.counter(request.tenant) + self.admission_charge(request) <= \
            self.counter(passed.tenant) + margin

    def yielding_tenants(self, head: Request, running: Sequence[Request]) -> frozenset[str]:
        # The tenants displace() may take a slot from (served more by over the head's charge,
        # or at least as much while holding two more running requests) and, when the head's
        # tenant holds nothing running, every tenant served at least as much, sit out the head's
        # admission step: its first token then waits for that one short step instead of a
        # step of every heavy decode plus chunks. A tenant with nothing running gets its step
        # from any tenant served at least as much, even one holding a single request: else one
        # long prompt of a heavy tenant capped to one request's worth of KV
        # (max_kv_blocks_per_tenant) put its chunk in every light admission step.
        # A tenant prefilling a long prompt also sits out a short head's step, whatever the
        # head's tenant holds: a light tenant still decoding, late in a heavy prompt (little of
        # its charge left uncomputed, so the light tenant was lifted near the heavy counter),
        # meets no rule above (docs/decisions.md, issue 34).
        # Only while prefilling: tenants of long prompts all decoding (chat with history) would
        # sit out each other's every admission.
        # Where no rule above holds, a tenant whose decodes weigh DECODES_SIT_OUT_SHARE of a
        # short head's prompt sits its step out whatever the counters, if the head's tenant has
        # nothing waiting but short requests one step admits together, though not two steps in
        # a row: a tenant whose requests come one at a time, lifted to the other's service at
        # each, passes it by its own few decodes, and its admission step carried the other's
        # every decode (`n: 4`; a burst of light arrivals too). A tenant with a longer backlog
        # goes by the counters; a step's worth at a time takes every other step at most.
        if head.num_preemptions:  # nobody yields to a readmission (yield cycles livelocked)
            return frozenset()
        held = Counter(r.tenant for r in running)
        base, charge = self.counter(head.tenant), self.admission_charge(head)
        short = self._is_short(head)
        long_tenants = self._long_prompt_tenants(running) if short else set()
        heavy_decodes: set[str] = set()
        if short and self._backlog_fits_a_step(head.tenant):
            assert self.scheduler is not None  # a short head needs one
            heavy_decodes = {tenant for tenant, weight in self._decode_weights(running).items()
                             if weight >= DECODES_SIT_OUT_SHARE * head.num_tokens
                             and tenant not in self.scheduler.sat_out}
        return frozenset(
            tenant for tenant, count in held.items() if tenant != head.tenant
            and ((gap := self.counter(tenant) - base) >= 0
                 and (gap > charge or count - held[head.tenant] >= 2 or not held[head.tenant]
                      or tenant in long_tenants)
                 or tenant in heavy_decodes))

    def _backlog_fits_a_step(self, tenant: str) -> bool:
        """`tenant`'s waiting requests are all short and fit one step's budget together."""
        assert self.scheduler is not None
        lane = self.queue.lanes.get(tenant)
        return lane is not None and \
            lane.tokens <= self.scheduler.config.max_num_batched_tokens and \
            all(self._is_short(r) for r in lane)

    def _is_short(self, request: Request) -> bool:
        return self.scheduler is not None and self.scheduler.is_short(request)

    def _decode_weights(self, running: Sequence[Request]) -> Counter[str]:
        """Each tenant's decodes, each weighted by its context as the scheduler weighs long
        prompts' tokens (context_weight)."""
        assert self.scheduler is not None
        b = self.scheduler.attention_break_even
        weights: Counter[str] = Counter()
        for r in running:
            if not is_prefill(r):
                weights[r.tenant] += context_weight(r.num_computed_tokens, b)
        return weights

    def _long_prompt_tenants(self, running: Sequence[Request]) -> set[str]:
        """Tenants with a long prompt mid-prefill."""
        return {r.tenant for r in running if is_prefill(r) and not self._is_short(r)}

    def shared(self) -> bool:
        """More than one tenant has requests, a short one among them (a prompt of one chunk),
        or had at a step in the last PRESENCE_SECONDS. Tenants of long prompts alone do not
        cut each other's: each waits for its own prefill anyway, and two heavy tenants cut
        theirs for the whole run (issue 34's scenario: 1.8x the heavy tenants' time)."""
        assert self.scheduler is not None
        return self.scheduler.shared_with_short() or \
            self.scheduler.clock() - self.scheduler.last_shared < PRESENCE_SECONDS

    def chunk_tokens(self, request: Request, threshold: int) -> int:
        # A step in flight cannot be interrupted: a light tenant's request that arrives during
        # a heavy tenant's long chunk waits for it, then for its own step. So while more than
        # one tenant is present, long prompts go in short chunks, whoever is served more
        # (cutting only the more-served tenant's left it long chunks whenever the light
        # tenants' lifted counters passed its own), and the scheduler gives a step's cut
        # prompts one chunk between them. Only while present, so a heavy tenant gets its speed
        # back once the others have gone. A prompt that fits one chunk is never cut: in pieces,
        # a light prompt held the only prefill slot.
        if request.num_tokens <= threshold or self.scheduler is None or not self.shared():
            return threshold
        chunk = self.chunk_tokens_shared
        if chunk is None:
            chunk = self.step_cut
        return min(chunk, threshold)

    def derived_chunk_tokens(self) -> int:
        """The tokens a step's cut prompts share: CUT_SHORT_PROMPTS x what a short request
        computes at its admission (the upper median of the last SHORT_PROMPTS_SEEN), less the
        running decodes, each weighted by its context (context_weight) as the step's budget weighs
        long prompts' tokens; so one arriving during a cut step waits for about CUT_SHORT_PROMPTS of
        its own prefills' worth of others' work, and a step of short requests' size costs the long
        prompts little per token; at least MIN_DERIVED_CHUNK (docs/decisions.md, issue 34).
        Before any short prompt is admitted, MIN_DERIVED_CHUNK. At the engine's threshold or
        above it, long prompts are not cut."""
        if not self.short_prompt_tokens:
            return MIN_DERIVED_CHUNK
        assert self.scheduler is not None  # short prompts are told by the scheduler
        prompts_weight = CUT_SHORT_PROMPTS * statistics.median_high(self.short_prompt_tokens)
        decodes_weight = sum(self._decode_weights(self.scheduler.running).values())
        return max(MIN_DERIVED_CHUNK, int(prompts_weight - decodes_weight))

    def tenant_kv_cap(self, tenant: str) -> int | None:
        # max_kv_blocks_per_tenant when given; else, while another tenant has requests waiting
        # or running, its max-min share: the cache filled by weight, each other tenant up to
        # what it needs (its running requests' blocks and its waiting requests'), the rest
        # shared; one tenant alone is never capped (work conserving:
        # fair is fcfs). A fixed half for a heavy tenant beside a light one holding a few blocks
        # ran the heavy tenant one request at a time (docs/decisions.md, issue 34). Whatever the
        # counters say: capping only the better served tenant let the cap switch on and off as
        # the counters crossed. So shares of blocks, not the counters, rule while the cache binds.
        cap = super().tenant_kv_cap(tenant)
        if cap is not None or self.scheduler is None:
            return cap
        present = self.scheduler.tenants
        if not any(t != tenant for t in present):
            return None
        if tenant not in self.caps:
            self.caps[tenant] = self._max_min_share(tenant, present)
        return self.caps[tenant]

    def _max_min_share(self, tenant: str, present: Mapping[str, int]) -> int:
        """`tenant`'s blocks when the cache is filled level by level by weight, each other
        present tenant up to its demand (its committed_blocks, the blocks its decodes take this
        step, and its waiting requests' as of the step's start), `tenant` without bound. The
        decodes' blocks count so that a tenant at its share to the block is over it when another
        tenant's decode needs a block."""
        assert self.scheduler is not None
        block_size = self.scheduler.block_size
        growth = self.scheduler.decode_growth()
        demand = Counter({t: self.scheduler.committed_blocks(t) + growth[t] for t in present})
        for other, tokens in self.queue.demand_tokens.items():
            demand[other] += -(-tokens // block_size)
        weight = self.weights.get
        others = sorted((demand[t] / weight(t, 1.0), t) for t in present if t != tenant)
        remaining = float(self.scheduler.num_blocks)
        weight_left = sum(weight(t, 1.0) for t in present)
        for per_weight, other in others:  # ascending: the first above the level ends the fill
            if per_weight > remaining / weight_left:
                break
            remaining -= demand[other]
            weight_left -= weight(other, 1.0)
        return max(1, int(remaining * weight(tenant, 1.0) / weight_left))

    def config_cap_unset(self) -> bool:
        return self.scheduler is not None and \
            self.scheduler.config.max_kv_blocks_per_tenant is None

    def _over_own_share(self, head: Request) -> bool:
        """Admitting `head` would take its tenant past its share."""
        assert self.scheduler is not None
        cap = self.tenant_kv_cap(head.tenant)
        return cap is not None and self.scheduler.exceeds_cap(head, cap)

    def _over_share(self, candidates: Sequence[Request], exclude: str) -> Request | None:
        """The newest candidate of the tenant whose running requests' blocks exceed its share
        (tenant_kv_cap) by the most, other than `exclude`; None when no tenant is over."""
        assert self.scheduler is not None
        worst, worst_excess = None, 0
        for tenant in {r.tenant for r in candidates if r.tenant != exclude}:
            cap = self.tenant_kv_cap(tenant)
            if cap is None:
                continue
            excess = self.scheduler.committed_blocks(tenant) - cap
            if excess > worst_excess:
                worst, worst_excess = tenant, excess
        if worst is None:
            return None
        return max((r for r in candidates if r.tenant == worst), key=lambda r: r.arrival_time)

    def step_order(self, running: Sequence[Request]) -> list[Request]:
        # The least served tenant first, so the most served tenant's newest request is the one
        # preempted for blocks; but a tenant over its share of the cache goes after the others,
        # whatever the counters (a light tenant's counter, lifted to a heavy one's, made it the
        # victim of the heavy tenant's growth). Among its requests, those preempted
        # max_policy_preemptions times go first, so the same ones are not preempted for ever;
        # still after the others, so `n: 4`'s samples, preempted for each other's growth, do not
        # make a light request the victim (docs/decisions.md, issue 34). Over with the blocks its
        # decodes take this step: a tenant at its share grows past it in the step (`n: 4`'s 24
        # decodes), and the light tenant's requests, last by their lifted counters, were
        # preempted for that growth.
        over: set[str] = set()
        limit = 0
        if self.scheduler is not None and self.config_cap_unset():
            limit = self.scheduler.config.max_policy_preemptions
            growth = self.scheduler.decode_growth()
            for tenant in {r.tenant for r in running}:
                cap = self.tenant_kv_cap(tenant)
                if cap is not None and \
                        self.scheduler.committed_blocks(tenant) + growth[tenant] > cap:
                    over.add(tenant)
        return sorted(running, key=lambda r: (r.tenant in over,
                                              r.tenant in over and r.num_preemptions < limit,
                                              self.counter(r.tenant), r.arrival_time))

    def displace(self, head: Request, candidates: Sequence[Request]) -> Request | None:
        # A tenant within its share takes blocks back from the tenant most over its own: that
        # tenant's newest running request (none is scheduled yet in the step). Never for a
        # readmission after preemption: a preempted request displacing in turn could cycle (it
        # would take back the place of the request that displaced it); it waits for room, as in
        # vLLM.
        if head.num_preemptions:
            return None
        if self.scheduler is not None and self.config_cap_unset() and \
                not self._over_own_share(head):
            victim = self._over_share(candidates, exclude=head.tenant)
            if victim is not None:
                return victim
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
    """Per-tenant queues in arrival order, and a heap of backlogged tenants by counter; at
    equal counters, a tenant lifted as it became backlogged (FairPolicy.lift_floor) goes first
    (it was served less), the others in the order they became backlogged.

    Counters only grow, so a heap entry is never too large: one found stale at the top is
    re-pushed with the tenant's counter, one whose tenant has nothing waiting is dropped.
    """

    def __init__(self, policy: FairPolicy) -> None:
        self.policy = policy
        self.lanes: dict[str, KeyedQueue] = {}
        self.tenants: list[tuple[float, int, str]] = []  # (counter when pushed, rank, tenant)
        self.in_heap: set[str] = set()
        # A tenant's rank among equal counters, set as it becomes backlogged: the count of
        # backloggings so far, negated where it was lifted (the latest lifted first).
        self.rank: dict[str, int] = {}
        self.backloggings = 0
        self.size = 0
        # Each tenant's waiting tokens as of the step's start, plus those queued since: the
        # requests a step passes over leave the lanes for a while, not the demand.
        self.demand_tokens: Counter[str] = Counter()

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Request]:
        for tenant in sorted(self.lanes, key=lambda t: (self.policy.counter(t),
                                                        self.rank.get(t, 0), t)):
            yield from self.lanes[tenant]

    def _top(self) -> str | None:
        counters = self.policy.counters
        while self.tenants:
            counter, rank, tenant = self.tenants[0]
            if not self.lanes.get(tenant):
                heapq.heappop(self.tenants)
                self.in_heap.discard(tenant)
                self.lanes.pop(tenant, None)
            elif counter != counters.get(tenant, 0.0):
                heapq.heapreplace(self.tenants, (counters.get(tenant, 0.0), rank, tenant))
            else:
                return tenant
        return None

    def add(self, request: Request) -> None:
        tenant = request.tenant
        if not self.lanes.get(tenant):  # newly backlogged: no credit for the time away
            top = self._top()
            floor = self.policy.lift_floor(top)
            lifted = self.policy.counter(tenant) < floor
            self.policy.counters[tenant] = max(self.policy.counter(tenant), floor)
            if tenant in self.in_heap:  # a stale entry (nothing waiting): the rank changes
                self.tenants = [entry for entry in self.tenants if entry[2] != tenant]
                heapq.heapify(self.tenants)
                self.in_heap.discard(tenant)
            self.backloggings += 1
            self.rank[tenant] = -self.backloggings if lifted else self.backloggings
        self.restore(request)
        self.demand_tokens[tenant] += request.num_tokens - request.num_computed_tokens
        self.policy.caps.clear()

    def restore(self, request: Request) -> None:
        tenant = request.tenant
        self.lanes.setdefault(tenant, KeyedQueue(self.policy.sort_key)).add(request)
        self.size += 1
        if tenant not in self.in_heap:
            self.in_heap.add(tenant)
            heapq.heappush(self.tenants, (self.policy.counter(tenant), self.rank.get(tenant, 0),
                                          tenant))

    def remove(self, request: Request) -> None:
        self.lanes[request.tenant].remove(request)
        self.size -= 1
        self.demand_tokens[request.tenant] -= request.num_tokens - request.num_computed_tokens
        self.policy.caps.clear()

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
        self.demand_tokens = Counter({t: lane.tokens for t, lane in self.lanes.items()
                                      if lane.tokens})
        self.policy.caps.clear()
        # Only where it will be read (chunk_tokens): a server of one tenant skips the decodes' sum.
        if self.policy.chunk_tokens_shared is None and self.policy.shared():
            self.policy.step_cut = self.policy.derived_chunk_tokens()

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
