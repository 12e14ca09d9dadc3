"""Which requests speculate each step, how many tokens each proposes, and the counts.

The rule (torch-free, so the step loop's other users could run it):
- A step with more running requests than `disable_by_batch_size` proposes nothing: its model
  pass already has that many rows, and on a CPU each extra row starts to cost compute rather
  than ride on the one read of the weights that a step of a few rows is bound by.
- A request speculates only while decoding, unless it opted out (`speculate: false`: a client
  that measures plain decoding, or one whose output will not repeat), and only where the
  output distribution stays exactly the target's at no extra machinery: no penalties (they
  depend on the tokens before each position), no seed (a seeded request repeats its own
  draws, which verification would consume differently). A request with a grammar speculates:
  the engine keeps the proposed tokens its grammar takes and masks each row by the grammar's
  state there (core/structured_output.py).
- Its draft length adapts to its acceptance: after every proposed token was accepted it grows
  by one (up to num_speculative_tokens); after a rejection it becomes the accepted count plus
  one, so a request whose guesses fail pays for one extra position a step, not k.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from treadle.config import SpeculativeConfig
from treadle.core.request import Request
from treadle.core.sampling_params import SamplingParams
from treadle.core.spec_decode.proposer import Proposer, make_proposer

logger = logging.getLogger(__name__)


@dataclass
class SpecDecodeCounts:
    """Since the engine started (vLLM's spec_decode_num_* counters)."""

    num_drafts: int = 0  # requests' verified proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Position i: the proposals whose first i + 1 tokens were accepted.
    accepted_per_position: list[int] = field(default_factory=list)


def speculates(params: SamplingParams) -> bool:
    """Whether a request with these parameters may speculate (the module's rule)."""
    return (params.speculate and params.seed is None and params.presence_penalty == 0
            and params.frequency_penalty == 0 and params.repetition_penalty == 1)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer or make_proposer(config)
        self.counts = SpecDecodeCounts(
            accepted_per_position=[0] * config.num_speculative_tokens)
        self.proposing: list[Request] = []  # the requests given drafts last step

    def propose(self, running: Sequence[Request]) -> None:
        """Set each running request's `spec_token_ids` for the coming step (() for none)."""
        for request in self.proposing:
            request.spec_token_ids = ()
        self.proposing = []
        if len(running) > self.config.disable_by_batch_size:
            return
        for request in running:
            params = request.sampling_params
            # Decoding (its last token the only one not computed) after its first token.
            if request.num_computed_tokens != request.num_tokens - 1 \
                    or not request.num_output_tokens or request.pooling or not speculates(params):
                continue
            # The last token the step samples past the drafts counts towards max_tokens too.
            room = params.max_tokens - request.num_output_tokens - 1
            num = min(request.draft_length or self.config.num_speculative_tokens, room)
            if num < 1:
                continue
            try:
                drafts = self.proposer.propose(request.request_id, request.all_token_ids, num)
            except Exception:  # a proposer's failure costs its guesses, never the engine
                logger.exception("proposer failed for request %s", request.request_id)
                self.proposer.finished(request.request_id, ())
                continue
            if drafts:
                request.spec_token_ids = drafts
                self.proposing.append(request)

    def finished(self, request: Request) -> None:
        """A request ended: its tokens, for proposers that learn from earlier requests or hold
        state per request."""
        self.proposer.finished(request.request_id, request.all_token_ids)

    def verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Count a verified proposal and adapt the request's draft length (the module's rule)."""
        counts = self.counts
        counts.num_drafts += 1
        counts.num_draft_tokens += num_drafts
        counts.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            counts.accepted_per_position[position] += 1
        request.stats.draft_tokens += num_drafts
        request.stats.accepted_tokens += num_accepted
        longest = self.config.num_speculative_tokens
        if num_accepted == num_drafts:
            request.draft_length = min(longest, (request.draft_length or longest) + 1)
        else:
            request.draft_length = num_accepted + 1
