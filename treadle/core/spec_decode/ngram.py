"""N-gram prompt lookup: find the sequence's last tokens earlier in the sequence and propose
the tokens that followed them (vLLM's `ngram`, llama.cpp's lookup decoding)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def longest_match(haystack: np.ndarray, pattern: np.ndarray, min_n: int, max_n: int
                  ) -> tuple[int, int]:
    """(length, end) of the longest suffix of `pattern`, of min_n..max_n tokens, found in
    `haystack` ending at index `end` (the latest such end among equally long ones); (0, -1)
    when no suffix of min_n tokens is found.

    Vectorised over the candidates: every position of the haystack holding the pattern's last
    token is one, and each round compares one more token back, so the work is ~len * max_n
    element compares in numpy, not a Python loop over the sequence."""
    ends = np.flatnonzero(haystack == pattern[-1])
    if ends.size == 0:
        return 0, -1
    lengths = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(max_n, len(pattern))):
        before = ends - back
        alive &= before >= 0
        alive[alive] = haystack[before[alive]] == pattern[len(pattern) - 1 - back]
        if not alive.any():
            break
        lengths += alive
    best = int(lengths.max())
    if best < min_n:
        return 0, -1
    return best, int(ends[lengths == best][-1])


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The tokens after the earlier occurrence of the longest suffix of `token_ids`, of
        min_n..max_n tokens, that occurs before the end (the latest such occurrence among equally
        long ones), up to `max_tokens` of them; [] when no suffix of min_n tokens recurs."""
        n = len(token_ids)
        if max_tokens < 1 or n <= self.min_n:
            return []
        tokens = np.fromiter(token_ids, dtype=np.int64, count=n)
        _, end = longest_match(tokens[:-1], tokens, self.min_n, self.max_n)
        return [] if end < 0 else tokens[end + 1:end + 1 + max_tokens].tolist()

    def finished(self, request_id: str, token_ids: Sequence[int]) -> None:
        """A request ended: prompt lookup looks at each sequence alone."""
