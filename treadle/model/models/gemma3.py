"""Gemma 3 (text): `Gemma3ForCausalLM`, GGUF architecture "gemma3".

What differs from the Llama family: RMSNorm scales by (1 + w), computed in float32; four norms
per block (before and after attention, before and after the MLP); q/k norms; a GELU-tanh gated
MLP; queries scaled by query_pre_attn_scalar ** -0.5; the embedding scaled by sqrt(hidden) in the
model's dtype; tied embeddings; local layers that attend only to the last `sliding_window`
positions, with their own rope base, interleaved with global layers; an optional tanh soft-cap
on the final logits. (config.json's attn_logit_softcapping is a Gemma 2 leftover that
transformers' Gemma 3 ignores: so do we, to give its outputs.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from treadle.model.attention import AttentionMetadata, KVCache
from treadle.model.family import (
    GGUF_COMMON_TENSOR_NAMES,
    ModelFamily,
    ModelSpec,
    common_spec_fields,
    decoder_shapes,
)
from treadle.model.layers import (
    DecoderModel,
    Rotary,
    default_rope_frequencies,
    embed_tokens,
    rms_norm,
    self_attention,
)
from treadle.model.linear import make_linear
from treadle.model.quantization import QuantizedWeight
from treadle.model.source import ModelLoadError

SLIDING, FULL = "sliding_attention", "full_attention"
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm")


@dataclass(frozen=True, kw_only=True)
class Gemma3Spec(ModelSpec):
    rope_theta: float  # global layers
    rope_factor: float  # global layers' linear rope scaling (1: none)
    rope_local_theta: float  # sliding-window layers
    query_pre_attn_scalar: float
    sliding_window: int | None
    sliding_layers: tuple[bool, ...]  # per layer: a local (sliding-window) layer
    final_logit_softcapping: float | None = None

    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.sliding_window if sliding else None for sliding in self.sliding_layers)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = decoder_shapes(self, NORMS)
        for i in range(self.num_layers):
            p = f"model.layers.{i}.self_attn."
            shapes |= {p + "q_norm.weight": (self.head_dim,), p + "k_norm.weight": (self.head_dim,)}
        return shapes


def rope_of(cfg: dict, layer_type: str) -> tuple[float, float]:
    """(theta, linear factor) of one layer type: transformers 5's `rope_parameters` per layer
    type, or older configs' `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq`."""
    params = (cfg.get("rope_parameters") or {}).get(layer_type)
    if params is None:
        if layer_type == FULL:
            params = {"rope_theta": cfg.get("rope_theta", 1_000_000.0),
                      **(cfg.get("rope_scaling") or {})}
        else:
            params = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise ModelLoadError(f"unsupported rope scaling type {rope_type!r} for {layer_type}")
    factor = float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0
    return float(params["rope_theta"]), factor


