"""Paged decode attention, native kernel, Triton kernel (interpreted on the CPU, compiled on a
GPU) and torch fallback, against attention computed naively
per sequence in float64 over each sequence's own tokens (the last `window` of them for
sliding-window layers, whose blocks before the window must not even be read)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import on_triton_device

from treadle.model import attention, kernels


def naive_attention(q, k_cache, v_cache, tables, lens, scale, window=None):
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for s, (table, n) in enumerate(zip(tables.tolist(), lens.tolist(), strict=True)):
        first = 0 if window is None else max(0, n - window)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(first, n)]
        keys = k_cache.flatten(0, 1)[slots].double()  # [n, Hkv, D]
        values = v_cache.flatten(0, 1)[slots].double()
        for h in range(q.shape[1]):
            scores = keys[:, h // group] @ q[s, h].double() * scale
            out[s, h] = scores.softmax(0) @ values[:, h // group]
    return out


def in_cache_layout(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Keys and values [blocks, ...] as layer 1 of 3 in KVCache's CPU layout ([blocks, layers,
    2, ...]: each block's keys beside its values, every layer's block b together), the other
    layers' blocks holding NaN (int8: 127), so a read that strays shows."""
    fill = float("nan") if keys.is_floating_point() else 127
    blocks = torch.full((keys.shape[0], 3, 2, *keys.shape[1:]), fill, dtype=keys.dtype)
    blocks[:, 1, 0], blocks[:, 1, 1] = keys, values
    return blocks[:, 1, 0], blocks[:, 1, 1]


@pytest.mark.parametrize("window", [None, 1, 3, 6, 40])
# queries' and cache's dtypes: the model's, or a bfloat16 cache under a float32 model (the CPU's)
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32),
                                                (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("path, head_dim", [("native", 16), ("torch", 16), ("triton", 16),
                                            # native: 3, 4 + 1 vectors a head, or not whole
                                            ("native", 24), ("native", 40), ("native", 12)])
def test_decode_attention_matches_naive(dtype, cache_dtype, path, head_dim, window, monkeypatch,
                                        request):
    if path == "triton" and cache_dtype != dtype:
        pytest.skip("CUDA keeps the cache in the model's dtype")
    if path == "native" and kernels.paged_decode_attention() is None:
        pytest.skip("native kernel unavailable")
    if path == "torch":
        monkeypatch.setattr(attention, "paged_decode_attention", lambda device: None)
    if path == "triton":
        triton_kernel = on_triton_device(
            request.getfixturevalue("triton_attention").paged_decode_attention)
        monkeypatch.setattr(attention, "paged_decode_attention", lambda device: triton_kernel)
    gen = torch.Generator().manual_seed(0)
    block_size, num_blocks, num_kv_heads, heads = 4, 64, 3, 9
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim,
                                    generator=gen).to(cache_dtype) for _ in range(2))
    k_cache, v_cache = in_cache_layout(k_cache, v_cache)
    lens = torch.tensor([1, 4, 5, 17, 30])
    max_blocks = 8
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * max_blocks].view(-1, max_blocks)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    expected = naive_attention(q, k_cache, v_cache, tables, lens, 0.25, window)
    if window is not None:  # blocks wholly before a window: NaN shows if they are read
        for table, n in zip(tables.tolist(), lens.tolist(), strict=True):
            for b in table[:max(0, n - window) // block_size]:
                k_cache[b] = v_cache[b] = float("nan")
    meta = attention.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), decode_indices=None,
        decode_block_tables=tables, decode_context_lens=lens, prefills=[], window=window)
    out = attention.decode_attention(q, k_cache, v_cache, meta, scale=0.25)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - expected).abs().max().item() < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, num_kv_heads", [(4, 4), (8, 4), (8, 2), (10, 2), (14, 2),
                                                 (8, 1)])
