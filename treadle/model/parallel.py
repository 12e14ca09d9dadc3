"""Tensor parallelism (Megatron's split, as vLLM's): which slice of each weight a rank holds, and
the collectives that join the slices.

- Attention: each rank holds whole KV groups (its KV heads and the query heads that share them):
  q/k/v are column-parallel (their output rows sliced by head), o_proj row-parallel (its input
  columns sliced alike), and one all-reduce sums the ranks' partial outputs. KV heads split as
  evenly as they go: SmolLM2's 3 KV heads (9 query heads) over 2 ranks give 2 groups to rank 0
  and 1 to rank 1 (uneven, but every head is computed once and exactly as without TP). With
  fewer KV heads than ranks, each KV head is replicated on world / num_kv_heads ranks that split
  its query heads between them.
- MLP: gate/up column-parallel, down row-parallel over the intermediate columns (in whole
  32-weight blocks where the size allows, so quantized rows of 32-wide types slice as bytes;
  a 256-wide K-quant slices as bytes where the split falls on its super-blocks); one all-reduce.
- Embedding and LM head split by vocabulary: a rank looks up only its own ids (the others' rows
  are zeros, summed by an all-reduce) and computes the logits of its ids, gathered on rank 0.

Norms (and q/k norms, per head_dim) are replicated. A quantized matrix sliced along its input
dimension off a block boundary is dequantized first (`shard_weight`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from treadle.model.family import ModelSpec
from treadle.model.layers import DecoderModel
from treadle.model.linear import Linear, QuantizedLinear
from treadle.model.quantization import BLOCK, QuantizedWeight, dequantize


@dataclass(frozen=True)
class TensorShard:
    """What one rank of `world_size` holds: ranges of query heads, KV heads, MLP columns and
    vocabulary ids."""

    rank: int
    world_size: int
    heads: range
    kv_heads: range
    intermediate: range
    vocab: range
    vocab_size: int
    vocab_chunk: int  # every rank's vocabulary slice padded to this size for the gather

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The spec as this rank's model and KV cache see it: its own heads and MLP columns (the
        vocabulary stays whole: logits are gathered before anyone reads them)."""
        return replace(spec, num_heads=len(self.heads), num_kv_heads=len(self.kv_heads),
                       intermediate_size=len(self.intermediate))


