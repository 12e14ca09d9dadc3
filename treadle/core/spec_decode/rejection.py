"""Verifying proposed tokens: the standard speculative-sampling rule, so the tokens a request
gets are distributed exactly as the model's own (Leviathan et al. 2023; vLLM's
rejection_sampler.py).

Row i of a request's logits predicts the token after its i-th proposed token (row 0: after the
last real token). Each row gets the request's processing exactly as the plain sampler applies
it (logit bias, suppressed tokens, temperature, min-p, top-k, top-p), giving p. Proposed token
x at row i is accepted with probability min(1, p(x) / q(x)); a proposer that guesses one token
is a point mass q(x) = 1, so with probability p(x), and greedy rows accept exactly the argmax.
At the first rejection the row's token is drawn from max(0, p - q) normalised: p without x.
When all are accepted, one more token is drawn from the last row's p, as a plain step would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from treadle.core.sampler import Sampler, SamplingOptions, uniforms


def verify_drafts(logits: torch.Tensor, draft_token_ids: Sequence[Sequence[int]],
                  options: Sequence[SamplingOptions]) -> list[list[int]]:
    """The tokens each request gets: its accepted proposed tokens, then one drawn token.

    `logits` [rows, vocab], float32: for each request in order, len(drafts) + 1 rows; `options`:
    one per row (a request's may differ by row only in suppressed tokens, as min_tokens passes).
    Penalties are not applied: requests with penalties do not speculate."""
    num_rows = sum(len(d) + 1 for d in draft_token_ids)
    if not num_rows == len(options) == logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits, {len(options)} options, "
                         f"{num_rows} rows of proposals")
    processed = Sampler.apply_bias_and_penalties(logits.float(), options, None, None)
    argmax = processed.argmax(dim=-1).tolist()
    random_rows = [i for i, o in enumerate(options) if o.temperature > 0]
    probs = (Sampler.probabilities(processed[random_rows], [options[i] for i in random_rows])
             if random_rows else None)
    prob_row = {row: i for i, row in enumerate(random_rows)}  # logits row -> row of probs
    # Each proposed token's probability under its row's p, and one uniform draw per row.
    drafted = [(row, token) for row, token in _draft_rows(draft_token_ids) if row in prob_row]
    draft_probs = (probs[[prob_row[r] for r, _ in drafted], [t for _, t in drafted]].tolist()
                   if drafted else [])
    p_of = {row: p for (row, _), p in zip(drafted, draft_probs, strict=True)}
    u = uniforms([None] * len(drafted)).tolist()
    u_of = {row: x for (row, _), x in zip(drafted, u, strict=True)}

    emitted: list[list[int]] = []
    # Random requests' last rows, to draw from together: (request, probs row, rejected token).
    to_draw: list[tuple[int, int, int | None]] = []
    row = 0
    for drafts in draft_token_ids:
        accepted: list[int] = []
        for token in drafts:
            r = row + len(accepted)
            ok = (u_of[r] < p_of[r]) if r in prob_row else argmax[r] == token
            if not ok:
                break
            accepted.append(token)
        last = row + len(accepted)
        rejected = drafts[len(accepted)] if len(accepted) < len(drafts) else None
        if last in prob_row:
            to_draw.append((len(emitted), prob_row[last], rejected))
        else:
            accepted.append(argmax[last])
        emitted.append(accepted)
        row += len(drafts) + 1
    if to_draw:
        assert probs is not None
        rows = probs[[i for _, i, _ in to_draw]]
        rejected_rows = [(j, t) for j, (_, _, t) in enumerate(to_draw) if t is not None]
        if rejected_rows:  # the residual max(0, p - q) for a point mass q: p without x
            rows[[j for j, _ in rejected_rows], [t for _, t in rejected_rows]] = 0.0
        tokens = Sampler.draw(rows, uniforms([None] * len(to_draw))).tolist()
        for (request, _, _), token in zip(to_draw, tokens, strict=True):
            emitted[request].append(token)
    return emitted


def _draft_rows(draft_token_ids: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(logits row, proposed token) of every proposed token: row i of a request checks its
    proposed token i."""
    pairs = []
    row = 0
    for drafts in draft_token_ids:
        pairs.extend((row + i, token) for i, token in enumerate(drafts))
        row += len(drafts) + 1
    return pairs
