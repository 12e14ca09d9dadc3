"""Deadlines: earliest TTFT deadline first, lost causes to a late lane, and admission that
refuses at once a request whose TTFT or TPOT objective the fitted step time puts out of reach."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from treadle.core.request import Request
from treadle.core.sched.policy import (
    KeyedQueue,
    SchedulerView,
    SchedulingPolicy,
    WaitingQueue,
    is_prefill,
    register_policy,
    uncomputed_tokens,
)
from treadle.core.sched.step_time import predict_tpot, predict_ttft

# Deadline classes: a TTFT objective (earliest deadline first), only a TPOT objective, none.
WITH_TTFT, WITH_TPOT, NO_OBJECTIVE = 0, 1, 2


@register_policy
class DeadlinePolicy(SchedulingPolicy):
    """Earliest TTFT deadline (arrival + ttft) first; then requests with only a TPOT objective,
    then requests without objectives, each in arrival order. Slack: a waiting request that has
    not produced its first token and can no longer meet its deadline (deadline - now < its
    uncomputed tokens times the fitted seconds per token of a full step) moves to a late lane
    behind all the others, so a lost cause does not push the next request past its deadline
    too. Running requests without objectives are preempted first."""

    name = "deadline"
    summary = "earliest deadline first, refusing TTFTs it cannot meet with 429"

    def sort_key(self, request: Request) -> tuple:
        if request.ttft is not None:
            return (WITH_TTFT, request.arrival_time + request.ttft, request.arrival_time)
        cls = WITH_TPOT if request.tpot is not None else NO_OBJECTIVE
        return (cls, request.arrival_time, request.arrival_time)

    def new_queue(self) -> WaitingQueue:
        return DeadlineQueue(self.sort_key)

    def refuse(self, request: Request, scheduler: SchedulerView) -> str | None:
        """Why `request` (its ttft and tpot set), arriving now, could not meet an objective given
        the requests ahead of it and the fitted step time; None when it can, or when no step
        has been measured yet: refused at once rather than served late.

        TTFT: the prefill work ahead of it (running prefills, waiting requests the policy puts
        first) and its prompt, in steps that also carry the running decodes. TPOT: one step
        once it decodes: the running requests, the waiting ones ahead of it and itself, at
        most max_num_seqs, each a decode token, beside the prefill work ahead of it, within the
        token budget. Requests behind it and arrivals to come are left out: a lower bound on
        the load, so a refusal is never for work that may not come."""
        fit = scheduler.step_time.fit
        if fit is None or (request.ttft is None and request.tpot is None):
            return None
        config, running = scheduler.config, scheduler.running
        budget = config.max_num_batched_tokens
        num_waiting_ahead, waiting_tokens_ahead = scheduler.waiting.ahead(request)
        running_prefill = sum(uncomputed_tokens(r) - 1 for r in running if is_prefill(r))
        num_decoding = sum(1 for r in running if not is_prefill(r))
        ahead = waiting_tokens_ahead + running_prefill
        # Nothing goes before it: refusing cannot serve it sooner. (Else an estimate made
        # pessimistic by small steps refused every request, and with no step running it never
        # improved.)
        if request.ttft is not None and ahead > 0:
            ttft = predict_ttft(ahead, request.num_tokens, num_decoding, budget, fit)
            if ttft > request.ttft:
                return (f"the TTFT objective of {request.ttft * 1e3:g} ms cannot be met: "
                        f"predicted {ttft * 1e3:.0f} ms given the {ahead} tokens queued ahead; "
                        f"retry later")
        num_sharing = min(config.max_num_seqs, len(running) + num_waiting_ahead + 1)
        # Alone, it decodes as fast as this engine can: the same rule as above. It must not
        # break a running request's TPOT either: each one it joins decodes in the same steps.
        limits = [r.tpot for r in running if r.tpot is not None]
        if request.tpot is not None:
            limits.append(request.tpot)
        if limits and num_sharing > 1:
            # The steps it would decode in carry what steps carry now (under overload, the
            # chunks of requests still arriving) plus its own token: without the recent steps
            # the prediction left arrivals out, and admitted requests missed their TPOT.
            recent = scheduler.step_time.recent_step_seconds
            tpot = max(predict_tpot(num_sharing, ahead, budget, fit),
                       0.0 if recent is None else recent + fit.per_token)
            if tpot > min(limits):
                whose = "the" if request.tpot == min(limits) else "a running request's"
                return (f"{whose} TPOT objective of {min(limits) * 1e3:g} ms cannot be met: "
                        f"predicted {tpot * 1e3:.1f} ms per token with {num_sharing} requests "
                        f"decoding; retry later")
        return None


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
