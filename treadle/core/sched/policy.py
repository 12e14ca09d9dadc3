"""Queue policies: the base class every policy derives from, their registry, and the queues.

A policy is one module (fcfs.py, priority.py, fair.py, deadline.py here, or a plugin's own)
holding its `SchedulingPolicy` subclass, registered by name with `@register_policy`, and its
settings section when it has one (a frozen dataclass of `treadle.config.setting`s; their flags,
variables and config-file keys follow). `make_policy` builds one per scheduler (fair share keeps
counters, so one policy object serves one scheduler). It answers:

- `sort_key(request)`: a key fixed when the request is queued. It orders the running list (and
  so the default step order) and, within a lane, the waiting queue.
- `new_queue()`: the waiting queue, which may order lanes by keys that change as the engine runs
  (fair share: per-tenant service counters; deadline: slack, from the clock and the measured
  step time).
- `refuse(request, scheduler)`: admission: why a request arriving now is refused at once (the
  frontend's 429, its reason the policy's name), or None; the engine process and the simulator
  ask it of every request before queueing it (deadline: an objective out of reach).
- `step_order(running)`: the order running requests get tokens in a step (fair share: least
  served tenant first, a tenant over its share of the cache after the others); when one is
  short of blocks, the last not yet scheduled is preempted.
- `displace(head, candidates)`: whether the waiting queue's head may take a running request's
  blocks and batch slot (priority, fair share), and whose.
- `defers_prefill(running, head)`: whether a running request's prefill chunk waits, within a
  step, until the waiting queue's head has been admitted (priority, fair share), so a long
  prompt's remaining chunks do not take the token budget ahead of a better-ranked newcomer.
- `may_pass(request, passed)`: whether a waiting request may take the blocks that one ahead of
  it lacked (fair share: while it stays within that tenant's service plus its prompt's charge).
- `yielding_tenants(head, running)`: tenants whose running requests sit out a step that admits
  the waiting queue's head (fair share), so a light tenant's first token waits for one short
  step, not for a full batch of the heavy tenant's decodes and chunks.
- `tenant_kv_cap(tenant)`: the KV blocks a tenant may hold when another of its requests is
  admitted (max_kv_blocks_per_tenant; fair share derives one from the tenants present).
- `chunk_tokens(request, threshold)`: the most prompt tokens a request computes in one step
  (fair share cuts long prompts while several tenants are present, to keep the steps short);
  the prompts a policy cuts below the threshold share that many tokens per step.
- `on_admitted` / `on_tokens_generated`: service accounting (fair share).

How schedule() stays O(log n) per step at n waiting requests: no key that changes is ever
stored in a sorted list. Static keys live in binary heaps (O(log n) add and pop; removal marks
the entry, dropped when it surfaces). Fair share keeps one heap per tenant in arrival order and a
heap of backlogged tenants by counter; a counter only grows, so an entry whose counter went
stale is re-pushed when it surfaces (O(log T) per counter change, T tenants). Deadline keeps
EDF heaps; slack only decides, at the head, whether a request moves to the late lane, once. The
scheduler pops what it admits (O(log n) each), and passes over at most MAX_LOOKAHEAD requests
that do not fit per step. The running list (at most max_num_seqs) is walked in full each step
anyway, so ordering it for the step (fair share: a sort, O(m log m) at m = max_num_seqs) adds
little. Measured by
tests/test_policies.py (printed): schedule() takes about the same time at 10,000 waiting as at
1,000, under every policy. Admission under deadlines (`ahead`) is O(n), once per new request,
not per step.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from treadle import config
from treadle.config import SchedulerConfig
from treadle.core.request import Request
from treadle.core.sched.step_time import StepTimeModel


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


class SchedulerView(Protocol):
    """What a policy's admission hook reads of its scheduler (treadle/core/sched/scheduler.py's
    Scheduler, which imports this module)."""

    config: SchedulerConfig
    waiting: WaitingQueue
    running: list[Request]
    step_time: StepTimeModel
    tenants: Counter[str]  # unfinished requests (waiting or running) per tenant
    clock: Callable[[], float]  # seconds, on the clock of requests' arrival times
    last_shared: float  # the clock at the last step begun with several tenants', a short one
    sat_out: frozenset[str]  # tenants whose running requests sat out the last step for a head
    attention_break_even: int  # the model's; 0: context is not weighed

    @property
    def num_blocks(self) -> int: ...  # the KV cache's blocks
    @property
    def block_size(self) -> int: ...
    def committed_blocks(self, tenant: str) -> int: ...  # its running requests' blocks, each once
    def exceeds_cap(self, request: Request, cap: int) -> bool: ...  # admitting it: past `cap`
    def decode_growth(self) -> Counter[str]: ...  # by tenant, blocks its decodes take this step
    def shared_with_short(self) -> bool: ...  # several tenants' requests, a one-chunk prompt
    def is_short(self, request: Request) -> bool: ...  # a prompt of one chunk


def uncomputed_tokens(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


def context_weight(context: int, break_even: int) -> float:
    """What a token at `context` counts for where context is weighed: (b + context) / b, b the
    model's attention_break_even; 1 where b is 0 (context not weighed)."""
    return (break_even + context) / break_even if break_even else 1.0


