"""Decoder-only transformer of the Llama family: Llama (incl. llama3 rope scaling), Mistral,
Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), SmolLM; tied or untied embeddings.

The model runs over one flattened batch of tokens from many sequences. Weights arrive under
Hugging Face names; q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from treadle.model.attention import AttentionMetadata, KVCache, paged_attention
from treadle.model.linear import Linear, QuantizedLinear, make_linear
from treadle.model.loader import ModelSpec
from treadle.model.quantization import QuantizedWeight


def rope_inverse_frequencies(spec: ModelSpec) -> torch.Tensor:
    """As transformers computes them, llama3 frequency scaling included."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not spec.rope_scaling:
        return inv_freq
    cfg = spec.rope_scaling
    factor = cfg["factor"]
    low_freq_factor = cfg["low_freq_factor"]
    high_freq_factor = cfg["high_freq_factor"]
    old_context_len = cfg["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class LlamaModel:
    """Weights and the forward pass; holds no per-request state."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor | QuantizedWeight],
                 dtype: torch.dtype, max_positions: int, dense_for_batches: bool = False
                 ) -> None:
        self.spec = spec
        self.dtype = dtype
        self.scale = spec.head_dim ** -0.5
        w = weights
        linear = functools.partial(make_linear, dtype=dtype, dense_for_batches=dense_for_batches)
        self.embed = w["model.embed_tokens.weight"]  # a float tensor or quantized blocks
        self.lm_head = linear([self.embed if spec.tie_word_embeddings else w["lm_head.weight"]])
        self.final_norm = w["model.norm.weight"]
        self.layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            qkv_bias = (torch.cat([w[attn + "q_proj.bias"], w[attn + "k_proj.bias"],
                                   w[attn + "v_proj.bias"]]) if spec.qkv_bias else None)
            self.layers.append({
                "input_norm": w[p + "input_layernorm.weight"],
                "post_norm": w[p + "post_attention_layernorm.weight"],
                "qkv": linear([w[attn + "q_proj.weight"], w[attn + "k_proj.weight"],
                               w[attn + "v_proj.weight"]], qkv_bias),
                "q_norm": w.get(attn + "q_norm.weight"),
                "k_norm": w.get(attn + "k_norm.weight"),
                "o": linear([w[attn + "o_proj.weight"]]),
                "gate_up": linear([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                "down": linear([w[p + "mlp.down_proj.weight"]]),
            })
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inverse_frequencies(spec))
        self.rope_cos = freqs.cos().to(dtype)
        self.rope_sin = freqs.sin().to(dtype)

    def num_parameters(self) -> int:
        """Parameters read by a decode step (a tied embedding counts once, as the LM head)."""
        count = self.lm_head.numel + self.final_norm.numel()
        for layer in self.layers:
            count += sum(p.numel if isinstance(p, Linear | QuantizedLinear) else p.numel()
                         for p in layer.values() if p is not None)
        return count

    def quantized_layers(self) -> list[QuantizedLinear]:
        layers = [self.lm_head, *(p for layer in self.layers for p in layer.values())]
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
        if not self.spec.tie_word_embeddings:
            count += self.embed.nbytes
        for layer in self.layers:
            count += sum(getattr(p, "resident_bytes", p.nbytes) for p in layer.values()
                         if p is not None)
        return count

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantizedWeight):
            return self.embed.rows(input_ids).to(self.dtype)
        return F.embedding(input_ids, self.embed)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """As transformers computes it: in float32, scaled by the weight in the model's dtype.
        (F.rms_norm is several times slower on CPU.)"""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half rope (Hugging Face layout) on [T, heads, D]."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, logits_indices: torch.Tensor | None) -> torch.Tensor:
        """Logits (float32) at `logits_indices` of the flattened batch (all tokens if None)."""
        spec = self.spec
        num_tokens = input_ids.shape[0]
        num_q, num_kv, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        hidden = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            residual = hidden
            x = self.rms_norm(hidden, layer["input_norm"])
            qkv = layer["qkv"](x)
            qk = qkv[:, :(num_q + num_kv) * head_dim].view(num_tokens, num_q + num_kv, head_dim)
            v = qkv[:, (num_q + num_kv) * head_dim:].view(num_tokens, num_kv, head_dim)
            if layer["q_norm"] is not None:
                qk = torch.cat((self.rms_norm(qk[:, :num_q], layer["q_norm"]),
                                self.rms_norm(qk[:, num_q:], layer["k_norm"])), dim=1)
            q, k = self.apply_rope(qk, cos, sin).split([num_q, num_kv], dim=1)
            attn = paged_attention(q, k, v, kv_cache.keys[i], kv_cache.values[i], meta, self.scale)
            hidden = residual + layer["o"](attn.reshape(num_tokens, num_q * head_dim))
            residual = hidden
            x = self.rms_norm(hidden, layer["post_norm"])
            gate, up = layer["gate_up"](x).chunk(2, dim=-1)
            hidden = residual + layer["down"](F.silu(gate) * up)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        hidden = self.rms_norm(hidden, self.final_norm)
        return self.lm_head(hidden).float()
