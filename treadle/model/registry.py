"""The model families, found by config.json's `architectures` (or `model_type`, which configs
converted from a GGUF carry alone) and by a GGUF's `general.architecture`.

Adding a family: a module in treadle/model/models/ defining its `FAMILY` (see family.py), and
its line in FAMILIES below.
"""

from __future__ import annotations

import torch

from treadle.model.family import ModelFamily, ModelSpec
from treadle.model.layers import DecoderModel
from treadle.model.models import gemma3, llama, moe
from treadle.model.quantization import QuantizedWeight
from treadle.model.source import ModelLoadError

FAMILIES: tuple[ModelFamily, ...] = (llama.FAMILY, gemma3.FAMILY, moe.FAMILY)


def spec_from_config(cfg: dict, generation_config: dict | None = None) -> ModelSpec:
    """The spec of the first family that knows one of config.json's architectures."""
    names = cfg.get("architectures") or [cfg.get("model_type")]
    for name in names:
        for family in FAMILIES:
            variant = family.hf_architectures.get(name)
            if variant is None and name in family.hf_architectures.values():
                variant = name
            if variant is not None:
                return family.spec_from_config(cfg, generation_config, variant)
    supported = sorted(a for f in FAMILIES for a in f.hf_architectures)
    raise ModelLoadError(f"unsupported architecture {names[0]!r}; supported: {supported}")


def family_of(spec: ModelSpec) -> ModelFamily:
    for family in FAMILIES:
        if spec.architecture in family.hf_architectures.values():
            return family
    raise ModelLoadError(f"no model family serves {spec.architecture!r}")


def family_for_gguf(architecture: str) -> ModelFamily:
    for family in FAMILIES:
        if architecture in family.gguf_architectures:
            return family
    supported = sorted(a for f in FAMILIES for a in f.gguf_architectures)
    raise ModelLoadError(f"unsupported GGUF architecture {architecture!r}; supported: "
                         f"{supported}")


def build_model(spec: ModelSpec, weights: dict[str, torch.Tensor | QuantizedWeight],
                dtype: torch.dtype, max_positions: int, dense_for_batches: bool = False
                ) -> DecoderModel:
    """The family's model over `weights` (Hugging Face names), rope tables up to
    `max_positions`."""
    return family_of(spec).model_class(spec, weights, dtype, max_positions,
                                       dense_for_batches=dense_for_batches)
