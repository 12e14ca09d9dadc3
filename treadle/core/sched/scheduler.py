"""Scheduler: each step, which requests share the next model pass and how many tokens each.

One mechanism: a request's `num_computed_tokens` trails its `num_tokens`, and each step hands out
tokens to close the gap within the step's token budget. A new prompt, a prefill chunk, a prefix
hit (tokens counted computed at admission), a decode step and a recompute after preemption are
all that one rule.

A step, each part in the queue policy's order (policy.py): the waiting queue's head may
displace running requests the policy ranks below it (priority, fair share), and when it is sure
to be admitted, the tenants the policy says yield to it (fair share) sit the step out; running
requests get a decode token or a prefill chunk in the policy's step order, preempting the last
not yet scheduled when blocks run short; then
waiting requests are admitted, unless blocks ran short, within the token budget, batch slots and
max_num_partial_prefills (a prompt that completes in its step takes no prefill slot), each only
when the blocks for its whole prompt are free beside those running prompts still need; last, the
prefill chunks the policy deferred behind the waiting head get the budget left.
"""

from __future__ import annotations

import heapq
import time
from bisect import insort
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from treadle.config import SchedulerConfig
from treadle.core.kv_cache import KVCacheManager, cdiv
from treadle.core.lora_request import LoRARequest
from treadle.core.request import Request, RequestStatus
from treadle.core.sched.policy import (
    SchedulingPolicy,
    WaitingQueue,
    context_weight,
    is_prefill,
    uncomputed_tokens,
)
from treadle.core.sched.step_time import StepTimeModel
from treadle.errors import PROMPT, InvalidField

