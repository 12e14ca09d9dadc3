"""The paged KV cache's bookkeeping, pure Python over block ids.

`BlockPool` owns the fixed blocks: ref counts, the free list and the hash map for prefix reuse.
`KVCacheManager` owns the per-request block tables: prefix match, allocation, free.

A block's hash chains over its parent's hash, its token ids and extra keys (the cache salt), so
equal hashes mean equal whole prefixes; only full blocks are hashed. Free blocks keep their hash
until they are handed out again, so a later request can still hit them: the free list doubles as
the LRU eviction order.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Iterator, Sequence

from treadle.core.request import Request

BlockHash = bytes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple[object, ...] = ()) -> BlockHash:
    """SHA-256 of the pickled (parent, tokens, extra keys): deterministic across processes
    (unlike hash() of a str) and collision-resistant, since a collision would silently serve one
    prompt's KV to another, across cache salts too."""
    key = (parent_hash, tuple(token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def cache_extra(request: Request) -> tuple[object, ...]:
    """What keys a request's first block besides its tokens: its cache salt and adapter."""
    extra: tuple[object, ...] = () if request.cache_salt is None else (request.cache_salt,)
    lora = request.lora_request
    return extra if lora is None else (*extra, "lora", lora.lora_int_id, lora.lora_path)


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0  # block tables holding this block
        self.block_hash: BlockHash | None = None  # set once full and cached
        self.prev_free: KVBlock | None = None  # links in the free list; None when not in it
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves: O(1) append at
    either end, pop from the head, and removal from the middle (a free cached block revived by a
    prefix hit). The head is evicted first."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head = KVBlock(-1)  # sentinels: no empty-list special cases
        self.tail = KVBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self) -> Iterator[KVBlock]:
        block = self.head.next_free
        while block is not self.tail:
            assert block is not None
            yield block
            block = block.next_free

    def _insert_after(self, prev: KVBlock, block: KVBlock) -> None:
        nxt = prev.next_free
        assert nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = nxt.prev_free = block
        self.num_free += 1

    def append(self, block: KVBlock) -> None:
        assert self.tail.prev_free is not None
        self._insert_after(self.tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self.head, block)

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free list"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next_free
        assert block is not None and block is not self.tail, "no free block"
        self.remove(block)
        return block


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVBlock] = {}
        # Blocks held by more than one table (prefix hits): while none are, no two requests read
        # the same KV, which `treadle sim` checks each step before counting shared context.
        self.num_shared_blocks = 0
        # Counts the changes to any table's blocks: what is derived from the tables (each
        # tenant's blocks) holds until it moves.
        self.version = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds, cached ones included: those are evicted on demand."""
        return self.free_block_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take blocks from the head of the free list, evicting their cached hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                del self.cached_block_hash_to_block[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        self.version += 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Share blocks with one more table, reviving free ones (prefix hits)."""
        self.version += 1
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            elif block.ref_cnt == 1:
                self.num_shared_blocks += 1
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one table's hold on each block. Callers pass a table in reverse, so a request's
        tail blocks, the least likely to be shared, are evicted before its head blocks."""
        self.version += 1
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 1:
                self.num_shared_blocks -= 1
            elif block.ref_cnt == 0:
                if block.block_hash is None:  # nobody can hit it again: reuse it first
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def cache_full_blocks(self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash],
                          start: int, end: int) -> None:
        """Publish blocks [start, end) of one table, now full, under their hashes."""
        for block, block_hash in zip(blocks[start:end], block_hashes[start:end], strict=True):
            # A request that filled the same block concurrently keeps the map entry; this copy
            # stays unhashed and is recycled first once freed.
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[KVBlock]] = {}
        # The same tables as block ids, kept beside them: rebuilt for every decode, they were a
        # large share of `treadle sim`'s time.
        self.block_id_tables: dict[str, list[int]] = {}
        # Hashes of each request's full blocks, extended as tokens arrive; kept while it waits,
        # so a request skipped step after step hashes its prompt once.
        self.block_hashes: dict[str, list[BlockHash]] = {}
        self.prefix_cache_queries = 0  # tokens looked up, once per admission
        self.prefix_cache_hits = 0  # of those, tokens found cached

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_blocks - self.block_pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.block_id_tables.get(request_id, ()))

    def _request_block_hashes(self, request: Request) -> list[BlockHash]:
        hashes = self.block_hashes.setdefault(request.request_id, [])
        tokens, size = request.all_token_ids, self.block_size
        for i in range(len(hashes), len(tokens) // size):
            parent = hashes[-1] if hashes else None
            # The salt and the adapter go into the first block only: chaining carries them into
            # every later hash, so two adapters (or salts) never share a block.
            extra = () if i > 0 else cache_extra(request)
            hashes.append(hash_block_tokens(parent, tokens[i * size:(i + 1) * size], extra))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request's full blocks, and its length in tokens.

        The hit stops at least one token short of the request's tokens, so the step that computes
        the rest has logits to sample from. Nothing is taken yet: allocate_slots takes the hit.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in self._request_block_hashes(request)[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def num_free_blocks_needed(self, request: Request, num_new_tokens: int,
                               new_computed_blocks: Sequence[KVBlock] = (),
                               num_new_computed_tokens: int = 0) -> int:
        """Free blocks that allocate_slots with the same arguments would take: new ones, and hit
        blocks that sit in the free list (touching them takes them out of it)."""
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_held = len(self.block_tables.get(request.request_id, ()))
        num_new = cdiv(num_tokens, self.block_size) - num_held - len(new_computed_blocks)
        if not new_computed_blocks:  # a decode or a chunk: no generator to build
            return num_new
        return num_new + sum(1 for block in new_computed_blocks if block.ref_cnt == 0)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = (),
                       num_new_computed_tokens: int = 0) -> list[int] | None:
        """Grow the request's table to hold `num_new_tokens` after its computed tokens and the
        prefix hit `new_computed_blocks` (from get_computed_blocks, on the first allocation).
        Returns the whole table's block ids, or None, allocating nothing, when too few blocks
        are free."""
        if self.num_free_blocks_needed(request, num_new_tokens, new_computed_blocks,
                                       num_new_computed_tokens) > self.num_free_blocks:
            return None
        request_id = request.request_id
        table = self.block_tables.setdefault(request_id, [])
        ids = self.block_id_tables.setdefault(request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed + num_new_tokens
        num_needed = cdiv(num_tokens, self.block_size) - len(table) - len(new_computed_blocks)

        if self.enable_prefix_caching and request.num_computed_tokens == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        # Most calls are decodes inside their last block: nothing to take or publish.
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            table.extend(new_computed_blocks)
            ids.extend(block.block_id for block in new_computed_blocks)
        if num_needed > 0:
            new_blocks = self.block_pool.get_new_blocks(num_needed)
            table.extend(new_blocks)
            ids.extend(block.block_id for block in new_blocks)
        # Only blocks full of the request's own tokens: proposed tokens may be rejected.
        first_full = num_computed // self.block_size
        end_full = min(num_tokens, request.num_tokens) // self.block_size
        if self.enable_prefix_caching and end_full > first_full:
            # Blocks before num_computed were published when their tokens were scheduled. A block
            # is published as soon as it is allocated full, before the step computes it: the
            # runner writes every new token's KV before any attention reads, so a request that
            # hits it in the same step reads it written.
            self.block_pool.cache_full_blocks(table, self._request_block_hashes(request),
                                              first_full, end_full)
        return ids[:]

    def roll_back_proposed(self, request: Request, num_computed_before: int) -> None:
        """After a step that checked proposed tokens, `request.num_computed_tokens` now counting
        only the accepted ones: free the blocks past its computed tokens (they held rejected
        tokens only), and publish the blocks its accepted tokens filled."""
        table = self.block_tables[request.request_id]
        ids = self.block_id_tables[request.request_id]
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(table) > keep:
            dropped = table[keep:]
            del table[keep:], ids[keep:]
            self.block_pool.free_blocks(reversed(dropped))
        first_full = num_computed_before // self.block_size
        end_full = request.num_computed_tokens // self.block_size
        if self.enable_prefix_caching and end_full > first_full:
            self.block_pool.cache_full_blocks(table, self._request_block_hashes(request),
                                              first_full, end_full)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after a failed step, whose published blocks may hold
        half-written KV); blocks stay where they are, only their hashes go."""
        for block in self.block_pool.cached_block_hash_to_block.values():
            block.block_hash = None
        self.block_pool.cached_block_hash_to_block.clear()

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first; its cached blocks stay hittable until
        evicted. A no-op for a request that holds none."""
        self.block_pool.free_blocks(reversed(self.block_tables.pop(request.request_id, [])))
        self.block_id_tables.pop(request.request_id, None)
        self.block_hashes.pop(request.request_id, None)

    def check_invariants(self) -> None:
        """Raise AssertionError unless ref counts, free list and hash map agree."""
        pool = self.block_pool
        holders = [0] * pool.num_blocks
        for request_id, table in self.block_tables.items():
            assert len({id(b) for b in table}) == len(table), f"{request_id} holds a block twice"
            for block in table:
                holders[block.block_id] += 1
            assert self.block_id_tables.get(request_id) == [b.block_id for b in table], \
                f"{request_id}: block ids differ from its table"
        assert self.block_id_tables.keys() == self.block_tables.keys(), "id tables != tables"
        free_ids = [block.block_id for block in pool.free_block_queue]
        assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks, "free list corrupt"
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id], \
                f"{block}: held by {holders[block.block_id]} tables"
            assert (block.ref_cnt == 0) == (block.prev_free is not None), \
                f"{block}: in the free list iff its ref count is 0"
            if block.block_hash is not None:
                assert pool.cached_block_hash_to_block.get(block.block_hash) is block, \
                    f"{block}: hashed but not in the hash map"
        assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        assert pool.num_shared_blocks == sum(1 for b in pool.blocks if b.ref_cnt > 1), \
            "shared block count wrong"
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"{block}: hash map entry points to it wrongly"
