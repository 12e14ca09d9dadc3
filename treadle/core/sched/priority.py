"""Priority: each request's `priority` field, lower first, preempting worse-ranked requests."""

from __future__ import annotations

from collections.abc import Sequence

from treadle.core.request import Request
from treadle.core.sched.policy import SchedulingPolicy, register_policy


@register_policy
class PriorityPolicy(SchedulingPolicy):
    """Lower priority value first, then arrival. A waiting request of strictly better priority
    takes the place of the worst running one (recompute), as vLLM's priority scheduling."""

    name = "priority"
    summary = "each request's `priority` field, lower first, may preempt"

    def sort_key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)

    def displace(self, head: Request, candidates: Sequence[Request]) -> Request | None:
        if candidates and candidates[-1].priority > head.priority:
            return candidates[-1]
        return None

    def defers_prefill(self, running: Request, head: Request) -> bool:
        return running.priority > head.priority