def spec_from_config(cfg: dict, generation_config: dict | None, variant: str) -> Gemma3Spec:
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(f"unsupported Gemma 3 activation {activation!r}")
    if cfg.get("use_bidirectional_attention") or cfg.get("attention_bias"):
        raise ModelLoadError("Gemma 3 with bidirectional attention or attention biases is not "
                             "supported")
    num_layers = cfg.get("num_hidden_layers", 0)
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # configs before transformers 4.53: every n-th layer is global
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(layer_types) != num_layers or set(layer_types) - {SLIDING, FULL}:
        raise ModelLoadError(f"config.json's layer_types {layer_types!r} do not name "
                             f"{num_layers} layers of {SLIDING!r} or {FULL!r}")
    if SLIDING in layer_types and not cfg.get("sliding_window"):
        raise ModelLoadError("config.json has sliding-window layers but no sliding_window")
    rope_theta, rope_factor = rope_of(cfg, FULL)
    rope_local_theta, local_factor = rope_of(cfg, SLIDING)
    if local_factor != 1.0:
        raise ModelLoadError("rope scaling of Gemma 3's sliding-window layers is not supported")
    return Gemma3Spec(
        architecture=variant,
        **common_spec_fields({"tie_word_embeddings": True, **cfg}, generation_config),
        rope_theta=rope_theta,
        rope_factor=rope_factor,
        rope_local_theta=rope_local_theta,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        sliding_window=cfg.get("sliding_window"),
        sliding_layers=tuple(t == SLIDING for t in layer_types),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


class Gemma3Model(DecoderModel):
    """Weights and the forward pass; holds no per-request state."""

    def __init__(self, spec: Gemma3Spec, weights: dict[str, torch.Tensor | QuantizedWeight],
                 dtype: torch.dtype, max_positions: int, dense_for_batches: bool = False
                 ) -> None:
        self.spec = spec
        self.dtype = dtype
        self.scale = spec.query_pre_attn_scalar ** -0.5
        self.tied = spec.tie_word_embeddings
        w = weights
        linear = functools.partial(make_linear, dtype=dtype, dense_for_batches=dense_for_batches)
        self.embed = w["model.embed_tokens.weight"]  # a float tensor or quantized blocks
        # sqrt(hidden) rounded to the model's dtype, as transformers scales the embedding.
        self.embed_scale = torch.tensor(spec.hidden_size ** 0.5).to(dtype)
        self.lm_head = linear([self.embed if spec.tie_word_embeddings else w["lm_head.weight"]])
        self.final_norm = norm_weight(w["model.norm.weight"])
        self.windows = spec.layer_windows()
        self.layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            self.layers.append({
                "input_norm": norm_weight(w[p + "input_layernorm.weight"]),
                "post_attn_norm": norm_weight(w[p + "post_attention_layernorm.weight"]),
                "pre_ff_norm": norm_weight(w[p + "pre_feedforward_layernorm.weight"]),
                "post_ff_norm": norm_weight(w[p + "post_feedforward_layernorm.weight"]),
                "qkv": linear([w[attn + "q_proj.weight"], w[attn + "k_proj.weight"],
                               w[attn + "v_proj.weight"]]),
                "q_norm": norm_weight(w[attn + "q_norm.weight"]),
                "k_norm": norm_weight(w[attn + "k_norm.weight"]),
                "o": linear([w[attn + "o_proj.weight"]]),
                "gate_up": linear([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                "down": linear([w[p + "mlp.down_proj.weight"]]),
            })
        global_freq = default_rope_frequencies(spec.head_dim, spec.rope_theta) / spec.rope_factor
        # Keyed by window, as the step's attention metadata: global layers (None) and local ones.
        self.rotary = {None: Rotary(global_freq, max_positions, dtype)}
        if any(spec.sliding_layers):
            self.rotary[spec.sliding_window] = Rotary(
                default_rope_frequencies(spec.head_dim, spec.rope_local_theta), max_positions,
                dtype)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.spec.rms_norm_eps, scale_in_float32=True)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      attention: dict[int | None, AttentionMetadata], kv_cache: KVCache
                      ) -> torch.Tensor:
        """See `DecoderModel.hidden_states`."""
        spec = self.spec
        ropes = {window: rotary.at(positions) for window, rotary in self.rotary.items()}
        hidden = embed_tokens(self.embed, input_ids, self.dtype) * self.embed_scale
        for i, layer in enumerate(self.layers):
            window = self.windows[i]
            x = self.norm(hidden, layer["input_norm"])
            x = self_attention(layer, x, ropes[window], kv_cache, i,
                               attention[window], spec.num_heads, spec.num_kv_heads,
                               spec.head_dim, self.scale, qk_norm=self.norm)
            hidden = hidden + self.norm(x, layer["post_attn_norm"])
            x = self.norm(hidden, layer["pre_ff_norm"])
            gate, up = layer["gate_up"](x).chunk(2, dim=-1)
            x = layer["down"](F.gelu(gate, approximate="tanh") * up)
            hidden = hidden + self.norm(x, layer["post_ff_norm"])
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.spec.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm scales by (1 + w), in float32: computed once here."""
    return 1.0 + weight.float()


def gguf_fix(hf_name: str, rows: np.ndarray, spec: ModelSpec, dequantized: bool) -> np.ndarray:
    """llama.cpp stores Gemma's norm weights as 1 + w; back to Hugging Face's w."""
    if dequantized and hf_name.endswith("norm.weight"):
        return rows - 1.0
    return rows


FAMILY = ModelFamily(
    name="gemma3",
    hf_architectures={"Gemma3ForCausalLM": "gemma3_text"},
    gguf_architectures=("gemma3",),
    spec_from_config=spec_from_config,
    model_class=Gemma3Model,
    gguf_tensor_names=GGUF_COMMON_TENSOR_NAMES | {
        "blk.{}.post_attention_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
        "blk.{}.ffn_norm.weight": "model.layers.{}.pre_feedforward_layernorm.weight",
        "blk.{}.post_ffw_norm.weight": "model.layers.{}.post_feedforward_layernorm.weight",
    },
    gguf_fix=gguf_fix,
)
