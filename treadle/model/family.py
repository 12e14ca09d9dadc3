"""What a model family provides to the loader, the registry and the runner.

A family (treadle/model/models/<family>.py) defines a `ModelSpec` subclass read from config.json,
a model class built from weights under Hugging Face names, and one `ModelFamily` naming both with
the names it is registered by and its GGUF tensor mapping. treadle/model/registry.py lists the
families.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from treadle.model.source import ModelLoadError

# GGUF tensor names (llama.cpp) shared by the families → Hugging Face names; `{}` is the layer.
GGUF_COMMON_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.attn_q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "blk.{}.attn_k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Hyperparameters every decoder has; a family's subclass adds its own."""

    architecture: str  # the family's variant (config.json's model_type), e.g. "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def context_limit(self) -> int:
        """The longest sequence the model serves."""
        return self.max_position_embeddings

    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: attend only to the last that many positions, or None (whole context)."""
        return (None,) * self.num_layers

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model needs, under its Hugging Face name, with its shape."""
        raise NotImplementedError

    def num_parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.expected_shapes().values())

    def active_parameters(self) -> int:
        """Parameters one token runs through (a mixture of experts: only its chosen ones)."""
        return self.num_parameters()

    def attention_break_even(self) -> int:
        """The context (positions) at which a prompt token's attention, 4 FLOPs a position,
        query head and head dimension (scores and weighted values), costs as many as its
        matmuls, 2 a parameter it runs through less the embedding table and output head (a
        prompt token needs no logits); 0 where that leaves none (a toy model of a large
        vocabulary). Sliding-window layers attend less than this counts."""
        vocabulary_tables = 1 if self.tie_word_embeddings else 2
        matmul_parameters = self.active_parameters() \
            - vocabulary_tables * self.vocab_size * self.hidden_size
        if matmul_parameters <= 0:
            return 0
        return max(1, 2 * matmul_parameters // (4 * self.num_layers * self.num_heads
                                                * self.head_dim))


def common_spec_fields(cfg: dict, generation_config: dict | None) -> dict[str, Any]:
    """ModelSpec's own fields from config.json (and generation_config.json), checked."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in cfg:
            raise ModelLoadError(f"config.json lacks {key!r}")
    num_heads = cfg["num_attention_heads"]
    gen = generation_config or {}
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
    )


def decoder_shapes(spec: ModelSpec, norms: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """The tensors of a Llama-shaped decoder (embedding, q/k/v/o, gated MLP, final norm) plus
    each layer's `norms` (hidden-sized, named under the layer)."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + norm + ".weight": (h,) for norm in norms}
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (spec.intermediate_size, h),
            p + "mlp.up_proj.weight": (spec.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, spec.intermediate_size),
        }
    return shapes


# fix(hf_name, rows, spec, dequantized): a GGUF tensor's rows (floats, or quantized blocks as
# bytes when `dequantized` is False) as the family's model reads them under `hf_name`.
GGUFFix = Callable[[str, np.ndarray, ModelSpec, bool], np.ndarray]


@dataclass(frozen=True)
class ModelFamily:
    """One family's entry in the registry."""

    name: str
    hf_architectures: dict[str, str]  # config.json `architectures` name → model_type (variant)
    gguf_architectures: tuple[str, ...]  # GGUF `general.architecture` values
    spec_from_config: Callable[[dict, dict | None, str], ModelSpec]  # (config, generation, variant)
    model_class: type  # (spec, weights, dtype, max_positions, dense_for_batches) → a DecoderModel
    gguf_tensor_names: dict[str, str]  # GGUF name → Hugging Face name; `{}` is the layer index
    gguf_fix: GGUFFix | None = None  # None: tensors are used as stored
    gguf_ignored_tensors: frozenset[str] = frozenset()