# 16 and 64: AVX-512 BF16's pairs where the CPU has them (one and four 16-lane chunks a head)
@pytest.mark.parametrize("head_dim", [16, 40, 64])
@pytest.mark.parametrize("tables_of", ["scattered", "consecutive"])
def test_query_heads_sharing_a_kv_head_in_any_number(dtype, heads, num_kv_heads, head_dim,
                                                     tables_of):
    """The native kernel takes a KV head's query heads in passes of 3 or 2: groups of 1, 2, 4
    (2 + 2), 5 (3 + 2), 7 (3 + 3 + 1) and 8 (2 + 2 + 2 + 2), positions past a multiple of 4,
    heads of 2 and of 4 + 1 vectors; it copies runs of slots out first, blocks scattered or
    one after another."""
    if kernels.paged_decode_attention() is None:
        pytest.skip("native kernel unavailable")
    gen = torch.Generator().manual_seed(2)
    block_size, num_blocks = 4, 64
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 6, 31])
    blocks = (torch.randperm(num_blocks, generator=gen) if tables_of == "scattered"
              else torch.arange(num_blocks))
    tables = blocks[:len(lens) * 8].view(-1, 8)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    meta = attention.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), decode_indices=None,
        decode_block_tables=tables, decode_context_lens=lens, prefills=[])
    out = attention.decode_attention(q, k_cache, v_cache, meta, scale=0.25)
    expected = naive_attention(q, k_cache, v_cache, tables, lens, 0.25)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - expected).abs().max().item() < tolerance


@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["native", "triton"])
def test_long_contexts_split_into_tasks_merge_exactly(dtype, window, path, monkeypatch, request):
    """The native kernel splits a sequence's positions into tasks of 128 and merges them, the
    Triton kernel walks them in tiles: contexts at, just past and well past a task's end (and a
    window ending inside a task)."""
    if path == "native" and kernels.paged_decode_attention() is None:
        pytest.skip("native kernel unavailable")
    if path == "triton":
        triton_kernel = on_triton_device(
            request.getfixturevalue("triton_attention").paged_decode_attention)
        monkeypatch.setattr(attention, "paged_decode_attention", lambda device: triton_kernel)
    gen = torch.Generator().manual_seed(1)
    block_size, num_kv_heads, heads, head_dim = 16, 3, 9, 64
    lens = torch.tensor([1, 128, 129, 300, 513])
    max_blocks = 33
    num_blocks = len(lens) * max_blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(len(lens), max_blocks)
    # Scores spread over several units, so that each task's max differs from the sequence's.
    q = (3 * torch.randn(len(lens), heads, head_dim, generator=gen)).to(dtype)
    meta = attention.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), decode_indices=None,
        decode_block_tables=tables, decode_context_lens=lens, prefills=[], window=window)
    out = attention.decode_attention(q, k_cache, v_cache, meta, scale=0.125)
    expected = naive_attention(q, k_cache, v_cache, tables, lens, 0.125, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - expected).abs().max().item() < tolerance
    # A sequence's result depends on it alone: the same sequence alone gives the same bits.
    alone = attention.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), decode_indices=None,
        decode_block_tables=tables[3:4], decode_context_lens=lens[3:4], prefills=[],
        window=window)
    assert torch.equal(attention.decode_attention(q[3:4], k_cache, v_cache, alone, 0.125), out[3:4])
    # Tables twice as wide (a CUDA graph's are max_model_len wide), the same longest context:
    # the same splits, the same bits; a longer longest context only adds empty splits.
    wide = attention.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), decode_indices=None,
        decode_block_tables=torch.cat([tables, tables], dim=1), decode_context_lens=lens,
        prefills=[], window=window, max_context_len=2 * max_blocks * block_size)
    result = attention.decode_attention(q, k_cache, v_cache, wide, 0.125)
    assert (result.double() - expected).abs().max().item() < tolerance
    narrow = replace(wide, decode_block_tables=tables)
    assert torch.equal(attention.decode_attention(q, k_cache, v_cache, narrow, 0.125), result)