def is_prefill(request: Request) -> bool:
    """More than the last token left to compute: a prompt, or a recompute after preemption."""
    return uncomputed_tokens(request) > 1


class KeyedQueue:
    """Requests in order of a static key: a binary heap with lazy removal. Equal keys leave in
    the order they came."""

    def __init__(self, key: Callable[[Request], tuple]) -> None:
        self.key = key
        # [key, sequence number, request or None once removed, its uncomputed tokens]
        self.heap: list[list] = []
        self.entries: dict[str, list] = {}
        self.counter = itertools.count()
        # What `ahead` reads at every arrival, kept as requests come and go (a queued request's
        # tokens do not change): a scan of every entry at each arrival was quadratic in overload.
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
    first, nobody refused, no running request is displaced, no accounting.

    A subclass sets `name` (its `--policy` value), `summary` (its part of --policy's help) and,
    when it has settings, `settings_class`; `from_config` builds it from the scheduler's config
    and its settings section."""

    name: ClassVar[str] = "base"
    summary: ClassVar[str] = ""
    settings_class: ClassVar[type | None] = None
    # Whether long prompts' chunks share the step's token budget weighted by their context
    # (the scheduler's `_context_allowance`), so that no step costs much more than a full
    # budget of prompt tokens at a prompt's start.
    weighs_context: ClassVar[bool] = False
    scheduler: SchedulerView | None = None  # set by bind(): the scheduler it serves

    def bind(self, scheduler: SchedulerView) -> None:
        """Called once by the scheduler this policy serves: hooks may read its state."""
        self.scheduler = scheduler

    def tenant_kv_cap(self, tenant: str) -> int | None:
        """KV blocks `tenant`'s running requests may hold when another of its requests is
        admitted (None: no cap): max_kv_blocks_per_tenant unless a policy derives one."""
        return None if self.scheduler is None else self.scheduler.config.max_kv_blocks_per_tenant

    @classmethod
    def from_config(cls, config: SchedulerConfig, settings: Any) -> SchedulingPolicy:
        """`settings`: an instance of `settings_class` (None when it has none)."""
        return cls()

    def sort_key(self, request: Request) -> tuple:
        return (request.arrival_time,)

    def new_queue(self) -> WaitingQueue:
        return KeyedQueue(self.sort_key)

    def refuse(self, request: Request, scheduler: SchedulerView) -> str | None:
        """Why `request` (not queued), arriving now, is refused at once; None: queue it."""
        return None

    def step_order(self, running: Sequence[Request]) -> list[Request]:
        """The order running requests get their tokens in a step; when blocks run short, the
        last not yet scheduled is preempted, so the order alone decides who goes on (a victim
        chosen by another rule than the order let two requests take each other's blocks back
        and forth). A new list of every running request once; the default: the running list's,
        by sort_key."""
        return list(running)

    def displace(self, head: Request, candidates: Sequence[Request]) -> Request | None:
        """A running request the waiting `head` may preempt when blocks or batch slots keep it
        out; `candidates` (running, in order) are those the preemption guard allows."""
        return None

    def defers_prefill(self, running: Request, head: Request) -> bool:
        """Whether `running`'s prefill chunk goes after the waiting `head`'s admission."""
        return False

    def may_pass(self, request: Request, passed: Request) -> bool:
        """Whether waiting `request` may take blocks in a step that passed over `passed`, ahead
        of it in the queue, short of blocks; False ends the step's admissions (the queue is in
        the order the policy would let them pass)."""
        return True

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


# Every policy class by name, as registered (the package's own: treadle/core/sched/__init__.py).
POLICIES: dict[str, type[SchedulingPolicy]] = {}

Policy = TypeVar("Policy", bound=type[SchedulingPolicy])


def register_policy(cls: Policy) -> Policy:
    """Class decorator: `cls` becomes `--policy cls.name`, its settings section settings of
    every config built from now on (treadle/config.py keeps those, below this package)."""
    config.register_policy(cls.name, cls.summary, cls.settings_class)
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, scheduler_config: SchedulerConfig | None = None,
                settings: Any = None) -> SchedulingPolicy:
    """The policy called `name`, from the scheduler's config and its settings section (None:
    its defaults)."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    cls = POLICIES[name]
    if settings is None and cls.settings_class is not None:
        settings = cls.settings_class()
    return cls.from_config(scheduler_config or SchedulerConfig(), settings)
