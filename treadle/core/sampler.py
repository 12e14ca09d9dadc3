"""Batched sampling: every request of a step in one pass, each row with its own parameters.

The order is vLLM v1's (vllm/v1/sample/sampler.py, the `Sampler` docstring; min-p in
vllm/v1/sample/logits_processor/builtin.py is an argmax-invariant processor, run after
temperature and before top-k/top-p):

1. Logprobs, where a row asks for them, come from the raw logits: log_softmax of the model's
   output before bias, penalties, temperature or any mask. This is vLLM's default
   (`logprobs_mode="raw_logprobs"`), so the numbers a client sees are the model's own.
2. Logit bias, and suppressed tokens (the engine's stop tokens before `min_tokens`).
3. Penalties: repetition over prompt and output tokens, frequency and presence over output
   tokens only.
4. The structured-output bitmask (engine/structured_output.py): tokens a row's grammar forbids
   get -inf, so constrained and free rows share one batch; rows without a grammar are all ones
   and left alone.
5. Greedy rows (temperature 0) take the argmax here: bias and penalties do steer them.
6. Random rows: temperature, then min-p, then top-k, then top-p, then a draw by inverting the
   row's cumulative distribution (float64) at one uniform number, which samples from p exactly.
   A row with its own generator draws its number from it alone, so its tokens do not depend on
   its neighbours.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from treadle.core.messages import TokenLogprobs
from treadle.model.kernels import sampling_kernels


@dataclass(frozen=True)
class SamplingOptions:
    """What the sampler needs of one request's parameters at one step."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = -1  # -1 (or >= vocab): off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # 0: off
    frequency_penalty: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # added to the raw logits
    suppressed_token_ids: Sequence[int] = ()  # never sampled this step (e.g. EOS before min_tokens)
    num_logprobs: int | None = None  # None: no logprobs; N: the chosen token's and the top N

    def filters(self, vocab: int) -> bool:
        """Whether min-p, top-k or top-p removes any token."""
        return self.min_p > 0 or 0 < self.top_k < vocab or self.top_p < 1

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None] | None = None  # None: no row asked; per row otherwise


DRAW_BLOCK = 256  # tokens a block in Sampler.draw's two-level cumulative sums


