"""Mixture-of-experts decoders on the Llama block: Qwen3-MoE (q/k norms per head, dense layers
where `mlp_only_layers` / `decoder_sparse_step` say), Mixtral, OLMoE (q/k norms over all heads).
Attention is the Llama family's; the feed-forward is `experts.SparseMoE`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from treadle.model.experts import SparseMoE
from treadle.model.family import ModelFamily, ModelSpec
from treadle.model.layers import Layer
from treadle.model.linear import Linear, QuantizedLinear
from treadle.model.models import llama
from treadle.model.quantization import QuantizedWeight, dequantize
from treadle.model.source import ModelLoadError

# Each family's names for an expert's gate, up and down matrices.
EXPERT_MATRICES = {"mixtral": ("w1", "w3", "w2")}
DEFAULT_EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class MoESpec(llama.LlamaSpec):
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    normalize_top_k: bool  # the chosen experts' probabilities renormalized to sum to 1
    dense_layers: frozenset[int] = frozenset()  # layers with a dense MLP (intermediate_size)
    whole_qk_norm: bool = False  # OLMoE: q and k RMSNorm over all heads at once

    def moe_prefix(self, layer: int) -> str:
        block = "block_sparse_moe" if self.architecture == "mixtral" else "mlp"
        return f"model.layers.{layer}.{block}."

    def expert_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """Hugging Face names of expert `expert`'s gate, up and down matrices."""
        p = f"{self.moe_prefix(layer)}experts.{expert}."
        return tuple(f"{p}{m}.weight" for m in EXPERT_MATRICES.get(
            self.architecture, DEFAULT_EXPERT_MATRICES))

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_shapes()
        h, inner = self.hidden_size, self.expert_intermediate_size
        for i in range(self.num_layers):
            if self.whole_qk_norm:
                attn = f"model.layers.{i}.self_attn."
                shapes[attn + "q_norm.weight"] = (self.num_heads * self.head_dim,)
                shapes[attn + "k_norm.weight"] = (self.num_kv_heads * self.head_dim,)
            if i in self.dense_layers:
                continue
            for matrix in ("gate_proj", "up_proj", "down_proj"):
                del shapes[f"model.layers.{i}.mlp.{matrix}.weight"]
            shapes[self.moe_prefix(i) + "gate.weight"] = (self.num_experts, h)
            for e in range(self.num_experts):
                gate, up, down = self.expert_names(i, e)
                shapes |= {gate: (inner, h), up: (inner, h), down: (h, inner)}
        return shapes


    def active_parameters(self) -> int:
        expert = 3 * self.hidden_size * self.expert_intermediate_size
        sparse = self.num_layers - len(self.dense_layers)
        idle = sparse * (self.num_experts - self.experts_per_token) * expert
        return self.num_parameters() - idle


def spec_from_config(cfg: dict, generation_config: dict | None, variant: str) -> MoESpec:
    if cfg.get("clip_qkv") is not None:
        raise ModelLoadError("OLMoE's clip_qkv is not supported")
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not num_experts or not cfg.get("num_experts_per_tok"):
        raise ModelLoadError("config.json lacks num_experts / num_experts_per_tok")
    base = llama.spec_from_config(cfg, generation_config, variant)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields["qk_norm"] = variant in ("qwen3_moe", "olmoe")
    step = cfg.get("decoder_sparse_step") or 1
    dense = {i for i in range(base.num_layers)
             if i in set(cfg.get("mlp_only_layers") or ()) or (i + 1) % step}
    return MoESpec(
        **fields,
        num_experts=num_experts,
        experts_per_token=cfg["num_experts_per_tok"],
        expert_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        normalize_top_k=variant == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        dense_layers=frozenset(dense) if variant == "qwen3_moe" else frozenset(),
        whole_qk_norm=variant == "olmoe",
    )


class MoEModel(llama.LlamaModel):
    """The Llama model with a `SparseMoE` feed-forward in its sparse layers."""

    spec: MoESpec

    def feed_forward_weights(self, w: dict[str, torch.Tensor | QuantizedWeight], i: int,
                             linear: Callable[..., Linear | QuantizedLinear]) -> Layer:
        spec = self.spec
        if i in spec.dense_layers:
            return super().feed_forward_weights(w, i, linear)
        router = w[spec.moe_prefix(i) + "gate.weight"]
        if isinstance(router, QuantizedWeight):  # --quantization int8/int4 quantized it too
            router = dequantize(router)
        experts = []
        for e in range(spec.num_experts):
            gate, up, down = spec.expert_names(i, e)
            experts.append((linear([w[gate], w[up]]), linear([w[down]])))
        return {"moe": SparseMoE(router.to(self.dtype), experts, spec.experts_per_token,
                                 spec.normalize_top_k)}

    def feed_forward(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        moe = layer.get("moe")
        return moe(x) if moe is not None else super().feed_forward(layer, x)

    def qk_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.spec.whole_qk_norm:
            return self.norm(x.flatten(1), weight).view_as(x)
        return self.norm(x, weight)

    @property
    def native_decoder(self) -> None:
        """The native decoder fuses dense MLPs only."""
        return None


def gguf_fix(hf_name: str, rows: np.ndarray, spec: ModelSpec, dequantized: bool
             ) -> np.ndarray:
    """llama.cpp converts Mixtral as "llama": its q/k rows are permuted like Llama's."""
    if spec.architecture != "mixtral":
        return rows
    return llama.gguf_fix(hf_name, rows, dataclasses.replace(spec, architecture="llama"),
                          dequantized)


# llama.cpp stores each layer's experts as one 3-D tensor; `{expert}` splits it per expert.
GGUF_TENSOR_NAMES = llama.GGUF_TENSOR_NAMES | {
    "blk.{}.ffn_gate_inp.weight": "model.layers.{}.mlp.gate.weight",
    "blk.{}.ffn_gate_exps.weight": "model.layers.{}.mlp.experts.{expert}.gate_proj.weight",
    "blk.{}.ffn_up_exps.weight": "model.layers.{}.mlp.experts.{expert}.up_proj.weight",
    "blk.{}.ffn_down_exps.weight": "model.layers.{}.mlp.experts.{expert}.down_proj.weight",
}

FAMILY = ModelFamily(
    name="moe",
    hf_architectures={"Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
                      "OlmoeForCausalLM": "olmoe"},
    gguf_architectures=("qwen3moe",),  # transformers converts no OLMoE GGUF config
    spec_from_config=spec_from_config,
    model_class=MoEModel,
    gguf_tensor_names=GGUF_TENSOR_NAMES,
    gguf_fix=gguf_fix,
)
