"""Router: which data-parallel replica takes a request. Pure Python, in the frontend.

round-robin: in turn. least-load: the fewest outstanding tokens (prompt left to prefill plus
decode tokens to go), as the frontend counts them (treadle/frontend/data_parallel.py). prefix:
where the request's first blocks were last sent, since that replica likely still caches them
(as SGLang's router does). Its index is approximate: per replica an LRU of the block hashes
routed there, as many as the replica's KV cache has blocks (it cannot hold more), hashed as the
engine's prefix cache hashes them (`hash_block_tokens`, the cache salt in the first block), so
equal hashes mean equal prefixes, across tenants' salts too. The replica with the longest run
of leading hashes in its index wins, unless it is overloaded: more than `overload_tokens`
outstanding tokens above the least-loaded replica; then, and when no replica has the prefix,
least-load decides.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from treadle.core.kv_cache import BlockHash, hash_block_tokens

# The leading blocks a prompt is routed by: 64 blocks of 16 tokens cover a long system prompt;
# hashing more costs the event loop time (a SHA-256 each) for little more affinity.
MAX_ROUTED_BLOCKS = 64


def prefix_hashes(prompt_token_ids: Sequence[int], block_size: int, cache_salt: str | None,
                  max_blocks: int = MAX_ROUTED_BLOCKS) -> list[BlockHash]:
    """The hashes of the prompt's first full blocks, as the engine's KV cache computes them."""
    hashes: list[BlockHash] = []
    for i in range(min(len(prompt_token_ids) // block_size, max_blocks)):
        extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                        prompt_token_ids[i * block_size:(i + 1) * block_size],
                                        extra))
    return hashes


class Router:
    def __init__(self, policy: str, num_replicas: int, block_size: int, index_blocks: int,
                 overload_tokens: int) -> None:
        """`policy`: round-robin, least-load or prefix; `index_blocks`: block hashes remembered
        per replica; `overload_tokens`: see the module's docstring."""
        self.policy = policy
        self.block_size = block_size
        self.index_blocks = index_blocks
        self.overload_tokens = overload_tokens
        self.indexes: list[OrderedDict[BlockHash, None]] = [OrderedDict()
                                                            for _ in range(num_replicas)]
        self.next_replica = 0  # round-robin's turn

    def pick(self, prompt_token_ids: Sequence[int], cache_salt: str | None,
             loads: Sequence[int], live: Sequence[bool]) -> int | None:
        """The replica for a request, among the live ones (None: none is live), given each
        replica's outstanding tokens."""
        candidates = [i for i, up in enumerate(live) if up]
        if not candidates:
            return None
        if self.policy == "round-robin":
            n = len(live)
            choice = next(i % n for i in range(self.next_replica, self.next_replica + n)
                          if live[i % n])
            self.next_replica = (choice + 1) % n
            return choice
        least = min(candidates, key=lambda i: loads[i])
        if self.policy == "least-load":
            return least
        hashes = prefix_hashes(prompt_token_ids, self.block_size, cache_salt)
        matched = {i: self._matched_blocks(i, hashes) for i in candidates}
        best = max(candidates, key=lambda i: (matched[i], -loads[i]))
        choice = (best if matched[best] and loads[best] <= loads[least] + self.overload_tokens
                  else least)
        index = self.indexes[choice]
        for block_hash in hashes:
            index[block_hash] = None
            index.move_to_end(block_hash)
        while len(index) > self.index_blocks:
            index.popitem(last=False)
        return choice

    def forget(self, replica: int) -> None:
        """The replica restarted: its cache is empty."""
        self.indexes[replica].clear()

    def _matched_blocks(self, replica: int, hashes: list[BlockHash]) -> int:
        index, n = self.indexes[replica], 0
        while n < len(hashes) and hashes[n] in index:
            n += 1
        return n
