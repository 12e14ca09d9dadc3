"""Weight-only quantized weights in GGUF's block formats, and how a model's weights become them.

A `QuantizedWeight` holds the blocks of a [out_features, in_features] matrix as GGUF stores them
(Q4_0, Q4_1, Q5_0, Q8_0: 32 weights a block along in_features; Q4_K, Q5_K, Q6_K: 256 a
super-block),
one row of bytes per output row, so rows can be permuted, concatenated and gathered as bytes.
`--quantization`:
- `gguf`: a GGUF's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K matrices are served as stored; other
  types are dequantized at load (the gguf package's dequantization);
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

BLOCK = 32  # weights per activation block in the kernel, and per block of the 32-wide types
# ggml's type ids (as the gguf package numbers them) -> weights per block, bytes per block.
BLOCK_WEIGHTS = {2: 32, 3: 32, 6: 32, 8: 32, 12: 256, 13: 256, 14: 256}
BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 8: 34, 12: 144, 13: 176, 14: 210}
QTYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
AT_LOAD = {"int8": 8, "int4": 3}  # --quantization -> the type float weights are quantized to


@dataclass
class QuantizedWeight:
    qtype: int  # a key of BLOCK_BYTES
    data: torch.Tensor  # uint8 [out_features, in_features / block_weights * block_bytes]
    in_features: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.in_features))

    @property
    def ndim(self) -> int:
        return 2

    @property
    def name(self) -> str:
        return QTYPE_NAMES[self.qtype]

    @property
    def block_weights(self) -> int:
        return BLOCK_WEIGHTS[self.qtype]

    @property
    def block_bytes(self) -> int:
        return BLOCK_BYTES[self.qtype]

    def numel(self) -> int:
        return self.data.shape[0] * self.in_features

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows `ids` of the matrix: a quantized embedding's lookup."""
        return dequantize(QuantizedWeight(self.qtype, self.data.index_select(0, ids),
                                          self.in_features))


def resolve_quantization(requested: str, is_gguf: bool, device: str = "cpu") -> str:
    """`auto` serves a GGUF's blocks as stored on the CPU; on CUDA the weights are dequantized
    to the served dtype (the block kernels here are CPU kernels)."""
    if requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, "
                         f"got {requested!r}")
    if device == "cuda":
        if requested not in ("auto", "none"):
            raise ValueError(f"--quantization {requested} runs on CPU kernels only; on CUDA "
                             "the weights are served in --dtype (--quantization auto or none)")
        return "none"
    if requested == "auto":
        return "gguf" if is_gguf else "none"
    return requested


def quantizable(name: str, shape: tuple[int, ...], qtype: int | None) -> bool:
    """Linear and embedding matrices whose rows split into whole blocks of `qtype` (a type the
    kernels serve); not norms or biases."""
    return qtype in BLOCK_WEIGHTS and name.endswith(".weight") and len(shape) == 2 \
        and shape[1] % BLOCK_WEIGHTS[qtype] == 0 and "norm" not in name


def quantize(weight: torch.Tensor, qtype: int) -> QuantizedWeight:
    """Quantize a float [out, in] matrix to GGUF blocks (the gguf package's quantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    blocks = gguf_quantize(weight.float().numpy(), GGMLQuantizationType(qtype))
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(blocks)),
                           weight.shape[1])


def random_blocks(qtype: int, shape: tuple[int, int], spread: float,
                  generator: torch.Generator) -> QuantizedWeight:
    """A random [out, in] matrix in blocks of `qtype` (Q8_0 or Q4_1), its weights within
    +-`spread`: random quants under scales that map them onto that range."""
    rows, in_features = shape
    blocks = torch.randint(0, 256, (rows, in_features // BLOCK_WEIGHTS[qtype],
                                    BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=generator)
    if qtype == 8:  # d, then 32 int8 quants
        scales = [spread / 127]
    elif qtype == 3:  # d, m, then 32 4-bit quants: q d + m
        scales = [2 * spread / 15, -spread]
    else:
        raise ValueError(f"random blocks of {QTYPE_NAMES.get(qtype, qtype)} are not made")
    fields = torch.tensor(scales, dtype=torch.float16).view(torch.uint8)
    blocks[..., :fields.numel()] = fields
    return QuantizedWeight(qtype, blocks.reshape(rows, -1), in_features)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 [out, in] matrix the blocks stand for: the native kernel where it loads, else
    the same arithmetic in torch."""
    from treadle.model.kernels import quant_linear_kernels

    kernels = quant_linear_kernels()
    if kernels is not None:
        return kernels.dequantize(weight.data, weight.qtype, weight.in_features)
    return dequantize_torch(weight)


