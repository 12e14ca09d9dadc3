"""Suffix lookup over recent requests (vLLM's `suffix` method, simplified): the sequence's last
tokens are looked up in the sequence itself and in the prompts and outputs of the last
`suffix_decoding_max_cached_requests` finished requests, and the tokens that followed the
longest match are proposed. Agent loops and templated outputs repeat what earlier requests
wrote, which prompt lookup alone never sees."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from treadle.core.spec_decode.ngram import longest_match

SEPARATOR = -1  # between cached requests: no token equals it, so no match runs across two


class SuffixProposer:
    def __init__(self, min_n: int, max_n: int, max_cached_requests: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.cached: deque[np.ndarray] = deque(maxlen=max_cached_requests)
        self.joined_arrays: tuple[np.ndarray, np.ndarray] | None = None  # built on demand

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The continuation of the longest match: in the sequence itself (as prompt lookup), or,
        where longer, in the cached requests (the latest among equally long ones)."""
        n = len(token_ids)
        if max_tokens < 1 or n < self.min_n:
            return []
        tokens = np.fromiter(token_ids, dtype=np.int64, count=n)
        length, end = longest_match(tokens[:-1], tokens, self.min_n, self.max_n)
        best = tokens[end + 1:end + 1 + max_tokens] if end >= 0 else tokens[:0]
        if self.cached:
            haystack, searched = self.joined()
            cached_length, cached_end = longest_match(searched, tokens, self.min_n, self.max_n)
            if cached_length > length:
                follow = haystack[cached_end + 1:cached_end + 1 + max_tokens]
                stop = np.flatnonzero(follow == SEPARATOR)
                best = follow[:stop[0]] if stop.size else follow
        return best.tolist()

    def finished(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Cache a finished request's prompt and output (the oldest dropped past the limit)."""
        self.cached.append(np.fromiter(token_ids, dtype=np.int64, count=len(token_ids)))
        self.joined_arrays = None

    def joined(self) -> tuple[np.ndarray, np.ndarray]:
        """The cached requests one after another, each followed by a SEPARATOR; and the same
        with each request's last token a SEPARATOR too, to search in: a match ending there
        has nothing after it to propose."""
        if self.joined_arrays is None:
            haystack = np.concatenate([part for tokens in self.cached for part in (
                tokens, np.array([SEPARATOR], dtype=np.int64))])
            searched = haystack.copy()
            searched[np.flatnonzero(haystack == SEPARATOR) - 1] = SEPARATOR
            self.joined_arrays = haystack, searched
        return self.joined_arrays
