"""Find and load model weights, architecture and tokenizer.

Two sources: a Hugging Face folder (config.json, *.safetensors, tokenizer files) and a GGUF file.
Both end as one `LoadedModel`: an architecture spec, a dict of tensors under Hugging Face names,
and a folder holding the tokenizer (with its chat template) and the config. What differs per
model family (config.json → spec, GGUF tensor names and their fix-ups) comes from the family's
module through the registry.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from treadle.model.family import ModelFamily, ModelSpec
from treadle.model.quantization import (
    AT_LOAD,
    QTYPE_NAMES,
    QuantizedWeight,
    quantizable,
    quantize,
    random_blocks,
    resolve_quantization,
)
from treadle.model.registry import family_for_gguf, family_of, spec_from_config
from treadle.model.source import ModelLoadError, resolve_model

if TYPE_CHECKING:
    from treadle.model.gguf_file import GGUFTensor

logger = logging.getLogger(__name__)

WeightSelect = Callable[[str, torch.Tensor | QuantizedWeight], torch.Tensor | QuantizedWeight]

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
               quantization: str = "none", select: WeightSelect | None = None,
               device: str = "cpu", load_format: str = "auto") -> LoadedModel:
    """Load `model` (an HF folder, a .gguf file, or None for the default model) in `dtype`
    into host memory, its matrices quantized as `quantization` says for the resolved `device`
    they will be served on (see treadle/model/quantization.py).
    `select(name, weight)`: the part of each weight to keep (a tensor-parallel rank's slice,
    treadle/model/parallel.py), taken before the conversion to `dtype` or quantization.
    `load_format` dummy: random weights of the shapes the model's config gives."""
    source = resolve_model(model)
    spec = read_spec(source.folder)
    quantization = resolve_quantization(quantization, source.gguf is not None, device)
    at_load = AT_LOAD.get(quantization)
    if load_format == "dummy" and select is None:
        return LoadedModel(spec=spec, weights=dummy_weights(spec, dtype, at_load),
                           folder=source.folder, name=source.name, quantization=quantization)
    if load_format == "dummy":  # a rank's slice of the whole model's random weights
        weights = dummy_weights(spec, torch.float32, None)
    elif not source.has_weights:
        raise ModelLoadError(f"{str(model)!r} holds a config.json and no weights: serve it "
                             f"with --load-format dummy (random weights of its shapes)")
    elif source.gguf is not None:
        weights = read_gguf_weights(source.gguf, spec, keep_quantized=quantization == "gguf")
    else:
        weights = read_safetensors_weights(source.folder)
    check_weights(weights, spec)
    expected = spec.expected_shapes()
    if select is not None:
        weights = {k: select(k, v) for k, v in weights.items() if k in expected}
    weights = {k: v if isinstance(v, QuantizedWeight)
               else quantize(v, at_load) if quantizable(k, v.shape, at_load)
               else v.to(dtype)
               for k, v in weights.items() if k in expected}
    return LoadedModel(spec=spec, weights=weights, folder=source.folder, name=source.name,
                       quantization=quantization)


# Random weights are uniform in (-DUMMY_RANGE, DUMMY_RANGE): activations stay finite through
# dozens of layers. Norms are ones, biases zeros.
DUMMY_RANGE = 0.05