def dequantize_torch(weight: QuantizedWeight) -> torch.Tensor:
    """The pure-torch dequantization, in ggml's arithmetic and order (as the gguf package's)."""
    rows = weight.data.shape[0]
    blocks = weight.data.view(rows, weight.in_features // weight.block_weights,
                              weight.block_bytes)
    decode = {2: q4_0, 3: q4_1, 6: q5_0, 8: q8_0, 12: q4_k, 13: q5_k, 14: q6_k}[weight.qtype]
    values = decode(blocks)
    return values.reshape(rows, weight.in_features)


def half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each block, as float32 [..., 1]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Each run of bytes as its low nibbles, then its high ones (GGUF's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[..., 2:].contiguous().view(torch.int8).float() * half(blocks, 0)


def q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return (nibbles(blocks[..., 2:]).float() - 8) * half(blocks, 0)


def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return nibbles(blocks[..., 4:]).float() * half(blocks, 0) + half(blocks, 2)


def q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Bit j of the 4 bytes qh is weight j's fifth bit."""
    bit = torch.arange(32)
    high = (blocks[..., 2:6][..., bit // 8] >> (bit % 8)) & 1
    return ((nibbles(blocks[..., 6:]) | (high << 4)).float() - 16) * half(blocks, 0)


def q4_k(blocks: torch.Tensor, qs_start: int = 16, high_bits: torch.Tensor | None = None
         ) -> torch.Tensor:
    """8 sub-blocks of 32: (d scale_j) q - (dmin min_j), 6-bit scales and mins packed as ggml's
    get_scale_min_k4 reads them; each 32 bytes of qs hold two sub-blocks (low nibbles first).
    `high_bits` [..., 8, 32]: Q5_K's fifth bits."""
    s = blocks[..., 4:16]
    lo, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scale = torch.cat([lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)], dim=-1).float()
    minimum = torch.cat([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], dim=-1).float()
    qs = blocks[..., qs_start:].unflatten(-1, (4, 32))
    q = torch.stack([qs & 0x0F, qs >> 4], dim=-2).flatten(-3, -2)  # [..., 8, 32]
    q = (q if high_bits is None else q | (high_bits << 4)).float()
    dl = (half(blocks, 0) * scale)[..., None]
    ml = (half(blocks, 2) * minimum)[..., None]
    return (dl * q - ml).flatten(-2)


def q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K's layout with 32 bytes qh before qs: bit j of qh[l] is weight l of sub-block j's
    fifth bit."""
    qh = blocks[..., 16:48].unsqueeze(-2)  # [..., 1, 32]
    high = (qh >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    return q4_k(blocks, qs_start=48, high_bits=high)


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Two halves of 128: weight 32 s + l of half h takes 4 bits from ql[64 h + 32 (s % 2) + l]
    (low nibble for s < 2) and 2 from qh[32 h + l] >> 2 s; (d scale) (q - 32), a scale per 16."""
    ql = blocks[..., :128].unflatten(-1, (2, 64))
    ql = torch.stack([ql & 0x0F, ql >> 4], dim=-2).flatten(-2).unflatten(-1, (4, 32))
    qh = blocks[..., 128:192].unflatten(-1, (2, 1, 32))
    qh = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3  # [..., 2, 4, 32]
    q = ((ql | (qh << 4)).float() - 32).flatten(-3).unflatten(-1, (16, 16))
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    return ((half(blocks, 208) * scales)[..., None] * q).flatten(-2)
