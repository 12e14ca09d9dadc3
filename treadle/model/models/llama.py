"""The Llama family: Llama (incl. llama3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k
RMSNorm), SmolLM; tied or untied embeddings.

The model runs over one flattened batch of tokens from many sequences. Weights arrive under
Hugging Face names; q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from treadle.model.attention import AttentionMetadata, KVCache
from treadle.model.family import (
    GGUF_COMMON_TENSOR_NAMES,
    ModelFamily,
    ModelSpec,
    common_spec_fields,
    decoder_shapes,
)
from treadle.model.kernels import llama_decoder_class
from treadle.model.layers import (
    DecoderModel,
    Layer,
    Rotary,
    default_rope_frequencies,
    embed_tokens,
    rms_norm,
    self_attention,
    silu_and_mul,
)
from treadle.model.linear import Linear, QuantizedLinear, make_linear
from treadle.model.quantization import QuantizedWeight
from treadle.model.source import ModelLoadError


@dataclass(frozen=True, kw_only=True)
class LlamaSpec(ModelSpec):
    rope_theta: float
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    rope_scaling: dict = field(default_factory=dict)  # llama3: factor, low/high_freq_factor, ...
    sliding_window: int | None = None  # not served as a window: the context stays inside it

    @property
    def context_limit(self) -> int:
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = decoder_shapes(self, ("input_layernorm", "post_attention_layernorm"))
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for i in range(self.num_layers):
            p = f"model.layers.{i}.self_attn."
            if self.qkv_bias:
                shapes |= {p + "q_proj.bias": (q,), p + "k_proj.bias": (kv,),
                           p + "v_proj.bias": (kv,)}
            if self.qk_norm:
                shapes |= {p + "q_norm.weight": (self.head_dim,),
                           p + "k_norm.weight": (self.head_dim,)}
        return shapes


def spec_from_config(cfg: dict, generation_config: dict | None, variant: str) -> LlamaSpec:
    # transformers 5 writes rope settings to `rope_parameters`; older configs use
    # `rope_theta` plus `rope_scaling`.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ModelLoadError(f"unsupported rope scaling type {rope_type!r}")
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return LlamaSpec(
        architecture=variant,
        **common_spec_fields(cfg, generation_config),
        rope_theta=rope_theta,
        qkv_bias=variant == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=variant == "qwen3",
        rope_scaling=rope if rope_type == "llama3" else {},
        sliding_window=sliding,
    )


def rope_inverse_frequencies(spec: LlamaSpec) -> torch.Tensor:
    """As transformers computes them, llama3 frequency scaling included."""
    inv_freq = default_rope_frequencies(spec.head_dim, spec.rope_theta)
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


class LlamaModel(DecoderModel):
    """Weights and the forward pass; holds no per-request state."""

    def __init__(self, spec: LlamaSpec, weights: dict[str, torch.Tensor | QuantizedWeight],
                 dtype: torch.dtype, max_positions: int, dense_for_batches: bool = False
                 ) -> None:
        self.spec = spec
        self.dtype = dtype
        self.scale = spec.head_dim ** -0.5
        self.tied = spec.tie_word_embeddings
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
                **self.feed_forward_weights(w, i, linear),
            })
        self.rotary = Rotary(rope_inverse_frequencies(spec), max_positions, dtype)

    def feed_forward_weights(self, w: dict[str, torch.Tensor | QuantizedWeight], i: int,
                             linear: Callable[..., Linear | QuantizedLinear]) -> Layer:
        """Layer `i`'s MLP: gate/up fused, down."""
        p = f"model.layers.{i}.mlp."
        return {"gate_up": linear([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]]),
                "down": linear([w[p + "down_proj.weight"]])}

    def feed_forward(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        return layer["down"](silu_and_mul(layer["gate_up"](x)))

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.spec.rms_norm_eps)

    def qk_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Qwen3's q/k RMSNorm: over each head of x [tokens, heads, head_dim]."""
        return self.norm(x, weight)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      attention: dict[int | None, AttentionMetadata], kv_cache: KVCache
                      ) -> torch.Tensor:
        """See `DecoderModel.hidden_states` (here only window None: every layer is global)."""
        spec, meta = self.spec, attention[None]
        rope = self.rotary.at(positions)
        hidden = embed_tokens(self.embed, input_ids, self.dtype)
        int8 = kv_cache.dtype == torch.int8
        if self.fused_decode(meta, hidden):
            return self.native_decoder.forward(
                hidden, *rope, kv_cache.keys, kv_cache.values,
                kv_cache.key_scales if int8 else [], kv_cache.value_scales if int8 else [],
                meta.slot_mapping,
                meta.decode_block_tables, meta.decode_context_lens,
                self.lora.row_slots if self.lora_in_step() else None)
        for i, layer in enumerate(self.layers):
            residual = hidden
            x = self.norm(hidden, layer["input_norm"])
            hidden = residual + self_attention(
                layer, x, rope, kv_cache, i, meta, spec.num_heads,
                spec.num_kv_heads, spec.head_dim, self.scale, qk_norm=self.qk_norm)
            residual = hidden
            x = self.norm(hidden, layer["post_norm"])
            hidden = residual + self.feed_forward(layer, x)
        return hidden

    def fused_decode(self, meta: AttentionMetadata, hidden: torch.Tensor) -> bool:
        """Whether this step runs in the native decoder: a step of decode tokens only, few
        enough for every projection to take an integer kernel, whose adapted rows (if any) all
        take `lora_add` in the layers' path too (none in a segment of many rows)."""
        return (meta.decode_block_tables is not None and meta.decode_indices is None
                and not meta.prefills and hidden.is_cpu
                and self.native_decoder is not None
                and hidden.shape[0] <= self.native_decoder_rows
                and not (self.lora_in_step() and self.lora.segments))

    @functools.cached_property
    def native_decoder_rows(self) -> float:
        """The most rows a step may have for every projection to take an integer kernel: the
        row kernels up to its `max_gemv_rows`, any number where its batch path is the integer
        GEMM."""
        projections = [base_layer(layer[name]) for layer in self.layers for name in PROJECTIONS]
        return min((p.max_gemv_rows for p in projections if not p.integer_gemm), default=math.inf)

    @functools.cached_property
    def native_decoder(self) -> object | None:
        """The native kernels' `LlamaDecoder` over these layers, where every projection is a
        `QuantizedLinear` with the kernel (not under tensor parallelism, whose all-reduces wrap
        them; not with Qwen3's q/k norms); with LoRA, the adapters' slots too. Built at the first
        decode step, after the runner has set up the layers."""
        decoder_class = llama_decoder_class()
        projections = [base_layer(layer[name]) for layer in self.layers for name in PROJECTIONS]
        if decoder_class is None or self.spec.qk_norm or not all(
                type(p) is QuantizedLinear and p.kernels is not None for p in projections):
            return None
        spec = self.spec
        decoder = decoder_class(spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                spec.rms_norm_eps, self.scale)
        for i, layer in enumerate(self.layers):
            qkv, o, gate_up, down = (base_layer(layer[name]) for name in PROJECTIONS)
            decoder.add_layer(layer["input_norm"], layer["post_norm"], qkv.data, qkv.qtypes,
                              qkv.bias, o.data, o.qtypes, gate_up.data, gate_up.qtypes,
                              down.data, down.qtypes,
                              [p.max_gemv_rows for p in (qkv, o, gate_up, down)])
            adapted = [layer[name] for name in PROJECTIONS]
            if all(base_layer(p) is not p for p in adapted):  # LoRA's wrappers
                decoder.set_lora(i, [p.a for p in adapted], [p.b for p in adapted],
                                 [p.offsets for p in adapted], adapted[0].max_rank)
        return decoder