@pytest.mark.parametrize("window", [None, 129, 300])
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "bfloat16 under float32", "int8"])
def test_rows_over_one_sequence_s_blocks_keep_the_bits_they_get_alone(cache, window):
    """A verifying step's rows read one sequence's blocks at consecutive lengths (here across a
    task's end): the native kernel takes them part by part, so that a thread finds a part's
    slots copied already, and each row still gets the bits it gets alone (an int8 cache's
    scales too). A window that cuts into a row's context keeps the rows apart."""
    if kernels.paged_decode_attention() is None:
        pytest.skip("native kernel unavailable")
    gen = torch.Generator().manual_seed(4)
    block_size, num_kv_heads, heads, head_dim, num_blocks = 16, 3, 9, 64, 40
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    dtype = torch.bfloat16 if cache in ("bfloat16", "int8") else torch.float32
    if cache == "int8":
        k_cache, v_cache = (torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
                            for _ in range(2))
        k_scales, v_scales = (0.02 * torch.rand(shape[:3], generator=gen) for _ in range(2))
        k_float, v_float = k_cache * k_scales[..., None], v_cache * v_scales[..., None]
        k_cache, v_cache = in_cache_layout(k_cache, v_cache)
        k_scales, v_scales = in_cache_layout(k_scales, v_scales)
    else:
        cache_dtype = torch.float32 if cache == "float32" else torch.bfloat16
        k_cache = k_float = torch.randn(shape, generator=gen).to(cache_dtype)
        v_cache = v_float = torch.randn(shape, generator=gen).to(cache_dtype)
        k_cache, v_cache = in_cache_layout(k_cache, v_cache)
        k_scales = v_scales = None
    shared, other = torch.randperm(num_blocks, generator=gen).view(2, 20)
    lens = torch.tensor([40, 126, 127, 128, 129, 130, 60, 61])
    tables = torch.stack([other] + [shared] * 5 + [other] * 2)
    q = (3 * torch.randn(len(lens), heads, head_dim, generator=gen)).to(dtype)

    def attend(rows: slice) -> torch.Tensor:
        meta = attention.AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.long), decode_indices=None,
            decode_block_tables=tables[rows], decode_context_lens=lens[rows], prefills=[],
            window=window)
        return attention.decode_attention(q[rows], k_cache, v_cache, meta, 0.125, k_scales,
                                          v_scales)

    out = attend(slice(None))
    expected = naive_attention(q, k_float, v_float, tables, lens, 0.125, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - expected).abs().max().item() < tolerance
    for i in range(len(lens)):
        assert torch.equal(attend(slice(i, i + 1)), out[i:i + 1]), i


