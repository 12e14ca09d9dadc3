"""The proposer interface: a guess of the tokens that follow a sequence, for the model to check.

A proposer sees a request's id and token ids only (prompt then outputs); what it proposes
changes nothing the model outputs, only how many tokens one step may accept. The lookup
proposers are torch-free; the draft model's (draft.py) is the engine's to build.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from treadle.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` (>= 1) tokens guessed to follow request `request_id`'s
        `token_ids`; [] for no guess."""

    def finished(self, request_id: str, token_ids: Sequence[int]) -> None:
        """A request ended with these tokens (prompt then output), for proposers that learn
        from earlier requests or hold state per request."""


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The lookup proposer `config.method` names (the config checked the name); a draft model's
    the engine builds (draft.py: it needs the target's facts)."""
    from treadle.core.spec_decode.ngram import NgramProposer
    from treadle.core.spec_decode.suffix import SuffixProposer

    if config.method == "draft_model":
        raise ValueError("speculative_config: a draft model's proposer is built with its target "
                         "(DraftProposer.from_config)")
    if config.method == "suffix":
        return SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                              config.suffix_decoding_max_cached_requests)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
