"""Paged attention over block tables, for decode tokens and prefill chunks in one flattened batch.

The KV cache of a layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]; token
slot s lives at block s // block_size, offset s % block_size. On the CPU they are views into one
mapping of every layer's blocks, each block's slots packed and blocks stride(0) apart (KVCache).
Each step writes the new keys and values into their slots, then every query attends over its own
sequence's blocks.

Decode tokens (one query each) are attended in one batched call over block tables padded to the
longest context; prefill chunks go one sequence at a time (few per step, many tokens each), causal
inside the chunk and full over the context computed before it.

A cache may be stored narrower than the model computes: bfloat16 under a float32 model (the CPU's
default), each read widened back to float32; a chunk's own keys take the stored rounding too.
An int8 cache (`--kv-cache-dtype int8`) stores each new key and value vector as int8 with a
float32 scale per token slot and KV head (absmax / 127 over head_dim, symmetric: llama.cpp's q8_0
at a head's granularity), in scale tensors [num_blocks, block_size, num_kv_heads] beside the
blocks. A scale per slot, not per block, so a token landing in a part-filled block never rescales
the ones before it. Every read sees the stored values: the native decode kernel converts int8
lanes to float itself; the torch path dequantizes the blocks it gathers, and its prefill chunks
attend over the cache even for their own keys, so chunked and whole prefills agree.

Sliding-window layers (Gemma 3's local layers) attend only to the last `window` positions: the
runner builds their own metadata, whose prefill chunks start at the first block inside the window
and whose decode reads (native kernel and torch fallback) skip the blocks before it. The blocks
stay allocated: freeing them is the KV cache manager's business, not done yet.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treadle.model.kernels import native_prefill_attention, paged_decode_attention


@dataclass
class PrefillChunk:
    """Tokens [start, end) of the flattened batch: one sequence's chunk."""

    start: int
    end: int
    context_len: int  # cached tokens before the chunk + the chunk's own
    block_table: torch.Tensor  # [blocks covering positions key_start .. context_len)
    # [chunk, context_len - key_start] bool; None when the chunk is the whole context and each
    # token sees every earlier one (plain causal)
    mask: torch.Tensor | None
    key_start: int = 0  # position of block_table's first slot (> 0: blocks before a window)


@dataclass
class AttentionMetadata:
    """Built once per step by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot of each new token
    decode_indices: torch.Tensor | None  # [num_decodes] positions in the batch; None: all tokens
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long
    decode_context_lens: torch.Tensor | None  # [num_decodes] long
    prefills: list[PrefillChunk]
    window: int | None = None  # decode tokens see only the last `window` positions
    # The longest context any step may hold (max_model_len; 0: the tables' width). The CUDA
    # kernel splits contexts by it, so an eager step and a graph's replay, whose tables differ
    # in width, split alike and give the same bits.
    max_context_len: int = 0
    # Keys and values buffers, [blocks of max_model_len, block_size, kv_heads, head_dim] each in
    # the cache's dtype (None: gather into new tensors): a prefill chunk over a cached context
    # gathers its blocks here, memory every layer and step reuses while it is warm.
    gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None


class KVCache:
    """Preallocated key and value blocks for every layer: `num_blocks` for sequences, and one
    more (`pad_block`) that none owns, which the padding rows of a captured decode step write
    and read (treadle/model/cuda_graphs.py). `dtype` torch.int8: quantized blocks, with
    `key_scales` and `value_scales` per layer; else None there.

    On the CPU every layer's keys and values of block b lie together in one mapping ([blocks,
    layers, 2, block_size, kv_heads, head_dim]); a layer's keys are a view whose blocks lie that
    record apart. The OS commits the mapping's pages as they are written, 2 MB at a time where
    it grants huge pages: so the memory committed follows the blocks used, where a keys and a
    values tensor a layer would each commit a page at the first token (60 for the default
    model)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | None = None) -> None:
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pad_block = num_blocks
        self.dtype = dtype
        if device is None or device.type == "cpu":
            self.keys, self.values = layer_views(lazy_zeros(
                (shape[0], num_layers, 2, *shape[1:]), dtype))
        else:
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device)
                           for _ in range(num_layers)]
        self.key_scales: list[torch.Tensor | None] = [None] * num_layers
        self.value_scales: list[torch.Tensor | None] = [None] * num_layers
        if dtype == torch.int8:
            if device is not None and device.type != "cpu":
                raise ValueError("an int8 KV cache is served on the CPU only")
            self.key_scales, self.value_scales = layer_views(lazy_zeros(
                (shape[0], num_layers, 2, *shape[1:3]), torch.float32))


