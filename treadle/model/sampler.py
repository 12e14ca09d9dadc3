"""Batched sampling: every request of a step in one pass, each with its own parameters.

Greedy rows take the argmax. Random rows apply temperature, then top-k and top-p masks, and draw
by the exponential race (argmax of p / q with q ~ Exp(1)), which samples from p exactly; a request
with a seed draws its q from its own generator, so its tokens do not depend on its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingOptions:
    """What the sampler needs of one request's parameters."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = -1  # -1: off
    top_p: float = 1.0


class Sampler:
    def __call__(self, logits: torch.Tensor, options: list[SamplingOptions],
                 generators: list[torch.Generator | None]) -> list[int]:
        """One token id per row of `logits` [rows, vocab] (float32)."""
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, o in enumerate(options) if o.temperature > 0]
        if random_rows:
            rows = torch.tensor(random_rows)
            probs = self.probabilities(logits[rows], [options[i] for i in random_rows])
            q = torch.empty_like(probs)
            shared = [j for j, i in enumerate(random_rows) if generators[i] is None]
            if shared:
                q[shared] = q[shared].exponential_()
            for j, i in enumerate(random_rows):
                if generators[i] is not None:
                    q[j].exponential_(generator=generators[i])
            tokens[rows] = probs.div(q).argmax(dim=-1)
        return tokens.tolist()

    @staticmethod
    def probabilities(logits: torch.Tensor, options: list[SamplingOptions]) -> torch.Tensor:
        temperature = torch.tensor([o.temperature for o in options]).unsqueeze(1)
        logits = logits / temperature
        top_k = [o.top_k for o in options]
        if any(k > 0 for k in top_k):
            k = torch.tensor([k if k > 0 else logits.shape[1] for k in top_k])
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = torch.tensor([o.top_p for o in options]).unsqueeze(1)
        if (top_p < 1).any():
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p: a token goes when the mass
            # before it already does. The top token always stays.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = mass_before >= top_p
            drop[:, 0] = False
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits.softmax(dim=-1)
