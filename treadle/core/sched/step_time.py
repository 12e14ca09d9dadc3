"""The step-time model: a step's seconds as fixed + per-token cost, fitted online over the
engine's measured steps (the simulator feeds it predicted ones), and what admission under
objectives predicts from it: a newcomer's TTFT and TPOT."""

from __future__ import annotations

import math
from typing import NamedTuple

MIN_RELATIVE_SPREAD = 0.01  # variance of step sizes / mean square, below which: no intercept


class StepFit(NamedTuple):
    """A step's seconds as fixed + per_token * its batched tokens."""

    fixed: float
    per_token: float

    def seconds(self, num_tokens: float) -> float:
        return self.fixed + self.per_token * num_tokens


class StepTimeModel:
    """An online fit of step seconds = fixed + per_token * tokens over the engine's measured
    steps: least squares on (tokens, seconds), each past step's weight multiplied by
    `forgetting` per new step (about the last 1 / (1 - forgetting) steps count), so the fit
    follows the load. Deliberately small: five running sums, O(1) per step. The fixed term is
    what a step costs whatever its size (weights read once, launch overheads), the per-token
    term what each batched token adds; one average per token made small steps look dearer per
    token than large ones, and could not say what a step of 60 decodes costs.

    A fit that would be unphysical falls back to a simpler one: steps all of about one size (no
    spread to separate the terms) or a negative intercept -> through the origin (per token
    only); a negative slope -> a constant. `fit` is None until a step is measured."""

    def __init__(self, forgetting: float = 0.95) -> None:
        self.forgetting = forgetting
        self.weight = self.sum_x = self.sum_y = self.sum_xx = self.sum_xy = 0.0
        self.fit: StepFit | None = None

    def update(self, duration: float, num_tokens: int) -> None:
        if num_tokens <= 0:  # an empty step says nothing
            return
        f, x = self.forgetting, float(num_tokens)
        self.weight = f * self.weight + 1.0
        self.sum_x = f * self.sum_x + x
        self.sum_y = f * self.sum_y + duration
        self.sum_xx = f * self.sum_xx + x * x
        self.sum_xy = f * self.sum_xy + x * duration
        self.fit = self._solve()

    def _solve(self) -> StepFit:
        spread = self.weight * self.sum_xx - self.sum_x ** 2
        # Token counts spread by less than a tenth of their size: the slope would be mostly
        # timing noise; one ratio predicts steps of that size as well.
        if spread > MIN_RELATIVE_SPREAD * self.weight * self.sum_xx:
            per_token = (self.weight * self.sum_xy - self.sum_x * self.sum_y) / spread
            fixed = (self.sum_y - per_token * self.sum_x) / self.weight
            if per_token < 0:
                return StepFit(max(0.0, self.sum_y / self.weight), 0.0)
            if fixed >= 0:
                return StepFit(fixed, per_token)
        return StepFit(0.0, max(0.0, self.sum_xy / self.sum_xx))

    @property
    def recent_step_seconds(self) -> float | None:
        """The mean of the recent steps (the same forgetting): what a step costs under the
        load the engine has now, arrivals' prefill chunks included."""
        return self.sum_y / self.weight if self.weight else None

    def seconds_per_token(self, num_tokens: int) -> float | None:
        """Seconds each token of a step of `num_tokens` costs (the fixed cost shared out)."""
        if self.fit is None:
            return None
        return self.fit.seconds(num_tokens) / max(1, num_tokens)


def predict_ttft(num_tokens_ahead: int, num_prompt_tokens: int, num_decoding: int,
                 token_budget: int, fit: StepFit) -> float:
    """Seconds until a new request's prompt has been computed, when `num_tokens_ahead` tokens
    go first and each step, of at most `token_budget` tokens, also carries `num_decoding`
    decode tokens: every step pays the fixed cost, every token the per-token one."""
    work = num_tokens_ahead + num_prompt_tokens
    steps = math.ceil(work / max(1, token_budget - num_decoding))
    return steps * fit.fixed + (work + steps * num_decoding) * fit.per_token


def predict_tpot(num_decoding: int, num_prefill_tokens: int, token_budget: int,
                 fit: StepFit) -> float:
    """Seconds of one step once a request decodes: `num_decoding` decode tokens (it among
    them) and as many of `num_prefill_tokens` as the token budget leaves beside them."""
    prefill = min(num_prefill_tokens, max(0, token_budget - num_decoding))
    return fit.seconds(num_decoding + prefill)
