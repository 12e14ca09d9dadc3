"""Find and load model weights, architecture and tokenizer.

Two sources: a Hugging Face folder (config.json, *.safetensors, tokenizer files) and a GGUF file.
Both end as one `LoadedModel`: an architecture spec, a dict of tensors under Hugging Face names,
and a folder holding the tokenizer (with its chat template) and the config.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from treadle.model.quantization import (
    AT_LOAD,
    BLOCK_BYTES,
    QuantizedWeight,
    quantizable,
    quantize,
    resolve_quantization,
)
from treadle.model.source import ModelLoadError, resolve_model

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelSpec:
    """Hyperparameters of a Llama-family decoder, read from config.json."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES' values
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    rope_scaling: dict = field(default_factory=dict)  # llama3: factor, low/high_freq_factor, ...
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict, generation_config: dict | None = None) -> ModelSpec:
        # Configs converted from GGUF carry only model_type, no architectures list.
        archs = cfg.get("architectures") or [cfg.get("model_type")]
        known = [SUPPORTED_ARCHITECTURES.get(a) or a for a in archs
                 if a in SUPPORTED_ARCHITECTURES or a in SUPPORTED_ARCHITECTURES.values()]
        if not known:
            raise ModelLoadError(
                f"unsupported architecture {archs[0]!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        arch = known[0]
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in cfg:
                raise ModelLoadError(f"config.json lacks {key!r}")
        num_heads = cfg["num_attention_heads"]
        # transformers 5 writes rope settings to `rope_parameters`; older configs use
        # `rope_theta` plus `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ModelLoadError(f"unsupported rope scaling type {rope_type!r}")
        gen = generation_config or {}
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            rope_scaling=rope if rope_type == "llama3" else {},
            eos_token_ids=eos_ids,
            bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
            sliding_window=sliding,
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model needs, under its Hugging Face name, with its shape."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (self.intermediate_size, h),
                p + "mlp.up_proj.weight": (self.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, self.intermediate_size),
            }
            if self.qkv_bias:
                shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)}
            if self.qk_norm:
                shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        return shapes


@dataclass
class LoadedModel:
    spec: ModelSpec
    # Hugging Face names: tensors in the requested dtype, or quantized blocks.
    weights: dict[str, torch.Tensor | QuantizedWeight]
    folder: Path  # config.json and tokenizer files
    name: str  # what clients call the model
    quantization: str = "none"  # resolved: none, gguf, int8, int4

    def quantized_types(self) -> dict[str, int]:
        """How many matrices are served in each quantized type."""
        return dict(Counter(w.name for w in self.weights.values()
                            if isinstance(w, QuantizedWeight)))


def load_model(model: str | os.PathLike | None, dtype: torch.dtype,
               quantization: str = "none") -> LoadedModel:
    """Load `model` (an HF folder, a .gguf file, or None for the default model) in `dtype`,
    its matrices quantized as `quantization` says (see treadle/model/quantization.py)."""
    source = resolve_model(model)
    spec = read_spec(source.folder)
    quantization = resolve_quantization(quantization, source.gguf is not None)
    weights = (read_gguf_weights(source.gguf, spec, keep_quantized=quantization == "gguf")
               if source.gguf is not None else read_safetensors_weights(source.folder))
    check_weights(weights, spec)
    expected = spec.expected_shapes()
    at_load = AT_LOAD.get(quantization)
    weights = {k: v if isinstance(v, QuantizedWeight)
               else quantize(v, at_load) if at_load is not None and quantizable(k, v.shape)
               else v.to(dtype)
               for k, v in weights.items() if k in expected}
    return LoadedModel(spec=spec, weights=weights, folder=source.folder, name=source.name,
                       quantization=quantization)


def read_spec(folder: Path) -> ModelSpec:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"missing file {str(config_path)!r}")
    cfg = json.loads(config_path.read_text())
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return ModelSpec.from_hf_config(cfg, gen)


def check_weights(weights: dict[str, torch.Tensor], spec: ModelSpec) -> None:
    for name, shape in spec.expected_shapes().items():
        if name not in weights:
            raise ModelLoadError(f"missing tensor {name!r}")
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}"
            )


def read_safetensors_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"missing shard {str(f)!r} named in {index.name}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {str(folder)!r}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights |= load_file(str(f))
    return weights


# GGUF tensor names (llama.cpp) → Hugging Face names; `{}` is the layer index.
GGUF_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_q.bias": "model.layers.{}.self_attn.q_proj.bias",
    "blk.{}.attn_k.bias": "model.layers.{}.self_attn.k_proj.bias",
    "blk.{}.attn_v.bias": "model.layers.{}.self_attn.v_proj.bias",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.attn_q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "blk.{}.attn_k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}
# llama.cpp computes llama3 rope factors itself; we compute them from config.json.
GGUF_IGNORED_TENSORS = {"rope_freqs.weight"}


def hf_name_for_gguf(name: str) -> str:
    if name in GGUF_TENSOR_NAMES:
        return GGUF_TENSOR_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        template = GGUF_TENSOR_NAMES.get(f"blk.{{}}.{parts[2]}")
        if template:
            return template.format(parts[1])
    raise ModelLoadError(f"unknown GGUF tensor {name!r}")


def unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope) back to Hugging Face's halves."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_weights(path: Path, spec: ModelSpec, keep_quantized: bool = False
                      ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor dequantized to float32, or with `keep_quantized` the matrices in a type the
    quantized kernels serve kept as their blocks (rows un-permuted as bytes)."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    # llama.cpp permutes q/k rows for the archs it converts as "llama" (Llama, Mistral).
    permuted = spec.architecture in ("llama", "mistral")
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for t in reader.tensors:
        if t.name in GGUF_IGNORED_TENSORS:
            continue
        hf_name = hf_name_for_gguf(t.name)
        shape = tuple(reversed([int(s) for s in t.shape]))
        if keep_quantized and int(t.tensor_type) in BLOCK_BYTES and quantizable(hf_name, shape):
            blocks = np.asarray(t.data).reshape(shape[0], -1)
            if permuted and hf_name.endswith("q_proj.weight"):
                blocks = unpermute_rope(blocks, spec.num_heads)
            elif permuted and hf_name.endswith("k_proj.weight"):
                blocks = unpermute_rope(blocks, spec.num_kv_heads)
            weights[hf_name] = QuantizedWeight(int(t.tensor_type),
                                               torch.from_numpy(np.array(blocks)), shape[1])
            continue
        try:
            array = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"GGUF tensor {t.name!r} uses {t.tensor_type.name}, which cannot be dequantized"
            ) from e
        array = array.reshape(shape)
        if permuted and hf_name.endswith("q_proj.weight"):
            array = unpermute_rope(array, spec.num_heads)
        elif permuted and hf_name.endswith("k_proj.weight"):
            array = unpermute_rope(array, spec.num_kv_heads)
        weights[hf_name] = torch.from_numpy(np.array(array, dtype=np.float32))
    return weights