# A waiting request passed over this many times for lack of blocks reserves the queue: nothing
# behind it is admitted until it fits. Running requests then drain (each is bounded by its
# max_tokens) and free their blocks, so it cannot starve; until then, smaller requests behind it
# may go (where the policy lets them: may_pass), so it does not block the line either.
MAX_SKIPS = 8
# Waiting requests one step passes over (they do not fit) before it stops looking: a step's
# admission work stays bounded however long the queue.
MAX_LOOKAHEAD = 32
# The least a step's first long prompt computes however deep its context (tokens).
MIN_CONTEXT_ALLOWANCE = 16


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens [num_computed_tokens, + num_new_tokens)."""

    request: Request
    num_computed_tokens: int  # tokens already in the cache before this step
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table, covering the new tokens
    produces_token: bool  # the step reaches the last known token: sample the next one
    # Proposed tokens after its last token (speculative decoding), the last of num_new_tokens:
    # the step checks them, and they stay only as far as they are accepted.
    spec_token_ids: Sequence[int] = ()

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        if self.spec_token_ids:
            return [*self.request.all_token_ids[start:], *self.spec_token_ids]
        return self.request.all_token_ids[start:start + self.num_new_tokens]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 policy: SchedulingPolicy, max_model_len: int,
                 eos_token_ids: Iterable[int] = (),
                 clock: Callable[[], float] = time.monotonic,
                 adapter_ready: Callable[[LoRARequest], bool] = lambda lora: True,
                 attention_break_even: int = 0) -> None:
        self.config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.policy = policy
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # ModelSpec.attention_break_even (positions); 0: context is not weighed.
        self.attention_break_even = attention_break_even
        self.clock = clock  # the clock of requests' arrival times (deadlines, slack)
        # Whether an adapter is in memory (its load starts if not): a request waits for its
        # adapter's load off the step, never in one.
        self.adapter_ready = adapter_ready
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: WaitingQueue = policy.new_queue()
        self.running: list[Request] = []  # sorted by the policy's key
        self.step_time = StepTimeModel()  # the engine feeds it each step's measured time
        self.num_preemptions = 0
        self.num_queue_timeouts = 0
        # With max_queue_wait: (when it reached the engine, id, request) of each request queued,
        # oldest on top; those scheduled or ended meanwhile are dropped as they surface.
        self.unscheduled: list[tuple[float, int, Request]] = []
        self.tenants: Counter[str] = Counter()  # unfinished requests per tenant
        self.cut_tokens_scheduled = 0  # this step's tokens of prompts the policy cuts
        # The step's token budget left to long prompts, each token weighted by its context, and
        # whether one has been charged (_context_allowance).
        self.context_tokens_left = float(scheduler_config.max_num_batched_tokens)
        self.context_charged = False
        # Unfinished requests whose prompt fits one chunk: those long prompts' chunks hold up.
        self.short_requests: dict[str, Request] = {}
        # The clock at the last step that began with more than one tenant's requests unfinished,
        # a short one among them.
        self.last_shared = -float("inf")
        # Cut prompts whose chunk sat out a step for a short prompt's admission and has not run
        # since: they sit out no other until it has, so short requests cannot stall them.
        self.cuts_held: set[str] = set()
        # The tenants whose running requests sat out the last step for a waiting head.
        self.sat_out: frozenset[str] = frozenset()
        # kv_blocks_by_tenant's count by tenant, as of (the block pool's version, the number
        # running): committed_blocks reads it a few times a step.
        self._held_blocks: tuple[tuple[int, int], Counter[str]] = ((-1, -1), Counter())
        policy.bind(self)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_manager.num_blocks

    @property
    def block_size(self) -> int:
        return self.kv_cache_manager.block_size

    def committed_blocks(self, tenant: str) -> int:
        """The KV blocks `tenant`'s running requests hold, each once however many of them
        share it (a prefix), plus those their prompts mid-prefill still need (a prompt counts
        whole). A block shared with another tenant counts for neither."""
        key = (self.kv_cache_manager.block_pool.version, len(self.running))
        if self._held_blocks[0] != key:
            self._held_blocks = (key, self.kv_blocks_by_tenant()[0])
        return self._held_blocks[1][tenant] + sum(
            self._blocks_to_finish(r) for r in self.running if r.tenant == tenant and is_prefill(r))

    def decode_growth(self) -> Counter[str]:
        """By tenant, the blocks its running decodes take this step: those whose next token
        starts a block."""
        tables = self.kv_cache_manager.block_id_tables
        block_size = self.kv_cache_manager.block_size
        return Counter(r.tenant for r in self.running if not is_prefill(r)
                       and cdiv(r.num_tokens, block_size) > len(tables.get(r.request_id, ())))

    def exceeds_cap(self, request: Request, cap: int) -> bool:
        """Admitting `request` takes its tenant's committed_blocks past `cap`: its whole
        prompt's blocks, less a cached prefix some running request holds already (hashed only
        where the whole prompt would not fit)."""
        committed = self.committed_blocks(request.tenant)
        whole = cdiv(request.num_tokens, self.kv_cache_manager.block_size)
        if committed + whole <= cap:
            return False
        hit_blocks, _ = self._prefix_hit(request)
        return committed + whole - sum(1 for block in hit_blocks if block.ref_cnt) > cap

    def kv_blocks_by_tenant(self) -> tuple[Counter[str], int]:
        """The KV blocks held by each tenant's running requests alone, and those held by more
        than one tenant's (a prefix shared across tenants): each block in use counted once."""
        kv = self.kv_cache_manager
        held: Counter[str] = Counter()
        if not kv.block_pool.num_shared_blocks:  # no block is in two tables: count tables
            for request in self.running:
                held[request.tenant] += len(kv.block_id_tables.get(request.request_id, ()))
            return held, 0
        # Sets of block ids: unions and intersections in C; a Python loop over every block of
        # every table was a visible part of a step with many samples of long prompts.
        by_tenant: dict[str, set[int]] = {}
        for request in self.running:
            by_tenant.setdefault(request.tenant, set()).update(
                kv.block_id_tables.get(request.request_id, ()))
        seen: set[int] = set()
        across: set[int] = set()  # blocks in more than one tenant's tables
        for ids in by_tenant.values():
            across |= seen & ids
            seen |= ids
        for tenant, ids in by_tenant.items():
            if own := len(ids - across) if across else len(ids):
                held[tenant] = own
        return held, len(across)

    def shared_with_short(self) -> bool:
        """More than one tenant has requests unfinished, a short one among them."""
        return len(self.tenants) > 1 and bool(self.short_requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        """Queue a request, or refuse at once one that could never run (InvalidField)."""
        num_prompt = request.num_prompt_tokens
        max_tokens = 0 if request.pooling else request.sampling_params.max_tokens
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if num_prompt == 0:
            raise InvalidField(PROMPT, "the prompt must have at least one token")
        if num_prompt + max_tokens > self.max_model_len:
            raise InvalidField(PROMPT, f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) "
                               f"= {num_prompt + max_tokens} exceeds max_model_len "
                               f"({self.max_model_len})")
        kv = self.kv_cache_manager
        # The last sampled token is never fed back: the cache holds at most num_tokens - 1 (a
        # pooling request's: its whole prompt).
        num_blocks = cdiv(max(num_prompt + max_tokens - 1, num_prompt), kv.block_size)
        if num_blocks > kv.num_blocks:
            raise InvalidField(PROMPT, f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) "
                               f"needs {num_blocks} KV cache blocks of {kv.block_size} tokens; "
                               f"the whole cache has {kv.num_blocks}")
        self.requests[request.request_id] = request
        self.tenants[request.tenant] += 1
        if self.is_short(request):
            self.short_requests[request.request_id] = request
        stats = request.stats  # who is ahead of it, for `explain`
        stats.waiting_ahead, stats.running_ahead = len(self.waiting), len(self.running)
        _, stats.tokens_ahead = self.waiting.ahead(request)
        held, _ = self.kv_blocks_by_tenant()  # a block several requests share counted once
        del held[request.tenant]
        if held:
            stats.top_tenant, blocks = held.most_common(1)[0]
            stats.top_tenant_kv_share = blocks / kv.num_blocks
        self.waiting.add(request)
        if self.config.max_queue_wait is not None:
            heapq.heappush(self.unscheduled, (request.queued_time, id(request), request))

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        self.cut_tokens_scheduled = 0
        self.context_tokens_left = float(self.config.max_num_batched_tokens)
        self.context_charged = False
        now = self.clock()
        if self.shared_with_short():
            self.last_shared = now
        self.waiting.refresh(now, self.step_time.seconds_per_token(
            self.config.max_num_batched_tokens))
        head = self._admissible_head()
        self._displace_for_waiting_head(head, output)
        num_displaced = len(output.preempted)
        # Recorded even if the head misses the step (blocks its decodes took): else a head that
        # keeps missing would keep the others out every step.
        yielding = self.sat_out = self._yielding_tenants(head)
        deferred: list[Request] = []
        short_waiting = self._short_waiting_tenants()
        budget = self._schedule_running(output, head, deferred, yielding, short_waiting)
        num_from_running = len(output.scheduled)
        if len(output.preempted) == num_displaced:  # blocks ran short: admit nobody this step
            budget = self._schedule_waiting(output, budget, yielding)
        short_admitted = {x.request.tenant for x in output.scheduled[num_from_running:]
                          if self._short_arrival(x.request)}
        self._schedule_deferred(output, deferred, budget, short_admitted)
        return output

    def _short_waiting_tenants(self) -> frozenset[str]:
        """Tenants with a short request waiting (not a readmission), while the policy cuts a
        running prompt: such a chunk waits for the step's admissions, and sits the step out if
        another tenant's short prompt is admitted in it (_schedule_deferred)."""
        if not any(is_prefill(r) and self._cut(r) for r in self.running):
            self.cuts_held.clear()
            return frozenset()
        return frozenset(r.tenant for r in self.short_requests.values()
                         if r.status is not RequestStatus.RUNNING and self._short_arrival(r))

    def _short_arrival(self, request: Request) -> bool:
        """A short prompt on its first admission (a readmission recomputes its outputs too, and
        nobody gives way to one)."""
        return self.is_short(request) and not request.num_preemptions

    def _admissible_head(self) -> Request | None:
        """The first waiting request in policy order that its tenant's KV cap lets in: one over
        the cap cannot be admitted this step, so running requests must not yield or defer to it,
        nor be displaced for it. (`treadle sim`, a heavy tenant capped at one long prompt's
        blocks: its capped request at the head kept the light tenants' admission steps carrying
        heavy chunks.)"""
        capped: list[Request] = []
        head = self.waiting.peek()
        while head is not None and self._over_tenant_cap(head):
            if len(capped) >= MAX_LOOKAHEAD:
                head = None
                break
            capped.append(self.waiting.pop())
            head = self.waiting.peek()
        for request in capped:
            self.waiting.restore(request)
        return head

    def _yielding_tenants(self, head: Request | None) -> frozenset[str]:
        """Tenants whose running requests sit out this step, by the policy, for the waiting
        head's admission: only when the head is sure to be admitted (a slot, blocks, its
        adapter, a prefill slot unless its prompt completes in the step, and the step's cut
        where the policy cuts its prompt), so a step never stays empty."""
        if head is None:
            return frozenset()
        # The policy first: the checks below hash the head's prompt, work a step of a policy
        # that never yields (fcfs, priority, deadline) must not do.
        yielding = self.policy.yielding_tenants(head, self.running)
        if not yielding or not self._fits(head):
            return frozenset()
        # A head waiting for its adapter would leave the step empty, and the adapter in use
        # among the yielding requests would never be released.
        if self._over_lora_cap(head) or self._adapter_loading(head):
            return frozenset()
        _, num_hit = self._prefix_hit(head)
        num_left = head.num_tokens - num_hit - min(self._chunk_tokens(head),
                                                    self.config.max_num_batched_tokens)
        num_prefills = sum(1 for r in self.running if uncomputed_tokens(r) > 1)
        if num_left > 1 and num_prefills >= self.config.max_num_partial_prefills:
            return frozenset()
        if self._cut_taken_before(head, yielding):
            return frozenset()
        return yielding

    def _cut_taken_before(self, head: Request, yielding: frozenset[str]) -> bool:
        """The policy cuts the head's prompt, and a running cut prompt outside the `yielding`
        tenants, not deferred behind the head, takes the step's cut first: the head would get
        no tokens this step."""
        return self._cut(head) and any(
            r.tenant not in yielding and is_prefill(r) and self._cut(r)
            and not self.policy.defers_prefill(r, head) for r in self.running)

    def _cut(self, request: Request) -> bool:
        """The policy cuts the request's prompt below the engine's threshold this step."""
        threshold = self.config.long_prefill_token_threshold
        return self.policy.chunk_tokens(request, threshold) < threshold

    def _context_allowance(self, request: Request, context: int) -> int:
        """Where the policy weighs context, the tokens of `request` (more than the threshold
        to compute) from `context` on that the step's weighted budget still takes: each counts
        (b + the chunk's first context) / b, b the context at which a token's attention costs
        its matmuls' FLOPs, so that the step's long prompts together cost about a full budget
        at a prompt's start. The step's first gets at least MIN_CONTEXT_ALLOWANCE; a later one
        gets none rather than less (a sliver is a pass over a deep context for a few tokens).
        Else the token budget."""
        budget = self.config.max_num_batched_tokens
        if not self._weighs_context(request):
            return budget
        b = self.attention_break_even
        tokens = int(self.context_tokens_left / context_weight(context, b))
        if not self.context_charged:
            return max(MIN_CONTEXT_ALLOWANCE, tokens)
        return tokens if tokens >= MIN_CONTEXT_ALLOWANCE else 0

    def _weighs_context(self, request: Request) -> bool:
        return bool(self.attention_break_even and self.policy.weighs_context
                    and request.num_tokens > self.config.long_prefill_token_threshold)

    def _displace_for_waiting_head(self, head: Request | None, output: SchedulerOutput) -> None:
        """Under priority and fair share, the waiting queue's head may take the batch slot and
        blocks of running requests the policy ranks below it (recompute). Before anything is
        scheduled this step, so no victim's blocks were handed out for it. The guard: a request
        displaced max_policy_preemptions times is no longer a victim here; preemptions for
        blocks do not count (`n: 4`'s samples, all preempted for each other's growth, left a
        light request nobody to displace: docs/decisions.md, issue 34)."""
        if head is None or self._fits(head) or self._cut_taken_before(head, frozenset()):
            return  # it fits, or it would get no tokens this step: nobody is preempted for it
        limit = self.config.max_policy_preemptions
        candidates = [r for r in self.running if r.num_displacements < limit]
        victims: list[Request] = []
        while not self._fits(head, victims):
            victim = self.policy.displace(head, candidates)
            if victim is None:
                return  # it would not fit even so: nobody is preempted for nothing
            victims.append(victim)
            candidates.remove(victim)
        for victim in victims:
            victim.num_displacements += 1
            self._preempt(victim, output)

    def _fits(self, request: Request, victims: Sequence[Request] = ()) -> bool:
        """A batch slot is free, and blocks for its whole prompt beside what running prompts
        still need (_prompt_fits); were `victims` preempted first, where given."""
        if len(self.running) - len(victims) >= self.config.max_num_seqs:
            return False
        hit_blocks, num_hit = self._prefix_hit(request)
        if not victims:
            return self._prompt_fits(request, hit_blocks, num_hit, self._prompt_reserve())
        kv = self.kv_cache_manager
        held = Counter(block.block_id for victim in victims
                       for block in kv.block_tables.get(victim.request_id, ()))
        # A block only victims hold goes back to the free list, once; a prefix hit on one then
        # takes it out again.
        freed = sum(1 for block_id, count in held.items()
                    if kv.block_pool.blocks[block_id].ref_cnt == count)
        rehit = sum(1 for block in hit_blocks if held.get(block.block_id) == block.ref_cnt)
        reserve = self._prompt_reserve() - sum(self._blocks_to_finish(v) for v in victims
                                               if is_prefill(v))
        need = kv.num_free_blocks_needed(request, request.num_tokens - num_hit, hit_blocks,
                                         num_hit) + rehit
        return need <= kv.num_free_blocks + freed - reserve

    def _prompt_reserve(self) -> int:
        """The blocks running prompts still need to finish (a recompute's outputs included)."""
        return sum(self._blocks_to_finish(r) for r in self.running if is_prefill(r))

    def _blocks_to_finish(self, request: Request) -> int:
        held = len(self.kv_cache_manager.block_tables.get(request.request_id, ()))
        return max(0, cdiv(request.num_tokens, self.kv_cache_manager.block_size) - held)

    def _prompt_fits(self, request: Request, hit_blocks: list, num_hit: int,
                     reserve: int) -> bool:
        """Admission: the free blocks, less the `reserve` running prompts still need, hold the
        request's whole prompt past its prefix hit. A prompt admitted on its first chunk alone
        ran into the others mid-prefill and was preempted, its chunks computed again. With
        nothing running it fits: add_request checked it fits the whole cache."""
        kv = self.kv_cache_manager
        need = kv.num_free_blocks_needed(request, request.num_tokens - num_hit, hit_blocks,
                                         num_hit)
        return need <= kv.num_free_blocks - reserve

    def _schedule_running(self, output: SchedulerOutput, head: Request | None,
                          deferred: list[Request], yielding: frozenset[str],
                          short_waiting: frozenset[str]) -> int:
        """Running requests first, in the policy's step order: one decode token each, or a
        prefill chunk; none for the `yielding` tenants, nor for a cut prompt once the step's cut
        is spent. A prefill chunk the policy ranks below the waiting queue's head is deferred
        (appended to `deferred`) until waiting requests are admitted.
        When blocks run short, the last in that order (never one scheduled this step) is
        preempted. Returns the token budget left."""
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager
        order = list(self.policy.step_order(self.running))
        i = 0
        while i < len(order) and budget > 0:
            request = order[i]
            if request.tenant in yielding:
                i += 1
                continue
            num_new = uncomputed_tokens(request)
            if num_new > 1:
                num_new = min(num_new, self._chunk_tokens(request), budget)
                if num_new == 0:  # the step's cut or context allowance went before it
                    i += 1
                    continue
            elif request.spec_token_ids:
                scheduled = self._schedule_proposed(request, budget, len(order) - i - 1)
                if scheduled is not None:
                    output.scheduled.append(scheduled)
                    budget -= scheduled.num_new_tokens
                    i += 1
                    continue
            if num_new > 1 and (
                    head is not None and self.policy.defers_prefill(request, head)
                    or short_waiting - {request.tenant} and self._cut(request)
                    and request.request_id not in self.cuts_held):
                deferred.append(request)
                i += 1
                continue
            block_ids = kv.allocate_slots(request, num_new)
            while block_ids is None:
                victim = order.pop()  # the last in the step's order, never one before i
                self._preempt(victim, output)
                if victim is request:
                    break
                block_ids = kv.allocate_slots(request, num_new)
            if block_ids is None:  # it preempted itself: nothing after it is left
                continue
            output.scheduled.append(self._scheduled(request, num_new, block_ids))
            budget -= num_new
            i += 1
        return budget

    def _chunk_tokens(self, request: Request) -> int:
        """The most prompt tokens the request computes this step: the engine's threshold, or
        less where the policy cuts the prompt; the prompts it cuts share one cut's tokens per
        step, so several long prompts do not make the step several cuts long. At most what
        the step's context allowance leaves it."""
        threshold = self.config.long_prefill_token_threshold
        chunk = self.policy.chunk_tokens(request, threshold)
        if chunk < threshold:
            chunk = max(0, chunk - self.cut_tokens_scheduled)
        return min(chunk, self._context_allowance(request, request.num_computed_tokens))

    def _adapter_loading(self, request: Request) -> bool:
        return request.lora_request is not None and not self.adapter_ready(request.lora_request)

    def _over_lora_cap(self, request: Request) -> bool:
        """Whether admitting the request would put more than max_loras distinct LoRA adapters
        among the running requests (so in a step: only running requests are scheduled)."""
        if request.lora_request is None:
            return False
        running = {r.lora_request.lora_int_id for r in self.running
                   if r.lora_request is not None}
        return (request.lora_request.lora_int_id not in running
                and len(running) >= self.config.max_loras)

    def _schedule_proposed(self, request: Request, budget: int,
                           num_running_after: int) -> ScheduledRequest | None:
        """A decoding request's last token and its proposed tokens, as many as the budget takes,
        like a prefill chunk; None (a plain decode instead) when none fit, or when their blocks
        would leave fewer free than one for each running request after it: a guess never costs
        another request its place."""
        drafts = request.spec_token_ids[:budget - 1]
        if not drafts:
            return None
        kv = self.kv_cache_manager
        num_new = 1 + len(drafts)
        if kv.num_free_blocks_needed(request, num_new) > kv.num_free_blocks - num_running_after:
            return None
        block_ids = kv.allocate_slots(request, num_new)
        if block_ids is None:
            return None
        return ScheduledRequest(request, request.num_computed_tokens, num_new, block_ids,
                                produces_token=True, spec_token_ids=drafts)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int,
                          yielding: frozenset[str]) -> int:
        """Then waiting requests, in policy order, while the token budget and batch slots last,
        up to the first of a `yielding` tenant (the step stays short). One that would stay
        mid-prefill while max_num_partial_prefills are, or a cut prompt once the step's cut is
        spent, is passed over; one short of blocks for its whole prompt (beside what running
        prompts still need) is passed over too, so smaller ones behind it may go, until it has
        been passed over MAX_SKIPS times, and those behind it go while the policy lets them
        take the blocks (may_pass: the first it refuses ends the admissions). Returns the token
        budget left."""
        kv = self.kv_cache_manager
        # Requests still mid-prefill after this step's chunks.
        chunks = {x.request.request_id: x.num_new_tokens for x in output.scheduled}
        num_prefills = sum(1 for r in self.running
                           if uncomputed_tokens(r) - chunks.get(r.request_id, 0) > 1)
        reserve = self._prompt_reserve()
        passed_over: list[Request] = []
        first_passed: Request | None = None  # the first passed over, short of blocks
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request is None:
                break
            if self._over_tenant_cap(request):  # a tenant's own cap must not hold up the others
                if len(passed_over) >= MAX_LOOKAHEAD:
                    break
                passed_over.append(self.waiting.pop())
                continue
            if request.tenant in yielding:
                break
            if first_passed is not None and not self.policy.may_pass(request, first_passed):
                break
            over_lora_cap = self._over_lora_cap(request)  # waits for an adapter's requests to end
            if over_lora_cap or self._adapter_loading(request):
                if len(passed_over) >= MAX_LOOKAHEAD:
                    break
                request.stats.lora_cap_steps += over_lora_cap
                passed_over.append(self.waiting.pop())
                continue
            chunk = self._chunk_tokens(request)
            if chunk == 0:  # the step's cut or context allowance is spent (before hashing)
                if len(passed_over) >= MAX_LOOKAHEAD:
                    break
                passed_over.append(self.waiting.pop())
                continue
            hit_blocks, num_hit = self._prefix_hit(request)
            # The allowance from its cached prefix's end, not from 0.
            num_new = min(request.num_tokens - num_hit, chunk, budget,
                          self._context_allowance(request, num_hit))
            if num_new == 0:
                if len(passed_over) >= MAX_LOOKAHEAD:
                    break
                passed_over.append(self.waiting.pop())
                continue
            if request.num_tokens - num_hit - num_new > 1 and \
                    num_prefills >= self.config.max_num_partial_prefills:
                # It would stay mid-prefill and every prefill slot is taken: pass it over, so a
                # prompt that completes in this step (a short or high-priority one) still goes.
                if len(passed_over) >= MAX_LOOKAHEAD:
                    break
                passed_over.append(self.waiting.pop())
                continue
            block_ids = None
            if self._prompt_fits(request, hit_blocks, num_hit, reserve):
                block_ids = kv.allocate_slots(request, num_new, hit_blocks, num_hit)
            if block_ids is None:
                request.num_skips += 1
                if request.num_skips >= MAX_SKIPS:
                    break
                if len(passed_over) >= MAX_LOOKAHEAD:
                    break
                first_passed = first_passed or request
                passed_over.append(self.waiting.pop())
                continue
            self.waiting.pop()
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
                self.policy.on_admitted(request)
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            insort(self.running, request, key=self.policy.sort_key)
            output.scheduled.append(self._scheduled(request, num_new, block_ids))
            budget -= num_new
            num_prefills += uncomputed_tokens(request) - num_new > 1
            reserve += self._blocks_to_finish(request)
        for request in passed_over:
            self.waiting.restore(request)
        return budget

    def _schedule_deferred(self, output: SchedulerOutput, deferred: list[Request],
                           budget: int, short_admitted: set[str]) -> None:
        """Deferred prefill chunks, in step order, from the budget admission left; one short
        of blocks waits for the next step (no preemption for a chunk that yielded). A cut
        prompt's chunk sits out a step that admits another tenant's short prompt: that prompt's
        first token waits for this step alone, not for a chunk deep into a long context."""
        held = set()
        for request in deferred:
            if budget <= 0:
                break
            if short_admitted - {request.tenant} and self._cut(request) and \
                    request.request_id not in self.cuts_held:
                held.add(request.request_id)
                continue
            num_new = min(uncomputed_tokens(request), self._chunk_tokens(request), budget)
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new) if num_new else None
            if block_ids is None:
                continue
            output.scheduled.append(self._scheduled(request, num_new, block_ids))
            budget -= num_new
        # A held prompt stays exempt until it has had a chunk (another cut prompt may take the
        # step's cut first).
        scheduled = {x.request.request_id for x in output.scheduled}
        self.cuts_held = held | {rid for rid in self.cuts_held
                                 if rid not in scheduled and rid in self.requests}

    def _prefix_hit(self, request: Request) -> tuple[list, int]:
        # Prompt logprobs need logits at every prompt position, mean pooling hidden states at
        # every one: no cached prefix. (Last pooling needs only the last, always computed.)
        if request.sampling_params.prompt_logprobs is not None or request.pooling == "mean":
            return [], 0
        return self.kv_cache_manager.get_computed_blocks(request)

    def _over_tenant_cap(self, request: Request) -> bool:
        """Admitting it would take its tenant past its KV cap (the policy's tenant_kv_cap):
        exceeds_cap. A prompt mid-prefill counts whole (with its chunks counted as held, a second
        long prompt was admitted beside the first and both held the prefill slots); a prefix its
        running requests hold counts once (counted per request, `n: 4`'s samples sharing a 4k
        prompt made a heavy tenant four times over its share). Decode growth after admission is
        not capped. A tenant holding nothing is never over, or a request larger than the cap
        could never run."""
        cap = self.policy.tenant_kv_cap(request.tenant)
        if cap is None:
            return False
        return self.committed_blocks(request.tenant) > 0 and self.exceeds_cap(request, cap)

    def update_from_output(self, output: SchedulerOutput, sampled: Mapping[str, int],
                           accepted: Mapping[str, Sequence[int]] | None = None
                           ) -> list[Request]:
        """Advance the step's requests; `sampled` holds a token for each one that
        `produces_token`; `accepted`, for each that checked proposed tokens, those accepted
        (which come before its sampled token). A pooling request finishes when its prompt is
        computed. Returns the requests that finished, their blocks already freed."""
        finished = []
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.is_finished:  # aborted while the step ran
                continue
            if scheduled.spec_token_ids:
                assert accepted is not None
                if self._accept(scheduled, accepted[request.request_id],
                                sampled[request.request_id]):
                    finished.append(request)
                continue
            request.num_computed_tokens += scheduled.num_new_tokens
            if request.pooling and request.num_computed_tokens == request.num_tokens:
                self._end(request, RequestStatus.FINISHED_STOPPED)
                finished.append(request)
            if not scheduled.produces_token:
                continue
            token = sampled[request.request_id]
            request.append_output_token(token)
            self.policy.on_tokens_generated(request, 1)
            status = self._stop_status(request, token)
            if status is not None:
                self._end(request, status)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return finished

    def _accept(self, scheduled: ScheduledRequest, accepted: Sequence[int], token: int) -> bool:
        """Append a speculating request's accepted tokens and sampled token, stopping at the
        first that ends it (a stop token, max_tokens); its KV stays for its last token and the
        accepted ones, the rest rolled back. True when it finished."""
        request = scheduled.request
        num_appended, status = 0, None
        for new in (*accepted, token):
            request.append_output_token(new)
            num_appended += 1
            status = self._stop_status(request, new)
            if status is not None:
                break
        self.policy.on_tokens_generated(request, num_appended)
        if status is not None:
            self._end(request, status)
            return True
        request.num_computed_tokens += 1 + len(accepted)
        self.kv_cache_manager.roll_back_proposed(request, scheduled.num_computed_tokens)
        return False

    def expire_waiting(self, now: float) -> list[Request]:
        """End with FINISHED_QUEUE_TIMEOUT each request never scheduled max_queue_wait seconds
        after it reached the engine (its queued_time); returns them."""
        expired = []
        while self.unscheduled:
            queued, _, request = self.unscheduled[0]
            never_scheduled = request.status is RequestStatus.WAITING
            if never_scheduled and now - queued < self.config.max_queue_wait:
                break
            heapq.heappop(self.unscheduled)
            if never_scheduled:
                self.finish_request(request.request_id, RequestStatus.FINISHED_QUEUE_TIMEOUT)
                expired.append(request)
        self.num_queue_timeouts += len(expired)
        return expired

    def refusal(self, request: Request) -> str | None:
        """Why the policy refuses `request` (not queued), arriving now; None: queue it."""
        return self.policy.refuse(request, self)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request in any state, freeing its blocks. Returns it, or None when it has
        already ended (or never existed): a request ends exactly once."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._end(request, status)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _scheduled(self, request: Request, num_new: int, block_ids: list[int]) -> ScheduledRequest:
        """The request's share of the step; a chunk of a prompt the policy cuts counts against
        the step's cut (_chunk_tokens)."""
        start = request.num_computed_tokens
        if is_prefill(request) and self._cut(request):
            self.cut_tokens_scheduled += num_new
        if is_prefill(request) and self._weighs_context(request):
            b = self.attention_break_even
            self.context_tokens_left -= num_new * context_weight(start, b)
            self.context_charged = True
        return ScheduledRequest(request, start, num_new, block_ids,
                                produces_token=start + num_new == request.num_tokens
                                and not request.pooling)

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        """Preempt by recompute: drop its KV; it re-prefills prompt and outputs when readmitted,
        from the prefix cache where its blocks survive."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.preempt(time.monotonic())
        self.num_preemptions += 1
        self.waiting.add(request)
        output.preempted.append(request)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if (is_eos or token in params.stop_token_ids) and \
                request.num_output_tokens >= params.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        # add_request checked prompt + max_tokens <= max_model_len: max_tokens is the only cap.
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def is_short(self, request: Request) -> bool:
        """A prompt of one chunk (at most the long-prefill threshold)."""
        return request.num_prompt_tokens <= self.config.long_prefill_token_threshold

    def _end(self, request: Request, status: RequestStatus) -> None:
        del self.requests[request.request_id]
        self.short_requests.pop(request.request_id, None)
        self.tenants[request.tenant] -= 1
        if not self.tenants[request.tenant]:
            del self.tenants[request.tenant]
        self.kv_cache_manager.free(request)
        request.status = status

    def check_invariants(self) -> None:
        """Raise AssertionError unless queues, request states and the KV cache agree."""
        self.kv_cache_manager.check_invariants()
        self.waiting.check_invariants()
        assert self.tenants == Counter(r.tenant for r in self.requests.values()), "tenant counts"
        if self._held_blocks[0] == (self.kv_cache_manager.block_pool.version, len(self.running)):
            assert self._held_blocks[1] == self.kv_blocks_by_tenant()[0], "stale blocks by tenant"
        assert self.running == sorted(self.running, key=self.policy.sort_key), \
            "running list out of order"
        waiting = list(self.waiting)
        assert len(waiting) == len(self.waiting)
        waiting_ids = [r.request_id for r in waiting]
        running_ids = [r.request_id for r in self.running]
        assert sorted(waiting_ids + running_ids) == sorted(self.requests), "queues != requests"
        assert len(self.running) <= self.config.max_num_seqs
        assert sum(1 for r in self.running if is_prefill(r)) <= \
            self.config.max_num_partial_prefills, "too many requests mid-prefill"
        for request in waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
            assert request.num_computed_tokens == 0, request
        for request in self.running:
            assert request.status is RequestStatus.RUNNING, request
            assert 0 < request.num_computed_tokens < request.num_tokens, request
        tables = self.kv_cache_manager.block_tables
        assert tables.keys() == set(running_ids), "block tables != running requests"
        block_size = self.kv_cache_manager.block_size
        for request in self.running:
            assert len(tables[request.request_id]) == cdiv(request.num_computed_tokens,
                                                           block_size), request

