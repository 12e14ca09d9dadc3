"""A fake model to drive the scheduler without torch, and a step loop that checks every step.

The fake model keeps a paged "KV cache" of (position, token id) per slot. Each step it writes the
scheduled tokens through the block tables, then reads every sequence's whole context back through
its table and checks it against the request's tokens: a wrong block table, a stale prefix hit or a
block reused while still held fails there. The next token depends only on the token history, so
a request's output is the same however it was batched, chunked, preempted or cached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from treadle.config import EngineConfig, build_config
from treadle.core.kv_cache import KVCacheManager
from treadle.core.request import Request
from treadle.core.sampling_params import SamplingParams
from treadle.core.sched.policy import SchedulingPolicy, make_policy
from treadle.core.sched.scheduler import Scheduler, SchedulerOutput

VOCAB = 32
EOS = 0


def next_token(history: list[int]) -> int:
    """A deterministic stand-in for greedy decoding; EOS now and then."""
    value = len(history)
    for token in history[-3:]:
        value = (value * 2654435761 + token) % 1000003
    return value % VOCAB


def reference_output(prompt: list[int], params: SamplingParams,
                     eos_token_ids: frozenset[int] = frozenset({EOS})) -> list[int]:
    """What the scheduler must produce for a request run to its end."""
    tokens = list(prompt)
    while True:
        token = next_token(tokens)
        tokens.append(token)
        num_out = len(tokens) - len(prompt)
        stop = token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos)
        if (stop and num_out >= params.min_tokens) or num_out >= params.max_tokens:
            return tokens[len(prompt):]


class FakeModel:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)

    def slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        # Every new token's KV is written before any is read, as the runner does in each layer.
        for s in output.scheduled:
            for pos, token in enumerate(s.token_ids, start=s.num_computed_tokens):
                self.slots[self.slot(s.block_ids, pos)] = (pos, token)
        sampled = {}
        for s in output.scheduled:
            end = s.num_computed_tokens + s.num_new_tokens
            context = [self.slots[self.slot(s.block_ids, pos)] for pos in range(end)]
            expected = list(enumerate(s.request.all_token_ids[:end]))
            assert context == expected, f"{s.request} read a wrong KV cache"
            if s.produces_token:
                sampled[s.request.request_id] = next_token([token for _, token in expected])
        return sampled


def make_scheduler(num_blocks: int, block_size: int, *, max_num_batched_tokens: int = 512,
                   max_num_seqs: int = 128, long_prefill_token_threshold: int = 256,
                   policy: str | SchedulingPolicy = "fcfs", max_model_len: int = 4096,
                   enable_prefix_caching: bool = True, clock: Callable[[], float] | None = None,
                   **config: Any) -> Scheduler:
    """A scheduler over a fresh cache; `policy` by name or object, `config` more settings of
    the scheduler or the policies, by name. The default clock reads 0.0: arrival times in tests
    are small."""
    engine = build_config(EngineConfig, dict(
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=long_prefill_token_threshold,
        **({"policy": policy} if isinstance(policy, str) else {}), **config))
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    if isinstance(policy, str):
        policy = make_policy(policy, engine.scheduler, engine.policy_settings)
    return Scheduler(engine.scheduler, kv, policy, max_model_len, eos_token_ids=[EOS],
                     clock=clock or (lambda: 0.0))


def model_for(scheduler: Scheduler) -> FakeModel:
    kv = scheduler.kv_cache_manager
    return FakeModel(kv.num_blocks, kv.block_size)


def step(scheduler: Scheduler, model: FakeModel) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step, checking the step's limits and every invariant after it."""
    output = scheduler.schedule()
    config = scheduler.config
    ids = [s.request.request_id for s in output.scheduled]
    assert len(ids) == len(set(ids)), f"a request scheduled twice: {ids}"
    assert len(ids) <= config.max_num_seqs
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    for s in output.scheduled:
        assert 1 <= s.num_new_tokens <= config.long_prefill_token_threshold
        assert s.num_computed_tokens + s.num_new_tokens <= s.request.num_tokens
    finished = scheduler.update_from_output(output, model.execute(output))
    scheduler.check_invariants()
    return output, finished


def run_until_done(scheduler: Scheduler, model: FakeModel | None = None,
                   max_steps: int = 10_000) -> list[Request]:
    """Step until every request has ended; returns those that finished, in order."""
    model = model or model_for(scheduler)
    finished: list[Request] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished
        finished += step(scheduler, model)[1]
    raise AssertionError(f"not done after {max_steps} steps")