def naive_prefill(q, keys, values, scale, window=None):
    """Query i at key N - T + i over the keys up to its own (the last `window` of them)."""
    num_queries, num_keys = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(num_queries):
        last = num_keys - num_queries + i
        first = 0 if window is None else max(0, last - window + 1)
        for h in range(q.shape[1]):
            k = keys[first:last + 1, h // group].double()
            v = values[first:last + 1, h // group].double()
            out[i, h] = (k @ q[i, h].double() * scale).softmax(0) @ v
    return out


# queries' and keys' dtypes: the model's, or bfloat16 keys (a cache's) under float32 queries
QUERY_AND_KEY_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                        (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtype, kv_dtype", QUERY_AND_KEY_DTYPES)
@pytest.mark.parametrize("heads, num_kv_heads", [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("head_dim", [16, 40])
@pytest.mark.parametrize("num_keys, window", [(13, None), (30, None), (30, 5), (100, None),
                                              (100, 20)])
def test_prefill_attention_matches_naive(dtype, kv_dtype, heads, num_kv_heads, head_dim,
                                         num_keys, window):
    """The native prefill kernel: a chunk of 13 queries over its own keys (13) or over a
    context before it (30, 100: more key blocks than a tile's rows), causal, with and without a
    sliding window; 13 queries of 1-4 heads a KV head fill tiles of 12 rows and part of one."""
    native = kernels.native_prefill_attention()
    if native is None:
        pytest.skip("native prefill attention unavailable")
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(13, heads, head_dim, generator=gen).to(dtype)
    keys = torch.randn(num_keys, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    values = torch.randn(num_keys, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    out = native(q, keys, values, 0.25, window or 0)
    assert out.shape == q.shape and out.dtype == dtype
    expected = naive_prefill(q, keys, values, 0.25, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - expected).abs().max().item() < tolerance


@pytest.mark.parametrize("dtype, kv_dtype, head_dim", [
    (torch.bfloat16, torch.bfloat16, 64), (torch.bfloat16, torch.bfloat16, 40),
    (torch.bfloat16, torch.bfloat16, 8), (torch.float32, torch.float32, 64),
    (torch.float32, torch.bfloat16, 64)])
@pytest.mark.parametrize("length, start", [(40, 25), (133, 57)])
@pytest.mark.parametrize("window", [None, 7, 33])
def test_prefill_chunks_agree_with_the_whole_prompt_to_the_bit(dtype, kv_dtype, head_dim, length,
                                                                start, window):
    """A prompt's last rows computed as a later chunk (over the keys before it) equal the same
    rows of the whole prompt: each row's sums run over its own keys in order, whatever rows
    share its tile (chunks starting off a tile's and a key block's edge); with a window, also
    over keys cut at an odd position before the chunk's first key, as the runner cuts them at a
    block of an odd size."""
    native = kernels.native_prefill_attention()
    if native is None:
        pytest.skip("native prefill attention unavailable")
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(length, 9, head_dim, generator=gen).to(dtype)
    keys = torch.randn(length, 3, head_dim, generator=gen).to(kv_dtype)
    values = torch.randn(length, 3, head_dim, generator=gen).to(kv_dtype)
    whole = native(q, keys, values, 0.5, window or 0)
    later = native(q[start:], keys, values, 0.5, window or 0)
    assert torch.equal(later, whole[start:])
    first_key = start - window + 1 if window else 0
    if first_key > 0:
        cut = first_key if first_key % 2 else first_key - 1
        later = native(q[start:], keys[cut:], values[cut:], 0.5, window)
        assert torch.equal(later, whole[start:])


@pytest.mark.parametrize("dtype, kv_dtype", QUERY_AND_KEY_DTYPES)
@pytest.mark.parametrize("start, window", [(0, None), (20, None), (20, 6), (0, 6)])
def test_prefill_chunks_through_the_cache_match_the_sdpa_path(dtype, kv_dtype, start, window,
                                                              monkeypatch):
    """`prefill_attention`'s native path against its SDPA path on chunks as the runner builds
    them (ModelRunner.prefill_chunk): a fresh prompt (no mask), a later chunk over cached keys,
    a window whose first block lies past position 0, a fresh prompt longer than its window; a
    bfloat16 cache under float32 queries (a fresh prompt's own keys take its rounding)."""
    if kernels.native_prefill_attention() is None:
        pytest.skip("native prefill attention unavailable")
    gen = torch.Generator().manual_seed(6)
    block_size, heads, num_kv_heads, head_dim, n = 4, 9, 3, 16, 10
    context_len = start + n
    num_blocks = (context_len + block_size - 1) // block_size
    k_all = torch.randn(context_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_all = torch.randn(context_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    padding = num_blocks * block_size - context_len  # block b holds positions 4b .. 4b + 3
    k_cache = torch.cat([k_all, k_all[:padding] * 0]).to(kv_dtype).view(
        num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.cat([v_all, v_all[:padding] * 0]).to(kv_dtype).view(
        num_blocks, block_size, num_kv_heads, head_dim)
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    first_block = 0 if window is None else max(0, start - window + 1) // block_size
    key_start = first_block * block_size
    mask = None
    if start > 0 or (window is not None and n > window):
        keys = torch.arange(key_start, context_len)[None, :]
        queries = torch.arange(start, context_len)[:, None]
        mask = keys <= queries
        if window is not None:
            mask &= keys > queries - window
    chunk = attention.PrefillChunk(start=0, end=n, context_len=context_len,
                                   block_table=torch.arange(first_block, num_blocks), mask=mask,
                                   key_start=key_start)
    args = (q, k_all[start:], v_all[start:], k_cache, v_cache, chunk, 0.25)
    native = attention.prefill_attention(*args, window=window)
    monkeypatch.setattr(attention, "native_prefill_attention", lambda: None)
    reference = attention.prefill_attention(*args, window=window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (native.double() - reference.double()).abs().max().item() < tolerance
    if start == 0:  # the chunk's own keys as the cache holds them
        expected = naive_prefill(q, k_all.to(kv_dtype), v_all.to(kv_dtype), 0.25, window)
        assert (native.double() - expected).abs().max().item() < tolerance