def dummy_weights(spec: ModelSpec, dtype: torch.dtype, qtype: int | None
                  ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Random weights of every shape `spec` expects, matrices as blocks of `qtype` where it
    is given (no float copy is ever made: an 8B model's floats would not fit beside them).
    Seeded: every load gives the same model."""
    generator = torch.Generator().manual_seed(0)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, shape in spec.expected_shapes().items():
        if len(shape) == 1:
            weights[name] = (torch.ones if "norm" in name else torch.zeros)(shape, dtype=dtype)
        elif quantizable(name, shape, qtype):
            weights[name] = random_blocks(qtype, shape, DUMMY_RANGE, generator)
        else:
            weights[name] = torch.empty(shape, dtype=dtype).uniform_(
                -DUMMY_RANGE, DUMMY_RANGE, generator=generator)
    return weights


def read_spec(folder: Path) -> ModelSpec:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"missing file {str(config_path)!r}")
    cfg = json.loads(config_path.read_text())
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return spec_from_config(cfg, gen)


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


def hf_name_for_gguf(name: str, family: ModelFamily) -> str:
    """The Hugging Face name of GGUF tensor `name`; a stack of experts' matrices keeps an
    `{expert}` field for `gguf_matrices` to fill."""
    names = family.gguf_tensor_names
    if name in names:
        return names[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        template = names.get(f"blk.{{}}.{parts[2]}")
        if template:
            return template.replace("{}", parts[1], 1)
    raise ModelLoadError(f"unknown GGUF tensor {name!r}")


def gguf_matrices(t: GGUFTensor, family: ModelFamily) -> Iterator[tuple[str, GGUFTensor]]:
    """(Hugging Face name, tensor) for GGUF tensor `t`, or for each expert's matrix where `t`
    stacks a layer's experts (llama.cpp's 3-D `ffn_*_exps`): views of the file, not copies."""
    hf_name = hf_name_for_gguf(t.name, family)
    if "{expert}" not in hf_name:
        yield hf_name, t
        return
    if len(t.shape) != 3:
        raise ModelLoadError(f"GGUF tensor {t.name!r} has {len(t.shape)} dimensions, "
                             f"expected 3 (experts, rows, columns)")
    for expert, data in enumerate(t.data):
        yield hf_name.format(expert=expert), dataclasses.replace(
            t, shape=t.shape[:2], n_elements=t.n_elements // len(t.data),
            n_bytes=t.n_bytes // len(t.data), data=data)


def read_gguf_weights(path: Path, spec: ModelSpec, keep_quantized: bool = False
                      ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor as `gguf_weight` makes it."""
    from treadle.model.gguf_file import read_gguf

    reader = read_gguf(path)
    architecture = reader.metadata.get("general.architecture")
    family = family_of(spec)
    if architecture is not None and architecture not in family.gguf_architectures:
        family_for_gguf(architecture)  # unsupported: says which are
        raise ModelLoadError(f"{str(path)!r} holds a {architecture!r} model, but its "
                             f"config names {spec.architecture!r}")
    fix = family.gguf_fix or (lambda name, rows, spec, dequantized: rows)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for tensor in reader.tensors:
        if tensor.name not in family.gguf_ignored_tensors:
            for hf_name, t in gguf_matrices(tensor, family):
                weights[hf_name] = gguf_weight(t, hf_name, spec, fix, keep_quantized)
    return weights


def gguf_weight(t: GGUFTensor, hf_name: str, spec: ModelSpec, fix: Callable,
                keep_quantized: bool) -> torch.Tensor | QuantizedWeight:
    """One GGUF tensor as served: a matrix in a type the kernels serve kept as its blocks in the
    file's memory map (with `keep_quantized`), else dequantized to float32 by the gguf package
    (Q2_K, Q3_K, IQ4_XS, ...); the family's fix-up applied to either (rows un-permuted as bytes
    for blocks)."""
    from gguf.quants import dequantize

    shape = tuple(reversed([int(s) for s in t.shape]))
    if keep_quantized and quantizable(hf_name, shape, int(t.tensor_type)):
        rows = np.asarray(t.data).reshape(shape[0], -1)
        blocks = fix(hf_name, rows, spec, False)
        # Blocks the fix-up leaves as they are stay the file's pages, read in place (a copy
        # only of un-permuted q/k rows).
        data = torch.from_numpy(rows if blocks is rows else np.ascontiguousarray(blocks))
        return QuantizedWeight(int(t.tensor_type), data, shape[1])
    try:
        array = dequantize(t.data, t.tensor_type)
    except (NotImplementedError, ValueError) as e:
        raise ModelLoadError(
            f"GGUF tensor {t.name!r} uses {t.tensor_type.name}, which Treadle cannot serve: "
            f"served as stored are {', '.join(QTYPE_NAMES.values())}, and types the gguf "
            f"package dequantizes are dequantized at load") from e
    array = fix(hf_name, array.reshape(shape), spec, True)
    return torch.from_numpy(np.array(array, dtype=np.float32))
