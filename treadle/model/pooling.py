"""Pooling: a prompt's final hidden states (transformers' last_hidden_state) into one embedding.

`last` takes the last token's state (vLLM's default for decoder LLMs served as embedders: causal
attention puts the whole prompt into it); `mean` averages every token's. Either is then L2
normalised, as vLLM's embedding pooler and sentence-transformers do. A prompt may run in several
prefill chunks, and again from the start after a preemption: `PooledHidden` takes each chunk's
rows as they come and counts each position once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treadle.config import POOLING_TYPES


class PooledHidden:
    """One request's pooling so far, fed the final hidden states of its chunks in order."""

    def __init__(self, pooling: str, num_tokens: int) -> None:
        if pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {pooling!r}")
        self.pooling = pooling
        self.num_tokens = num_tokens
        self.num_pooled = 0  # positions 0 .. num_pooled are in `pooled`
        self.pooled: torch.Tensor | None = None  # the sum (mean) or the last row (last)

    def rows_wanted(self, start: int, num_new: int) -> int:
        """Hidden-state rows a chunk of positions start .. start + num_new must return: all of
        them for mean, the last only on the chunk that ends the prompt for last."""
        if self.pooling == "mean":
            return num_new
        return 1 if start + num_new == self.num_tokens else 0

    def add(self, end: int, rows: torch.Tensor) -> None:
        """`rows`: float32 [k, hidden], the final hidden states of positions end - k .. end - 1
        (what `rows_wanted` asked of the chunk ending at `end`). Positions pooled before
        (recomputed after a preemption) are skipped."""
        first = end - rows.shape[0]
        rows = rows[max(0, self.num_pooled - first):]
        if rows.shape[0] == 0:
            return
        if self.pooling == "last":
            self.pooled = rows[-1]
        else:
            total = rows.sum(dim=0)
            self.pooled = total if self.pooled is None else self.pooled + total
        self.num_pooled = end

    @property
    def done(self) -> bool:
        return self.num_pooled == self.num_tokens

    def embedding(self) -> list[float]:
        """The pooled, L2-normalised vector; once every position has been added."""
        assert self.done and self.pooled is not None, "pooled before the prompt was computed"
        vector = self.pooled / self.num_tokens if self.pooling == "mean" else self.pooled
        return F.normalize(vector, dim=0).tolist()