def layer_views(blocks: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """[blocks, layers, 2, ...] -> each layer's keys and values [blocks, ...]."""
    layers = range(blocks.shape[1])
    return [blocks[:, i, 0] for i in layers], [blocks[:, i, 1] for i in layers]


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectors x [..., head_dim] -> (int8 [..., head_dim], float32 scales [...]): each vector
    over its absmax / 127, rounded to nearest (a zero vector: scale 0, zeros)."""
    x = x.float()
    scales = x.abs().amax(-1) / 127
    divisor = scales.clamp(min=torch.finfo(torch.float32).tiny)[..., None]
    return (x / divisor).round().clamp(-127, 127).to(torch.int8), scales


def dequantize_kv(quantized: torch.Tensor, scales: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """quantize_kv's inverse: int8 [..., head_dim] times scales [...], as `dtype`."""
    return (quantized.float() * scales[..., None]).to(dtype)


def read_blocks(cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor,
                dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The cache's `blocks` (any index shape) in `dtype`: [*blocks.shape, block_size, kv_heads,
    head_dim], dequantized where the cache is int8; gathered into the front of `out` where
    given (1-D `blocks`, `out` in the cache's dtype)."""
    if scales is None:
        if out is None:
            return cache[blocks].to(dtype)
        return torch.index_select(cache, 0, blocks, out=out[:len(blocks)]).to(dtype)
    return dequantize_kv(cache[blocks], scales[blocks], dtype)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros whose pages the OS commits only when written: a private anonymous mapping is fresh
    zero pages (torch.zeros writes every byte: 0.43 s and 1 GiB resident for a 1 GiB cache,
    measured, against 0.3 ms and nothing). Zeros, not torch.empty: the torch decode path reads
    padding slots under a mask, and garbage NaNs there would poison the sums. Huge pages where
    the OS grants them on request (transparent_hugepage "madvise"): decode attention reads a
    sequence's blocks scattered over the cache, and with 4 KiB pages most block reads begin
    with a TLB miss (docs/decisions.md)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # A kernel without transparent huge pages refuses the advice: 4 KiB pages then.
    with contextlib.suppress(OSError):
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux's
            buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def write_slots(cache: torch.Tensor, scales: torch.Tensor | None, x: torch.Tensor,
                slots: torch.Tensor) -> None:
    """x [T, Hkv, D] into the cache's `slots`, in its dtype (quantized where it is int8)."""
    if scales is not None:
        x, x_scales = quantize_kv(x)
        write_rows(scales, x_scales, slots)
    write_rows(cache, x.to(cache.dtype), slots)


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """rows [T, ...] into a cache [blocks, block_size, ...]'s `slots`: a tensor a layer (CUDA)
    by one index_copy_, blocks lying apart (KVCache's CPU layout) by block and offset."""
    if cache.is_contiguous():
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)
        return
    cache[slots // cache.shape[1], slots % cache.shape[1]] = rows  # the runner's: never < 0


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for the batch's new tokens; returns [T, H, D]. `k_scales`,
    `v_scales`: an int8 cache's scales (KVCache), None for a float cache."""
    write_slots(k_cache, k_scales, k, meta.slot_mapping)
    write_slots(v_cache, v_scales, v, meta.slot_mapping)

    if meta.decode_indices is None and not meta.prefills:
        return decode_attention(q, k_cache, v_cache, meta, scale, k_scales, v_scales)
    out = torch.empty_like(q)
    if meta.decode_indices is not None:
        out[meta.decode_indices] = decode_attention(
            q[meta.decode_indices], k_cache, v_cache, meta, scale, k_scales, v_scales)
    for chunk in meta.prefills:
        out[chunk.start:chunk.end] = prefill_attention(
            q[chunk.start:chunk.end], k[chunk.start:chunk.end], v[chunk.start:chunk.end],
            k_cache, v_cache, chunk, scale, k_scales, v_scales, meta.gather_buffers,
            meta.window)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, k_scales: torch.Tensor | None = None,
                     v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence, [num_decodes, H, D]."""
    kernel = paged_decode_attention(q.device.type)
    if kernel is not None:  # reads the blocks in place
        return kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                      scale, meta.window or 0, meta.max_context_len, k_scales, v_scales)
    # Fallback: gather each sequence's blocks, padded to the longest context, and mask. The
    # query heads sharing a KV head lie along SDPA's query axis: no copy of keys per head.
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    first_position = torch.zeros_like(lens)
    if meta.window is not None:  # only the blocks that hold the window's positions
        first_block = (lens - meta.window).clamp(min=0) // block_size
        span = min(tables.shape[1], (meta.window + block_size - 2) // block_size + 1)
        columns = (first_block[:, None] + torch.arange(span, device=lens.device)).clamp(
            max=tables.shape[1] - 1)
        tables = tables.gather(1, columns)
        first_position = first_block * block_size
    keys = read_blocks(k_cache, k_scales, tables, q.dtype).flatten(1, 2).transpose(1, 2)
    values = read_blocks(v_cache, v_scales, tables, q.dtype).flatten(1, 2).transpose(1, 2)
    positions = first_position[:, None] + torch.arange(keys.shape[2], device=lens.device)
    mask = positions < lens[:, None]
    if meta.window is not None:
        mask &= positions >= (lens - meta.window)[:, None]
    query = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask[:, None, None, :],
                                         scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
                      k_scales: torch.Tensor | None = None,
                      v_scales: torch.Tensor | None = None,
                      gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
                      window: int | None = None) -> torch.Tensor:
    """One sequence's chunk: causal inside it, over the context before it (the part its mask
    and block table cover, the last `window` positions of a sliding-window layer); its blocks
    gathered into `gather_buffers` where given."""
    native = (native_prefill_attention() if q.is_cpu and q.shape[-1] % 8 == 0
              and q.dtype in (torch.float32, torch.bfloat16) else None)
    # The native kernel widens a bfloat16 cache's keys itself; the other paths take q's dtype.
    key_dtype = k_cache.dtype if native is not None and k_scales is None else q.dtype
    if chunk.mask is None and k_scales is None:  # the context is this chunk, as stored
        keys, values = k.to(k_cache.dtype).to(key_dtype), v.to(v_cache.dtype).to(key_dtype)
    else:
        num_keys = chunk.context_len - chunk.key_start
        key_buffer, value_buffer = gather_buffers or (None, None)
        keys = read_blocks(k_cache, k_scales, chunk.block_table, key_dtype,
                           key_buffer).flatten(0, 1)[:num_keys]
        values = read_blocks(v_cache, v_scales, chunk.block_table, key_dtype,
                             value_buffer).flatten(0, 1)[:num_keys]
    if native is not None:  # each row summed over its own keys in order: chunks equal the whole
        return native(q, keys, values, scale, window or 0)
    # [batch, heads, tokens, dim]: SDPA's fused kernels (CPU and CUDA) take only that; 3-D
    # inputs run its unfused path.
    query, keys, values = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], \
        values.transpose(0, 1)[None]
    if q.is_cpu:  # the CPU's fused kernel takes KV heads shared by query heads as they are
        # In float32: its bfloat16 sums differ between a causal prompt and the same prompt in
        # masked chunks, float32's agree to the bit.
        out = F.scaled_dot_product_attention(query.float(), keys.float(), values.float(),
                                             attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                             scale=scale, enable_gqa=True).to(q.dtype)
    else:
        group = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(
            query, keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1),
            attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale)
    return out[0].transpose(0, 1)
