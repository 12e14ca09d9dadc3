"""Linear layers: float weights prepacked for oneDNN where the capability probe allows it, and
weight-only quantized ones over GGUF blocks. `make_linear` picks one for a weight (or for
several stacked along the output axis, as q/k/v and gate/up are).

A prepacked weight runs 1.2-2x faster than `F.linear` at every batch size (decode GEMVs gain
most) and gives the same results in bfloat16. oneDNN prepacks float32 weights on any x86 CPU but
bfloat16 ones only with AVX-512 (or AVX-NE-CONVERT): elsewhere, and where oneDNN is missing or
disabled, the layer runs `F.linear`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from treadle.model.capabilities import use_onednn_linear
from treadle.model.kernels import quant_linear_kernels
from treadle.model.quantization import QuantizedWeight, dequantize

# Above this many rows a quantized layer runs its batch path (the kernel's integer GEMM over
# panels, a dense copy, or slices dequantized for the call) instead of the row kernel: the
# default until `tune_gemv_rows` measures each shape's crossover on this machine.
QUANT_GEMV_MAX_ROWS = 4
TUNE_ROWS = (1, 2, 4, 8, 16, 32, 64)
# Weights a float step without a dense copy dequantizes at a time: a slice that stays in cache
# for its GEMM, and little memory.
DEQUANTIZED_SLICE_BYTES = 1 << 22


class Linear:
    """y = x W^T + b for x [tokens, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.numel = weight.numel() + (0 if bias is None else bias.numel())
        self.nbytes = weight.numel() * weight.element_size()
        self.bias = bias
        self.prepacked = weight.is_cpu and use_onednn_linear(weight.dtype)
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight) if self.prepacked
                       else weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class QuantizedLinear:
    """y = x W^T + b with W in GGUF blocks, as parts stacked along the output axis (q/k/v,
    gate/up: each part keeps its own type and its own bytes, never concatenated): up to
    `max_gemv_rows` rows the native kernel's integer dot products row by row (activations
    quantized to int8 per block); beyond them the batch path: a float GEMM over `dense` (the
    same weights dequantized once, prepacked: memory for batch speed, opt-in), else the
    kernel's integer GEMM where the build serves every part's type so, else a float GEMM over
    slices of the weights dequantized for the call. Without the kernel, always the float
    path."""

    def __init__(self, weight: QuantizedWeight | list[QuantizedWeight],
                 bias: torch.Tensor | None = None, dense: Linear | None = None) -> None:
        self.parts = [weight] if isinstance(weight, QuantizedWeight) else list(weight)
        self.in_features = self.parts[0].in_features
        self.out_features = sum(p.shape[0] for p in self.parts)
        self.numel = self.out_features * self.in_features + (0 if bias is None else bias.numel())
        self.nbytes = sum(p.nbytes for p in self.parts)  # what a decode step reads
        self.resident_bytes = self.nbytes + (0 if dense is None else dense.nbytes)
        self.data = [p.data for p in self.parts]
        self.qtypes = [p.qtype for p in self.parts]
        self.bias = bias
        self.dense = dense
        self.kernels = quant_linear_kernels()
        self.max_gemv_rows = QUANT_GEMV_MAX_ROWS

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def type_name(self) -> str:
        return "+".join(dict.fromkeys(p.name for p in self.parts))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.shape[0] <= self.max_gemv_rows:
            return self.integer_path(x)
        return self.batch_path(x)

    def integer_path(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.quant_linear_parts(x, self.data, self.qtypes, self.bias)

    @property
    def integer_gemm(self) -> bool:
        """Whether the batch path is the kernel's integer GEMM."""
        return (self.dense is None and self.kernels is not None
                and set(self.qtypes) <= gemm_types(self.kernels))

    @property
    def gemm_same_bits(self) -> bool:
        """Whether the batch path is the integer GEMM and gives a row the row kernel's bits."""
        return self.integer_gemm and set(self.qtypes) <= same_bits_types(self.kernels)

    def batch_path(self, x: torch.Tensor) -> torch.Tensor:
        if self.integer_gemm:
            return self.kernels.quant_gemm_parts(x, self.data, self.qtypes, self.bias)
        return self.float_path(x)

    def float_path(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return self.dense(x)
        if self.kernels is None:
            return F.linear(x, self.dequantized().to(x.dtype), self.bias)
        y = torch.cat([F.linear(x, w) for w in self.dequantized_slices(x.dtype)], dim=1)
        return y if self.bias is None else y + self.bias

    def dequantized_slices(self, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """The weights as `dtype` rows, a slice of about DEQUANTIZED_SLICE_BYTES at a time."""
        rows = max(16, DEQUANTIZED_SLICE_BYTES // (self.in_features * dtype.itemsize))
        for part in self.parts:
            for start in range(0, part.shape[0], rows):
                data = part.data[start:start + rows]
                if dtype == torch.bfloat16:
                    yield self.kernels.dequantize_bf16(data, part.qtype, self.in_features)
                else:
                    yield self.kernels.dequantize(data, part.qtype, self.in_features).to(dtype)

    def dequantized(self) -> torch.Tensor:
        """The float32 [out, in] matrix of all parts."""
        return torch.cat([dequantize(p) for p in self.parts])

    @property
    def shape_name(self) -> str:
        return f"{self.out_features}x{self.in_features} {self.type_name}"

    @property
    def shape_key(self) -> tuple[int, int, str, bool]:
        return (*self.shape, self.type_name, self.dense is not None)


@functools.cache
def gemm_types(kernels) -> frozenset[int]:
    """The quantized types `kernels`' build serves with its integer GEMM."""
    return frozenset(kernels.quant_gemm_types())


@functools.cache
def same_bits_types(kernels) -> frozenset[int]:
    """The quantized types whose row kernel and integer GEMM give the same bits in this build."""
    return frozenset(kernels.quant_gemm_same_bits_types())


def tune_gemv_rows(layers: list[QuantizedLinear], dtype: torch.dtype) -> dict[str, int]:
    """For each distinct shape among `layers`, the most rows (of TUNE_ROWS, at least 1) for
    which the row kernel measured at least as fast as the batch path, set on every layer of that
    shape. The row kernel's cost grows faster with rows than the batch path's: where it wins at
    the most rows it wins below them too, and past its first loss it keeps losing. Returns
    "out x in type" -> rows."""
    by_shape: dict[tuple, list[QuantizedLinear]] = {}
    for layer in layers:
        if layer.kernels is not None:
            by_shape.setdefault(layer.shape_key, []).append(layer)
    chosen = {}
    for group in by_shape.values():
        rows = crossover_rows(group[0], dtype)
        for layer in group:
            layer.max_gemv_rows = rows
        chosen[group[0].shape_name] = rows
    return chosen


def crossover_rows(layer: QuantizedLinear, dtype: torch.dtype, repeats: int = 5) -> int:
    """One row always goes to the row kernel: it reads 4-8x fewer bytes than a float path and
    measured faster at one row on every shape of the default model (Xeon, one thread: 0.28 vs
    0.52 ms for gate_up 3072x576 Q4_1, 6.2 vs 13.3 ms for the head 49152x576 Q8_0; it still wins
    at 4 rows, 0.50 vs 0.52 and 9.0 vs 14.4). Each larger count is timed with more repeats, and
    a loss is timed again before it counts: with 5 repeats and no second look, a shared 2-core
    machine under load picked 1 row for shapes where the kernel wins at 2-4. The most rows are
    timed first: a shape where the kernel wins throughout is timed once, not at every count;
    else the counts go up from 2 to the first loss."""
    def wins(rows: int) -> bool:
        x = torch.randn(rows, layer.in_features).to(dtype)
        return kernel_wins(layer, x, repeats + rows // 4)

    if wins(TUNE_ROWS[-1]):
        return TUNE_ROWS[-1]
    rows_ok = 1
    for rows in TUNE_ROWS[1:-1]:
        if not wins(rows):
            break
        rows_ok = rows
    return rows_ok


def kernel_wins(layer: QuantizedLinear, x: torch.Tensor, repeats: int) -> bool:
    layer.integer_path(x), layer.batch_path(x)  # warm up caches
    # Alternate the two, keeping each one's best: a busy machine slows both alike, and a best of
    # many is what the load spared.
    integer = floating = float("inf")
    for _ in range(2):
        for _ in range(repeats):
            integer = min(integer, seconds(layer.integer_path, x))
            floating = min(floating, seconds(layer.batch_path, x))
        if integer <= floating:
            return True
    return False


def seconds(fn, x: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(x)
    return time.perf_counter() - start


def make_linear(weights: list[torch.Tensor | QuantizedWeight], bias: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32, dense_for_batches: bool = False
                ) -> Linear | QuantizedLinear:
    """One layer over `weights` stacked along the output axis. Quantized weights stay their
    blocks, one part each whatever their types (with a dense copy in `dtype` for batches if
    asked); a mix of quantized and float weights is served in `dtype`."""
    if all(isinstance(w, QuantizedWeight) for w in weights):
        dense = None
        if dense_for_batches:
            dense = Linear(torch.cat([dequantize(w) for w in weights]).to(dtype), bias)
        return QuantizedLinear(weights, bias, dense)
    dense = [dequantize(w).to(dtype) if isinstance(w, QuantizedWeight) else w for w in weights]
    return Linear(torch.cat(dense) if len(dense) > 1 else dense[0], bias)