class Sampler:
    def __call__(self, logits: torch.Tensor, options: Sequence[SamplingOptions],
                 generators: Sequence[torch.Generator | None],
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 output_token_ids: Sequence[Sequence[int]] | None = None,
                 token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """Next token of each row of `logits` [rows, vocab] (float32, left unchanged).

        `generators[i]`: row i's own generator (a seeded request) or None (the global one).
        `prompt_token_ids` / `output_token_ids`: each row's tokens so far; needed only when some
        row uses penalties. `token_bitmask`: int32 [rows, ceil(vocab / 32)] on the CPU, bit t of
        row i set when row i may sample token t (None: every token allowed).
        """
        if not len(options) == len(generators) == logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} rows of logits, {len(options)} options, "
                             f"{len(generators)} generators")
        logits = logits.float()  # a no-op for float32, which stays the caller's untouched tensor
        processed = self.apply_bias_and_penalties(logits, options, prompt_token_ids,
                                                  output_token_ids)
        if token_bitmask is not None:
            processed = apply_token_bitmask(processed, token_bitmask)
        random_rows = [i for i, o in enumerate(options) if o.temperature > 0]
        if random_rows and len(random_rows) == len(options):  # no argmax, no copy of the rows
            tokens = self.sample(processed, options, generators)
        else:
            tokens = processed.argmax(dim=-1)
            if random_rows:
                rows = torch.tensor(random_rows, device=logits.device)
                tokens[rows] = self.sample(processed[rows], [options[i] for i in random_rows],
                                           [generators[i] for i in random_rows])
        logprob_rows = [i for i, o in enumerate(options) if o.num_logprobs is not None]
        if not logprob_rows:
            return SamplerOutput(tokens.tolist())
        rows = torch.tensor(logprob_rows, device=logits.device)
        gathered = gather_logprobs(logits[rows], tokens[rows],
                                   [options[i].num_logprobs or 0 for i in logprob_rows])
        per_row: list[TokenLogprobs | None] = [None] * len(options)
        for i, row_logprobs in zip(logprob_rows, gathered, strict=True):
            per_row[i] = row_logprobs
        return SamplerOutput(tokens.tolist(), per_row)

    def sample(self, logits: torch.Tensor, options: Sequence[SamplingOptions],
               generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """One token per row, every row random: the native kernel where no row filters, else
        the torch path. Both invert the cumulative distribution at the same u, so a seeded row
        draws alike."""
        u = uniforms(generators)
        kernels = sampling_kernels() if logits.is_cpu else None
        vocab = logits.shape[1]
        if kernels is not None and not any(o.filters(vocab) for o in options):
            temperatures = torch.tensor([o.temperature for o in options], dtype=torch.float32)
            return kernels.sample_rows(logits, temperatures, u)
        return self.draw(self.probabilities(logits, options), u)

    @staticmethod
    def apply_bias_and_penalties(logits: torch.Tensor, options: Sequence[SamplingOptions],
                                 prompt_token_ids: Sequence[Sequence[int]] | None,
                                 output_token_ids: Sequence[Sequence[int]] | None
                                 ) -> torch.Tensor:
        """Logits after logit bias, suppressed tokens and penalties (a new tensor if any)."""
        bias = [(i, t, b) for i, o in enumerate(options) for t, b in o.logit_bias.items()]
        suppressed = [(i, t) for i, o in enumerate(options) for t in o.suppressed_token_ids]
        penalized = [i for i, o in enumerate(options) if o.uses_penalties]
        if not (bias or suppressed or penalized):
            return logits  # the common case: nothing to build
        logits = logits.clone()
        device = logits.device
        if bias:
            rows, cols, values = zip(*bias, strict=True)
            logits[list(rows), list(cols)] += torch.tensor(values, device=device)
        if suppressed:
            rows, cols = zip(*suppressed, strict=True)
            logits[list(rows), list(cols)] = float("-inf")
        if penalized:
            if prompt_token_ids is None or output_token_ids is None:
                raise ValueError("penalties need each row's prompt and output token ids")
            logits[penalized] = apply_penalties(
                logits[penalized], [options[i] for i in penalized],
                [prompt_token_ids[i] for i in penalized], [output_token_ids[i] for i in penalized])
        return logits

    @staticmethod
    def probabilities(logits: torch.Tensor, options: Sequence[SamplingOptions]) -> torch.Tensor:
        """The distribution each random row samples from: softmax(logits / temperature) after
        min-p, top-k and top-p. A filter that is off leaves its row bit-for-bit unchanged, so a
        row's probabilities do not depend on what its neighbours ask for."""
        device, vocab = logits.device, logits.shape[1]
        logits = logits / torch.tensor([o.temperature for o in options], device=device)[:, None]
        min_p = torch.tensor([o.min_p for o in options], device=device)[:, None]
        if (min_p > 0).any():
            # Keep tokens at least min_p times as likely as the most likely one.
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p,
                                        float("-inf"))
        top_k = torch.tensor([o.top_k if 0 < o.top_k < vocab else vocab for o in options],
                             device=device)[:, None]
        top_p = torch.tensor([o.top_p for o in options], device=device)[:, None]
        use_k, use_p = bool((top_k < vocab).any()), bool((top_p < 1).any())
        if use_k or use_p:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            if use_k:
                # Keep every token tied with the k-th largest, as vLLM does.
                kth = sorted_logits.gather(1, top_k - 1)
                sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
            if use_p:
                # Keep the smallest prefix whose mass (after top-k) reaches top_p: a token goes
                # when the mass before it already does. The top token always stays.
                sorted_probs = sorted_logits.softmax(dim=-1)
                mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
                drop = (mass_before >= top_p) & (top_p < 1)
                drop[:, 0] = False
                sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        return logits.softmax(dim=-1)

    @staticmethod
    def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One token per row of `probs`: the first whose cumulative probability passes u times
        the row's total, `u` float64 [rows] in [0, 1). One random number a row, where vLLM's
        exponential race (argmax p / q, q ~ Exp(1)) draws one per vocabulary entry.

        The cumulative sums run in float64 in two levels: over blocks of DRAW_BLOCK tokens
        (each block's sum in float32), then inside the one block that holds the target, not
        over a float64 copy of the whole distribution (docs/decisions.md)."""
        rows, vocab = probs.shape
        if vocab % DRAW_BLOCK:
            probs = torch.nn.functional.pad(probs, (0, -vocab % DRAW_BLOCK))
        blocks = probs.view(rows, -1, DRAW_BLOCK)
        # A token or block of probability 0 adds nothing to a sum, so it is never the first to
        # pass a target; u < 1 rounds u * total below the total, so some block passes it.
        block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
        target = u.to(probs.device)[:, None] * block_cdf[:, -1:]
        block = torch.searchsorted(block_cdf, target, right=True)
        before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
        inside = blocks[torch.arange(rows, device=probs.device), block[:, 0]]
        offset = torch.searchsorted(inside.double().cumsum(dim=-1), target - before, right=True)
        # The block's float32 sum and its float64 cumsum may differ in the last bit: a target
        # past the block's end takes its last token of nonzero probability.
        last = DRAW_BLOCK - 1 - (inside.flip(-1) > 0).int().argmax(dim=-1, keepdim=True)
        return (block * DRAW_BLOCK + torch.minimum(offset, last))[:, 0]


def uniforms(generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """u ~ U[0, 1), float64 on the CPU, one a row: from the row's own generator (a seeded
    request) or the global one."""
    u = torch.empty(len(generators), dtype=torch.float64)
    unseeded = [row for row, generator in enumerate(generators) if generator is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for row, generator in enumerate(generators):
        if generator is not None:  # drawn on the generator's device (a CPU one serves GPUs)
            u[row] = torch.rand(1, dtype=torch.float64, device=generator.device,
                                generator=generator).item()
    return u


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with -inf where `bitmask` (int32 [rows, words] on the CPU, bit t of word t // 32)
    forbids a token, on the rows that forbid any (a new tensor then); tokens past 32 * words
    are forbidden on those rows."""
    rows = (bitmask != -1).any(dim=1).nonzero()[:, 0]
    if rows.numel() == 0:
        return logits
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask[rows].numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :vocab]).to(logits.device, torch.float32)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    # -inf where forbidden, 0 where allowed, by arithmetic: (0 - 1) * max * 2 overflows to -inf
    # (twice as fast as masked_fill or where).
    blocked = allowed.sub_(1).mul_(torch.finfo(torch.float32).max).mul_(2)
    if len(rows) == logits.shape[0]:
        return logits + blocked
    logits = logits.clone()
    logits[rows.to(logits.device)] += blocked
    return logits


