"""Which replica takes an arriving request: round robin, least outstanding tokens (prompt +
output tokens of its unfinished requests), or prefix affinity (the prompt's first block decides,
so requests sharing a system prompt meet the same prefix cache)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from treadle.sim.replica import SimReplica
from treadle.sim.workload import SimRequest


class Router:
    def __init__(self, kind: str, block_size: int) -> None:
        self.kind = kind
        self.block_size = block_size
        self.next = 0

    def route(self, request: SimRequest, replicas: Sequence[SimReplica]) -> int:
        n = len(replicas)
        if n == 1:
            return 0
        if self.kind == "least-load":
            return min(range(n), key=lambda i: (replicas[i].outstanding_tokens, i))
        if self.kind == "prefix" and request.prompt_len >= self.block_size:
            head = request.prompt_token_ids[:self.block_size]
            return zlib.crc32(repr(head).encode()) % n
        choice = self.next
        self.next = (self.next + 1) % n
        return choice
