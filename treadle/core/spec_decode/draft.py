"""The `draft_model` proposer: a second, smaller model sharing the target's tokenizer guesses the
next tokens greedily, run by the same runner code in the engine process over a KV cache of its
own.

Each request's draft state is the tokens whose keys and values its blocks hold. A proposal
first runs what the draft has not seen (the prompt once, then the tokens accepted and drawn
since its last proposal: rejected guesses' positions are written again), then one decode pass
per further guess, each the argmax (a guess is a fixed proposal: the rejection rule keeps the
target's distribution whatever it is). The blocks hold disable_by_batch_size requests at the
longest context; a request that needs blocks takes them from the least recently proposed
others (requests that finished, were aborted or stopped speculating).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from treadle.config import CacheConfig, ModelConfig, SpeculativeConfig
from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.capabilities import torch_dtype
from treadle.model.loader import load_model
from treadle.model.runner import ModelRunner

# New tokens up to this many run as decode rows (the fused decoder), more as a prefill chunk.
CATCH_UP_ROWS = 8


@dataclass(frozen=True)
class TargetModel:
    """What a draft model must match of the model it proposes for."""

    config: ModelConfig
    max_model_len: int
    vocab_size: int
    block_size: int


@dataclass
class DraftState:
    tokens: list[int] = field(default_factory=list)  # whose KV the blocks hold, in order
    blocks: list[int] = field(default_factory=list)


class DraftProposer:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.free_blocks = list(range(runner.num_blocks))
        self.states: dict[str, DraftState] = {}  # least recently proposed first

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: TargetModel) -> DraftProposer:
        """The draft model `config.model` in the target's dtype, with blocks for
        disable_by_batch_size requests at the target's longest context plus the guesses;
        ValueError where its vocabulary is not the target's."""
        model_config = ModelConfig(model=config.model, dtype=target.config.dtype,
                                   quantization=config.quantization, device="cpu",
                                   max_model_len=target.max_model_len)
        loaded = load_model(config.model, torch_dtype(target.config.dtype, "cpu"),
                            config.quantization, device="cpu")
        if loaded.spec.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary "
                             f"({loaded.spec.vocab_size} tokens) is not the target's "
                             f"({target.vocab_size}): they must share the tokenizer")
        positions = target.max_model_len + config.num_speculative_tokens
        blocks_per_request = -(-positions // target.block_size)
        runner = ModelRunner(loaded, model_config, CacheConfig(
            block_size=target.block_size,
            num_blocks=config.disable_by_batch_size * blocks_per_request))
        return cls(runner)

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        state = self.states.pop(request_id, None) or DraftState()
        self.states[request_id] = state  # now the most recently proposed
        seen = 0  # tokens whose KV the draft holds; the last always runs: its logits guess
        limit = min(len(state.tokens), len(token_ids) - 1)
        while seen < limit and state.tokens[seen] == token_ids[seen]:
            seen += 1
        positions = len(token_ids) + max_tokens - 1
        if not self.reserve(request_id, state, -(-positions // self.block_size)):
            return []
        guesses: list[int] = []
        new, start = list(token_ids[seen:]), seen
        for _ in range(max_tokens):
            logits = self.runner.execute(ModelInput([ScheduledSequence(
                new, start, state.blocks, decode_rows=1 < len(new) <= CATCH_UP_ROWS)]))
            guesses.append(int(torch.argmax(logits[-1])))
            start += len(new)
            new = guesses[-1:]
        state.tokens = [*token_ids, *guesses[:-1]]
        return guesses

    def reserve(self, request_id: str, state: DraftState, blocks: int) -> bool:
        """`blocks` blocks for `state`, freeing other requests' states, least recently proposed
        first, while there are too few; False where the cache cannot hold them at all."""
        for other in list(self.states):
            if len(state.blocks) + len(self.free_blocks) >= blocks:
                break
            if other != request_id:
                self.free_blocks += self.states.pop(other).blocks
        while len(state.blocks) < blocks and self.free_blocks:
            state.blocks.append(self.free_blocks.pop())
        return len(state.blocks) >= blocks

    def finished(self, request_id: str, token_ids: Sequence[int]) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.free_blocks += state.blocks