def apply_penalties(logits: torch.Tensor, options: Sequence[SamplingOptions],
                    prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """vLLM's penalties (vllm/model_executor/layers/utils.py, `apply_penalties`, which follows
    OpenAI's definition of frequency and presence penalties):

    - repetition r, over tokens seen in the prompt or the output: logit / r if the logit is
      positive, else logit * r (so r > 1 always makes a seen token less likely);
    - then frequency f and presence p, over output tokens only:
      logit - f * count - p * (count > 0).
    """
    device, vocab = logits.device, logits.shape[1]
    prompt_counts = _token_counts(prompt_token_ids, vocab, device)
    output_counts = _token_counts(output_token_ids, vocab, device)

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(o, name) for o in options], device=device)[:, None]

    seen = (prompt_counts > 0) | (output_counts > 0)
    repetition = torch.where(seen, column("repetition_penalty"), 1.0)
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    return (logits - column("frequency_penalty") * output_counts
            - column("presence_penalty") * (output_counts > 0))


def _token_counts(histories: Sequence[Sequence[int]], vocab: int,
                  device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32: how many times each token occurs in each row's history."""
    counts = torch.zeros(len(histories), vocab, device=device)
    tokens = torch.tensor(list(itertools.chain.from_iterable(histories)), dtype=torch.long,
                          device=device)
    rows = torch.repeat_interleave(torch.arange(len(histories), device=device),
                                   torch.tensor([len(h) for h in histories], device=device))
    counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=counts.dtype),
                      accumulate=True)
    return counts


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                    num_logprobs: Sequence[int]) -> list[TokenLogprobs]:
    """For each row of raw `logits` [rows, vocab]: the logprob and rank of `token_ids[row]` and
    the top `num_logprobs[row]` tokens, all from log_softmax of the logits as given (vLLM's
    raw_logprobs). Serves sampled tokens here, and prompt tokens given all-position logits."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(max(num_logprobs, default=0), dim=-1)
    rows = zip(token_ids.tolist(), chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(),
               top_logprobs.tolist(), num_logprobs, strict=True)
    return [TokenLogprobs(t, lp, rank, ids[:n], lps[:n]) for t, lp, rank, ids, lps, n in rows]
