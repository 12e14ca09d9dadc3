"""Building blocks the model families share: RMSNorm, rotary tables, the embedding lookup,
self-attention over the paged KV cache, and the weight accounting of a decoder.

A decoder layer is a dict of weights (tensors, `Linear`s, `QuantizedLinear`s or None), so that
the accounting below reads every family's layers alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from treadle.model.attention import AttentionMetadata, KVCache, paged_attention
from treadle.model.kernels import elementwise_kernels, load_kernels
from treadle.model.linear import Linear, QuantizedLinear
from treadle.model.quantization import QuantizedWeight

# A layer's weights by role; a callable is a part with its own forward (experts.SparseMoE).
Layer = dict[str, torch.Tensor | Linear | QuantizedLinear | Callable[[torch.Tensor], torch.Tensor]
             | None]


class LoraBatch:
    """The step's rows by LoRA adapter slot (model/lora.py), read by every wrapped layer: the
    segments (slot, its rows: a slice where they are one run, else their indices); the native
    kernel's rows' slots (-1 for the others; None: no such row) and its module; every row's
    slot (-1: the base), the fused decoder's."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, slice | torch.Tensor]] = []
        self.native_slots: torch.Tensor | None = None
        self.kernels = load_kernels()
        self.row_slots: torch.Tensor | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             scale_in_float32: bool = False) -> torch.Tensor:
    """As transformers computes it: normalized in float32, then scaled by `weight` after the
    cast back to x's dtype (Llama), or before it (`scale_in_float32`: Gemma, whose weight is
    float32). (F.rms_norm is several times slower on CPU.)"""
    kernels = elementwise_kernels(x.device.type)
    if kernels is not None:
        return kernels.rms_norm(x, weight, eps, scale_in_float32)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    if scale_in_float32:
        return (x32 * weight).to(x.dtype)
    return weight * x32.to(x.dtype)


def default_rope_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies as transformers computes them."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


class Rotary:
    """cos/sin tables over positions [0, max_positions) for one set of inverse frequencies."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype) -> None:
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.cos = freqs.cos().to(dtype)
        self.sin = freqs.sin().to(dtype)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] at `positions`, broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope (Hugging Face layout) on [T, heads, D]; cos, sin [T, 1, D/2]."""
    kernels = elementwise_kernels(x.device.type)
    if kernels is not None:
        return kernels.rope(x, cos, sin)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of the last dim times the second (a fused gate/up projection)."""
    kernels = elementwise_kernels(gate_up.device.type)
    if kernels is not None:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class EmbeddingLookup(Protocol):
    """An embedding held elsewhere (a tensor-parallel rank's vocabulary slice,
    model/parallel.py) that looks its rows up itself."""

    def lookup(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


def embed_tokens(embed: torch.Tensor | QuantizedWeight | EmbeddingLookup,
                 input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(embed, QuantizedWeight):
        return embed.rows(input_ids).to(dtype)
    if isinstance(embed, torch.Tensor):
        return F.embedding(input_ids, embed)
    return embed.lookup(input_ids, dtype)


def self_attention(layer: Layer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   kv_cache: KVCache, layer_index: int, meta: AttentionMetadata,
                   num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                   qk_norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                   ) -> torch.Tensor:
    """Fused q/k/v projection, q/k norms (where the layer has them), rope, attention over the
    paged cache (layer `layer_index`'s), output projection. `layer`: "qkv", "o", and
    "q_norm"/"k_norm" or None."""
    num_tokens = x.shape[0]
    qkv = layer["qkv"](x)
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_heads + num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    if layer["q_norm"] is not None:
        qk = torch.cat((qk_norm(qk[:, :num_heads], layer["q_norm"]),
                        qk_norm(qk[:, num_heads:], layer["k_norm"])), dim=1)
    q, k = apply_rope(qk, *rope).split([num_heads, num_kv_heads], dim=1)
    i = layer_index
    attn = paged_attention(q, k, v, kv_cache.keys[i], kv_cache.values[i], meta, scale,
                           kv_cache.key_scales[i], kv_cache.value_scales[i])
    return layer["o"](attn.reshape(num_tokens, num_heads * head_dim))


class DecoderModel:
    """What every family's model holds and reports: `embed`, `lm_head`, `final_norm`, `layers`
    (a list of `Layer` dicts) and whether the embedding is tied to the LM head.

    A family computes `hidden_states` (the residual stream after its last layer) and its `norm`;
    the runner takes the rows it needs, applies the final norm (`final_hidden`, transformers'
    last_hidden_state, which embeddings pool) and the LM head (`logits`) on those rows only."""

    embed: torch.Tensor | QuantizedWeight
    lm_head: Linear | QuantizedLinear
    final_norm: torch.Tensor
    layers: list[Layer]
    tied: bool
    lora: LoraBatch | None = None  # the runner's adapters' rows by slot, with LoRA enabled

    def lora_in_step(self) -> bool:
        """Whether any row of this step has an adapter (CUDA graphs serve the base only)."""
        return self.lora is not None and self.lora.row_slots is not None

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      attention: dict[int | None, AttentionMetadata], kv_cache: KVCache
                      ) -> torch.Tensor:
        """[tokens, hidden] after the last layer, before the final norm, for the flattened
        batch; `attention`: the step's metadata by window (None: global layers)."""
        raise NotImplementedError

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of `hidden_states` after the final norm, in the model's dtype."""
        return self.norm(hidden, self.final_norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of rows of `final_hidden`."""
        return self.lm_head(hidden).float()

    def num_parameters(self) -> int:
        """Parameters read by a decode step (a tied embedding counts once, as the LM head)."""
        count = self.lm_head.numel + self.final_norm.numel()
        for layer in self.layers:
            # Tensors and mixtures of experts count theirs by a method, linear layers hold it.
            count += sum(p.numel() if callable(p.numel) else p.numel
                         for p in layer.values() if p is not None)
        return count

    def expert_layers(self) -> list:
        """The layers' mixtures of experts (`experts.SparseMoE`), if any."""
        return [layer["moe"] for layer in self.layers if layer.get("moe") is not None]

    def quantized_layers(self) -> list[QuantizedLinear]:
        """Every quantized linear layer, experts' included."""
        layers = [self.lm_head, *(p for layer in self.layers for p in layer.values()),
                  *(p for moe in self.expert_layers() for p in moe.parts())]
        return [p for p in layers if isinstance(p, QuantizedLinear)]

    def weight_bytes(self) -> int:
        """Bytes of weights read by a decode step, as stored (quantized blocks as blocks)."""
        count = self.lm_head.nbytes + self.final_norm.nbytes
        for layer in self.layers:
            count += sum(p.nbytes for p in layer.values() if p is not None)
        return count

    def resident_bytes(self) -> int:
        """Bytes of weights held in memory: quantized blocks plus their dense copies, if kept,
        and the embedding (once when tied)."""
        count = getattr(self.lm_head, "resident_bytes", self.lm_head.nbytes)
        count += self.final_norm.nbytes
        if not self.tied:
            count += self.embed.nbytes
        for layer in self.layers:
            count += sum(getattr(p, "resident_bytes", p.nbytes) for p in layer.values()
                         if p is not None)
        return count
