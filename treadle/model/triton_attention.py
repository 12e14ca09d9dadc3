"""Paged decode attention on CUDA, in Triton: one query token per sequence over its cache blocks.

The same contract as the native CPU kernel (csrc/paged_attention.cpp) and the torch reference
(`attention.decode_attention`'s fallback): q [seqs, heads, dim]; the cache
[num_blocks, block_size, kv_heads, dim]; each sequence's block table row and context length;
with `window` > 0 only the last `window` positions are seen.

One program per (sequence, KV head) computes the query heads that share that KV head, so each
key and value is read once for its whole group. It walks the context in tiles of positions,
finds each position's block through the table (any block size), and keeps an online softmax in
float32. The launch takes no host-side reads of the lengths, so a decode step that calls it can
be captured as a CUDA graph.

Imported only where it runs (a CUDA device, or the tests under TRITON_INTERPRET=1, Triton's
interpreter on the CPU): `triton.jit` picks compiled or interpreted code when it decorates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of the [group, tile, dim] products a program holds at once: tiles shrink as heads
# and dims grow, so registers do not spill (SmolLM2: group 4 x dim 64 -> tiles of 32).
PRODUCT_ELEMENTS = 8192
MAX_TILE = 64
# Positions per split of a context: a sequence's context is cut into splits computed by
# separate programs and merged by a second kernel (flash decoding), so a small batch still
# fills the GPU (batch 1 of SmolLM2 is 3 programs unsplit, 3 per 256 positions split).
SPLIT_POSITIONS = 256


@triton.jit
def _paged_decode(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, max_ptr, sum_ptr, scale,
                  stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_ts, stride_os,
                  stride_oh, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
                  GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                  TILE: tl.constexpr, WINDOW: tl.constexpr, SPLITS: tl.constexpr):
    """Split `program_id(2)` of one (sequence, KV head): with one split the normalized
    output; with several, each split's unnormalized sums, its max and its total into
    out / max / sum [seqs, heads, splits(, dim)] for `_merge_splits`."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + seq)
    first = context_len * 0
    if WINDOW > 0:
        first = tl.maximum(context_len - WINDOW, 0)
    end = context_len
    if SPLITS > 1:
        first = tl.maximum(first, split * SPLIT_POSITIONS)
        end = tl.minimum(context_len, (split + 1) * SPLIT_POSITIONS)

    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    head_ok = group < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + group
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32) * scale

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    # A while loop, not a range over loaded values: Triton's interpreter cannot index with
    # those under numpy 2 (its scalars are 1-element arrays).
    start = first // TILE * TILE
    while start < end:
        pos = start + tl.arange(0, TILE)
        seen = (pos >= first) & (pos < end)
        block = tl.load(tables_ptr + seq * stride_ts + pos // BLOCK_SIZE, mask=seen, other=0)
        offsets = block * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        kv_mask = seen[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + offsets[:, None] + dims[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [group, tile]
        scores = tl.where(seen[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A tile wholly before the window's first position leaves the max at -inf: subtract 0
        # there rather than -inf - -inf.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        weights = tl.exp(scores - safe_max[:, None])
        rescale = tl.exp(running_max - safe_max)
        total = total * rescale + tl.sum(weights, axis=1)
        v = tl.load(v_ptr + offsets[:, None] + dims[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max
        start += TILE
    head_mask = head_ok[:, None] & dim_ok[None, :]
    if SPLITS > 1:  # a split past the context or before the window leaves max -inf, total 0
        row = (seq * GROUP * tl.num_programs(1) + heads) * SPLITS + split
        tl.store(out_ptr + row[:, None] * DIM_PAD + dims[None, :], acc, mask=head_mask)
        tl.store(max_ptr + row, running_max, mask=head_ok)
        tl.store(sum_ptr + row, total, mask=head_ok)
    else:
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask)


@triton.jit
def _merge_splits(part_ptr, max_ptr, sum_ptr, out_ptr, stride_os, stride_oh,
                  HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS: tl.constexpr,
                  SPLITS_PAD: tl.constexpr):
    """One (sequence, head): its splits' sums rescaled to the largest max, then normalized."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    inside = splits < SPLITS
    row = (seq * tl.num_programs(1) + head) * SPLITS + splits
    maxes = tl.load(max_ptr + row, mask=inside, other=float("-inf"))
    largest = tl.max(maxes, axis=0)
    largest = tl.where(largest == float("-inf"), 0.0, largest)
    scales = tl.where(inside, tl.exp(maxes - largest), 0.0)
    total = tl.sum(tl.load(sum_ptr + row, mask=inside, other=0.0) * scales, axis=0)
    parts = tl.load(part_ptr + row[:, None] * DIM_PAD + dims[None, :], mask=inside[:, None],
                    other=0.0)
    out = tl.sum(parts * scales[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int = 0, max_context_len: int = 0,
                           k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q [seqs, heads, dim] -> [seqs, heads, dim]; block_tables [seqs, max_blocks] and
    context_lens [seqs] on q's device. The number of splits follows `max_context_len` (0: the
    tables' width), not the lengths, so that a captured CUDA graph's launch fits every replay,
    and a step splits alike whatever its tables' width. Caches in q's dtype only: `k_scales`,
    `v_scales` (an int8 cache's) are refused, as the runner refuses int8 KV on CUDA."""
    if k_scales is not None or v_scales is not None or k_cache.dtype != q.dtype:
        raise ValueError(f"the Triton decode kernel reads a KV cache in the queries' dtype "
                         f"({q.dtype}), not {k_cache.dtype}: an int8 KV cache is CPU-only")
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    # Blocks, slots and heads at any strides (the CPU's cache: every layer's block together)
    if not (k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()):
        raise ValueError("paged decode attention needs key and value caches of one layout, "
                         "each head's vector contiguous")
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    dim_pad = triton.next_power_of_2(head_dim)
    tile = max(1, min(MAX_TILE, PRODUCT_ELEMENTS // (group_pad * dim_pad)))
    tile = 1 << (tile.bit_length() - 1)  # a power of two, as tl.arange needs
    splits = triton.cdiv(max_context_len or block_tables.shape[1] * block_size,
                         SPLIT_POSITIONS)
    if splits > 1:
        parts = torch.empty(num_seqs, num_heads, splits, dim_pad, dtype=torch.float32,
                            device=q.device)
        maxes = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxes)
    else:
        parts, maxes, sums = out, out, out  # unused
    _paged_decode[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, parts if splits > 1 else out, maxes,
        sums, scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        DIM_PAD=dim_pad, TILE=tile, WINDOW=window, SPLITS=splits)
    if splits > 1:
        _merge_splits[(num_seqs, num_heads)](
            parts, maxes, sums, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
            DIM_PAD=dim_pad, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits))
    return out
