"""A step's batch as the model sees it: sequences as token ids, cached-token counts and block
tables in; logits (and pooling rows' final hidden states) out."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ScheduledSequence:
    """One sequence's share of a step."""

    token_ids: list[int]  # the tokens to compute this step (a prefill chunk, or one decode token)
    num_computed_tokens: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # blocks covering num_computed_tokens + len(token_ids) slots
    all_logits: bool = False  # logits at every position (prompt logprobs), not only the last
    # Each token a decode row of its own, attending to the keys up to its position: proposed
    # tokens checked by the kernels of a plain decode step (the fused decoder where it serves),
    # so their logits are those plain decoding would compute, and no prefill path's overhead.
    decode_rows: bool = False
    # A pooling (embedding) sequence: the final hidden states of its last `num_hidden_rows`
    # tokens of this step (0 .. all of them), and no logits. None: a generating sequence.
    num_hidden_rows: int | None = None
    # Its LoRA adapter (an id unique per adapter, and the folder it loads from); None: the base.
    lora_id: int | None = None
    lora_path: str | None = None


@dataclass
class ModelInput:
    sequences: list[ScheduledSequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


@dataclass
class ModelOutput:
    """Float32 `logits` [rows, vocab]: for each generating sequence in order, one row for its last
    token, or one per token with all_logits. `hidden_states` [rows, hidden] (None when no
    sequence asked): for each pooling sequence in order, its num_hidden_rows, after the final norm
    (transformers' last_hidden_state). `experts_read`: each expert of each layer counted once
    however many of the step's tokens chose it (0 without experts)."""

    logits: torch.Tensor
    hidden_states: torch.Tensor | None = None
    experts_read: int = 0  # a mixture of experts' (layer, expert) pairs the pass ran


def cat_outputs(outputs: list[ModelOutput]) -> ModelOutput:
    """The outputs of sequences run one by one, as if run in one batch."""
    hidden = [o.hidden_states for o in outputs if o.hidden_states is not None]
    return ModelOutput(torch.cat([o.logits for o in outputs]),
                       torch.cat(hidden) if hidden else None,
                       sum(o.experts_read for o in outputs))