def check_tensor_parallel(spec: ModelSpec, world_size: int) -> None:
    """ValueError, before any worker starts, if `spec`'s heads cannot be split `world_size`
    ways."""
    heads, kv = spec.num_heads, spec.num_kv_heads
    if world_size > 1 and getattr(spec, "num_experts", 0):
        raise ValueError("tensor parallelism does not split mixture-of-experts layers")
    if world_size > heads:
        raise ValueError(f"tensor_parallel_size {world_size} exceeds the model's {heads} "
                         f"attention heads")
    if world_size > kv and (world_size % kv or (heads // kv) % (world_size // kv)):
        raise ValueError(
            f"tensor_parallel_size {world_size} cannot split the model's {kv} KV heads: with "
            f"fewer KV heads than ranks it must be a multiple of {kv} whose share of a KV "
            f"head's {heads // kv} query heads is whole")


def plan_shard(spec: ModelSpec, rank: int, world_size: int) -> TensorShard:
    check_tensor_parallel(spec, world_size)
    group = spec.num_heads // spec.num_kv_heads  # query heads per KV head
    if spec.num_kv_heads >= world_size:
        kv_heads = even_ranges(spec.num_kv_heads, world_size)[rank]
        heads = range(kv_heads.start * group, kv_heads.stop * group)
    else:  # each KV head replicated on `copies` ranks, which split its query heads
        copies = world_size // spec.num_kv_heads
        kv_head, part = divmod(rank, copies)
        per_rank = group // copies
        kv_heads = range(kv_head, kv_head + 1)
        start = kv_head * group + part * per_rank
        heads = range(start, start + per_rank)
    unit = BLOCK if spec.intermediate_size % BLOCK == 0 else 1
    chunks = even_ranges(spec.intermediate_size // unit, world_size)[rank]
    vocab_chunk = math.ceil(spec.vocab_size / world_size)
    vocab = range(min(rank * vocab_chunk, spec.vocab_size),
                  min((rank + 1) * vocab_chunk, spec.vocab_size))
    return TensorShard(rank, world_size, heads, kv_heads,
                       range(chunks.start * unit, chunks.stop * unit), vocab, spec.vocab_size,
                       vocab_chunk)


def even_ranges(total: int, parts: int) -> list[range]:
    """`total` split into `parts` consecutive ranges whose sizes differ by at most one, the
    larger first."""
    size, extra = divmod(total, parts)
    starts = [r * size + min(r, extra) for r in range(parts + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(parts)]


def shard_weight(name: str, weight: torch.Tensor | QuantizedWeight, shard: TensorShard,
                 head_dim: int) -> torch.Tensor | QuantizedWeight:
    """This rank's copy of weight `name` (a Hugging Face name): a slice of its rows (output
    features, or vocabulary ids) or columns (input features), or the whole for replicated ones
    (norms). The slice is a contiguous copy (the kernels read rows as packed), so the full
    tensor can be freed."""
    def heads(r: range) -> range:
        return range(r.start * head_dim, r.stop * head_dim)

    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return slice_rows(weight, heads(shard.heads))
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return slice_rows(weight, heads(shard.kv_heads))
    if name.endswith("o_proj.weight"):
        return slice_columns(weight, heads(shard.heads))
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return slice_rows(weight, shard.intermediate)
    if name.endswith("down_proj.weight"):
        return slice_columns(weight, shard.intermediate)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return slice_rows(weight, shard.vocab)
    return weight


def slice_rows(weight: torch.Tensor | QuantizedWeight, rows: range
               ) -> torch.Tensor | QuantizedWeight:
    if isinstance(weight, QuantizedWeight):  # rows of blocks are independent
        return QuantizedWeight(weight.qtype, weight.data[rows.start:rows.stop].clone(),
                               weight.in_features)
    return weight[rows.start:rows.stop].clone()


def slice_columns(weight: torch.Tensor | QuantizedWeight, columns: range
                  ) -> torch.Tensor | QuantizedWeight:
    if isinstance(weight, QuantizedWeight):
        width, block_bytes = weight.block_weights, weight.block_bytes
        if columns.start % width or columns.stop % width:  # a block would be cut: as floats
            return dequantize(weight)[:, columns.start:columns.stop].clone(
                memory_format=torch.contiguous_format)
        data = weight.data[:, columns.start // width * block_bytes:
                           columns.stop // width * block_bytes]
        return QuantizedWeight(weight.qtype, data.clone(memory_format=torch.contiguous_format),
                               len(columns))
    return weight[:, columns.start:columns.stop].clone(memory_format=torch.contiguous_format)


class AllReduced:
    """A row-parallel layer: this rank's partial product over its input columns, summed over
    the ranks (the one all-reduce after attention's output projection, and after the MLP)."""

    def __init__(self, linear: Linear | QuantizedLinear) -> None:
        self.linear = linear
        self.numel = linear.numel
        self.nbytes = linear.nbytes
        self.resident_bytes = getattr(linear, "resident_bytes", linear.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y)
        return y


class VocabParallelEmbedding:
    """The embedding rows of this rank's vocabulary slice: a lookup leaves zeros for the other
    ranks' ids, and the all-reduce fills them in (a sum with zeros: exact)."""

    def __init__(self, rows: torch.Tensor | QuantizedWeight, vocab: range) -> None:
        self.rows = rows
        self.vocab = vocab
        self.nbytes = rows.nbytes

    def lookup(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        mine = (input_ids >= self.vocab.start) & (input_ids < self.vocab.stop)
        local = torch.where(mine, input_ids - self.vocab.start, 0)
        rows = self.rows
        hidden = (rows.rows(local).to(dtype) if isinstance(rows, QuantizedWeight)
                  else F.embedding(local, rows))
        hidden = hidden * mine.unsqueeze(-1).to(dtype)
        dist.all_reduce(hidden)
        return hidden


class VocabGatheredHead:
    """The LM head of this rank's vocabulary slice: its logits gathered on rank 0 into the
    whole vocabulary (other ranks get their own slice back: only rank 0's logits are read)."""

    def __init__(self, linear: Linear | QuantizedLinear, shard: TensorShard) -> None:
        self.linear = linear
        self.shard = shard
        self.numel = linear.numel
        self.nbytes = linear.nbytes
        self.resident_bytes = getattr(linear, "resident_bytes", linear.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shard = self.shard
        logits = self.linear(x)
        padded = F.pad(logits, (0, shard.vocab_chunk - logits.shape[1])).contiguous()
        if shard.rank != 0:
            dist.gather(padded, dst=0)
            return logits
        parts = [torch.empty_like(padded) for _ in range(shard.world_size)]
        dist.gather(padded, parts, dst=0)
        return torch.cat(parts, dim=1)[:, :shard.vocab_size]


def parallelize(model: DecoderModel, shard: TensorShard) -> None:
    """Joins the slices of a model built from `shard_weight`'s weights and `local_spec`: the
    vocabulary-parallel embedding and LM head, the all-reduces after o_proj and down_proj."""
    model.embed = VocabParallelEmbedding(model.embed, shard.vocab)
    model.lm_head = VocabGatheredHead(model.lm_head, shard)
    for layer in model.layers:
        layer["o"] = AllReduced(layer["o"])
        layer["down"] = AllReduced(layer["down"])
