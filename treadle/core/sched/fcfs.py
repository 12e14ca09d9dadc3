"""First come, first served: the waiting queue and the running list in arrival order."""

from __future__ import annotations

from treadle.core.sched.policy import SchedulingPolicy, register_policy


@register_policy
class FCFSPolicy(SchedulingPolicy):
    """First come, first served: the newest running request is preempted first."""

    name = "fcfs"