PROJECTIONS = ("qkv", "o", "gate_up", "down")


def base_layer(layer: object) -> object:
    """The base layer under a LoRA wrapper (model/lora.py), or the layer itself."""
    return getattr(layer, "base", layer)


def unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope) back to Hugging Face's halves."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_fix(hf_name: str, rows: np.ndarray, spec: ModelSpec, dequantized: bool) -> np.ndarray:
    """llama.cpp permutes q/k rows for the archs it converts as "llama" (Llama, Mistral); rows
    un-permute alike as floats or as quantized blocks."""
    if spec.architecture not in ("llama", "mistral"):
        return rows
    if hf_name.endswith("q_proj.weight"):
        return unpermute_rope(rows, spec.num_heads)
    if hf_name.endswith("k_proj.weight"):
        return unpermute_rope(rows, spec.num_kv_heads)
    return rows


GGUF_TENSOR_NAMES = GGUF_COMMON_TENSOR_NAMES | {
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.attn_q.bias": "model.layers.{}.self_attn.q_proj.bias",
    "blk.{}.attn_k.bias": "model.layers.{}.self_attn.k_proj.bias",
    "blk.{}.attn_v.bias": "model.layers.{}.self_attn.v_proj.bias",
}

FAMILY = ModelFamily(
    name="llama",
    hf_architectures={"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                      "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"},
    gguf_architectures=("llama", "mistral", "qwen2", "qwen3"),
    spec_from_config=spec_from_config,
    model_class=LlamaModel,
    gguf_tensor_names=GGUF_TENSOR_NAMES,
    gguf_fix=gguf_fix,
    # llama.cpp computes llama3 rope factors itself; we compute them from config.json.
    gguf_ignored_tensors=frozenset({"rope_freqs.weight"}),
)
