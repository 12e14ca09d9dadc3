"""Queue orderings for the scheduler, each a small object with one method: `sort_key`.

The scheduler keeps both its waiting queue and its running list sorted by the key. Admission walks
the waiting queue from the front; preemption takes its victims from the back of the running list,
so the victim is the running request that sorts last, and it is never one already scheduled this
step (those sort before the request asking for blocks).
"""

from __future__ import annotations

from typing import Protocol

from treadle.engine.request import Request


class SchedulingPolicy(Protocol):
    def sort_key(self, request: Request) -> tuple[float, ...]: ...


class FCFSPolicy:
    """First come, first served: the newest running request is preempted first."""

    def sort_key(self, request: Request) -> tuple[float, ...]:
        return (request.arrival_time,)


class PriorityPolicy:
    """Lower priority value first, then arrival; preempts the lowest priority, newest first."""

    def sort_key(self, request: Request) -> tuple[float, ...]:
        return (request.priority, request.arrival_time)
