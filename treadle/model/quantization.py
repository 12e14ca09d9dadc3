"""Weight-only quantized weights in GGUF's block formats, and how a model's weights become them.

A `QuantizedWeight` holds the blocks of a [out_features, in_features] matrix as GGUF stores them
(Q4_0, Q4_1, Q8_0: 32 weights a block along in_features), one row of bytes per output row, so
rows can be permuted, concatenated and gathered as bytes. `--quantization`:
- `gguf`: a GGUF's Q4_0/Q4_1/Q8_0 matrices are served as stored; other types are dequantized;
- `int8` / `int4`: float matrices are quantized at load to Q8_0 (a scale per 32 weights) or Q4_1
  (a scale and a minimum per 32 weights), with the gguf package's own quantizer;
- `none`: every weight dequantized to the model's dtype (the exact float path);
- `auto` (the default): `gguf` for a GGUF file, `none` for a Hugging Face folder.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treadle.config import QUANTIZATION_CHOICES

BLOCK = 32
# ggml's type ids (as the gguf package numbers them) -> bytes per block of 32 weights.
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # Q4_0, Q4_1, Q8_0
QTYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
AT_LOAD = {"int8": 8, "int4": 3}  # --quantization -> the type float weights are quantized to


@dataclass
class QuantizedWeight:
    qtype: int  # a key of BLOCK_BYTES
    data: torch.Tensor  # uint8 [out_features, in_features / 32 * BLOCK_BYTES[qtype]]
    in_features: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.in_features))

    @property
    def name(self) -> str:
        return QTYPE_NAMES[self.qtype]

    def numel(self) -> int:
        return self.data.shape[0] * self.in_features

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows `ids` of the matrix: a quantized embedding's lookup."""
        return dequantize(QuantizedWeight(self.qtype, self.data.index_select(0, ids),
                                          self.in_features))


def resolve_quantization(requested: str, is_gguf: bool) -> str:
    if requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, "
                         f"got {requested!r}")
    if requested == "auto":
        return "gguf" if is_gguf else "none"
    return requested


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Linear and embedding matrices whose rows split into whole blocks; not norms or biases."""
    return name.endswith(".weight") and len(shape) == 2 and shape[1] % BLOCK == 0 \
        and "norm" not in name


def quantize(weight: torch.Tensor, qtype: int) -> QuantizedWeight:
    """Quantize a float [out, in] matrix to GGUF blocks (the gguf package's quantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    blocks = gguf_quantize(weight.float().numpy(), GGMLQuantizationType(qtype))
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(blocks)),
                           weight.shape[1])


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 [out, in] matrix the blocks stand for: the native kernel where it loads, else
    the same arithmetic in torch (ggml's order: q * d + m, (q - 8) * d, q * d)."""
    from treadle.model.kernels import quant_linear_kernels

    kernels = quant_linear_kernels()
    if kernels is not None:
        return kernels.dequantize(weight.data, weight.qtype, weight.in_features)
    return dequantize_torch(weight)


def dequantize_torch(weight: QuantizedWeight) -> torch.Tensor:
    rows = weight.data.shape[0]
    blocks = weight.data.view(rows, weight.in_features // BLOCK, BLOCK_BYTES[weight.qtype])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if weight.qtype == 8:  # Q8_0
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).view(rows, weight.in_features)
    offset = 4 if weight.qtype == 3 else 2
    qs = blocks[..., offset:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # GGUF order: low nibbles first
    if weight.qtype == 3:  # Q4_1
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        return (q * d + m).view(rows, weight.in_features)
    return ((q - 8) * d).view(rows, weight.in_features)  # Q4_0
