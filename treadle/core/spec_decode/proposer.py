"""The proposer interface: a guess of the tokens that follow a sequence, for the model to check.

A proposer sees token ids only (prompt then outputs) and is torch-free; what it proposes changes
nothing the model outputs, only how many tokens one step may accept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from treadle.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` (>= 1) tokens guessed to follow `token_ids`; [] for no guess."""

    def finished(self, token_ids: Sequence[int]) -> None:
        """A request ended with these tokens (prompt then output), for proposers that learn
        from earlier requests."""


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer `config.method` names (the config checked the name)."""
    from treadle.core.spec_decode.ngram import NgramProposer
    from treadle.core.spec_decode.suffix import SuffixProposer

    if config.method == "suffix":
        return SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                              config.suffix_decoding_max_cached_requests)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
