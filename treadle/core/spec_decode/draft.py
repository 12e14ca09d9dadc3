"""The `draft_model` proposer: a second, smaller model sharing the target's tokenizer guesses the
next tokens greedily, run by the same runner code in the engine process over a KV cache of its
own.

Each request's draft state is the tokens whose keys and values its blocks hold. A proposal
first runs what the draft has not seen (a prompt in chunks of CATCH_UP_CHUNK, one a step, with
no guesses until it is seen; then the tokens accepted and drawn since its last proposal:
rejected guesses' positions are written again), then one decode pass per further guess, each
the argmax (a guess is a fixed proposal: the rejection rule keeps the target's distribution
whatever it is). The blocks hold disable_by_batch_size requests at the longest context; a
request that needs blocks takes them from the least recently proposed others (requests that
finished, were aborted or stopped speculating). It runs on the CPU, beside a CPU target.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from treadle.config import CacheConfig, ModelConfig, SpeculativeConfig
from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.capabilities import resolve_device, torch_dtype
from treadle.model.loader import load_model
from treadle.model.memory import gib
from treadle.model.runner import ModelRunner
from treadle.model.source import ModelLoadError

logger = logging.getLogger(__name__)

# New tokens up to this many run as decode rows (the fused decoder), more as a prefill chunk.
CATCH_UP_ROWS = 8
# Of what the draft has not seen (a prompt), a proposal runs at most this many tokens and
# guesses nothing until it has seen all: a long prompt never stalls a step for long.
CATCH_UP_CHUNK = 256


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
        if resolve_device(target.config.device) != "cpu":
            raise ValueError("speculative_config: draft_model runs on the CPU only")
        model_config = ModelConfig(model=config.model, dtype=target.config.dtype,
                                   quantization=config.quantization, device="cpu",
                                   max_model_len=target.max_model_len,
                                   quant_gemv_max_rows=target.config.quant_gemv_max_rows)
        try:
            loaded = load_model(config.model, torch_dtype(target.config.dtype, "cpu"),
                                config.quantization, device="cpu")
        except ModelLoadError as e:
            raise ValueError(f"speculative_config: the draft model: {e}") from None
        if loaded.spec.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary "
                             f"({loaded.spec.vocab_size} tokens) is not the target's "
                             f"({target.vocab_size}): they must share the tokenizer")
        positions = target.max_model_len + config.num_speculative_tokens
        blocks_per_request = -(-positions // target.block_size)
        runner = ModelRunner(loaded, model_config, CacheConfig(
            block_size=target.block_size,
            num_blocks=config.disable_by_batch_size * blocks_per_request))
        if runner.max_model_len < target.max_model_len:
            raise ValueError(f"speculative_config: the draft model's context "
                             f"({runner.max_model_len} tokens) is shorter than the target's "
                             f"({target.max_model_len}): lower --max-model-len")
        kv_bytes = sum(t.nbytes for t in runner.kv_cache.keys + runner.kv_cache.values)
        logger.info("draft model %s: weights %s, KV cache %d blocks (%s)", loaded.name,
                    gib(runner.model.resident_bytes()), runner.num_blocks, gib(kv_bytes))
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
        new, start = list(token_ids[seen:]), seen
        state.tokens = list(token_ids[:seen])  # what the blocks hold while the passes write
        if len(new) > CATCH_UP_CHUNK:
            self.runner.execute(ModelInput([ScheduledSequence(new[:CATCH_UP_CHUNK], start,
                                                              state.blocks)]))
            state.tokens = list(token_ids[:seen + CATCH_UP_CHUNK])
            return []
        guesses: list[int] = []
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
        if blocks > self.runner.num_blocks:
            return False
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
