"""A decoder layer's elementwise steps on CUDA, in Triton: RMS norm, rope and SiLU-and-multiply,
each one kernel where torch's formulas launch three to eight (about 20 fewer launches per layer,
which a small model's decode step is made of, graphs or not).

The same interface and results as the native CPU kernels (csrc/elementwise.cpp) and the torch
formulas in treadle/model/layers.py: computed in float32 and rounded to the input's dtype where
torch rounds, so they agree but for float32 rounding of exp and fused multiply-adds. Inputs may
be row-strided views (q and k inside the fused qkv output); the last dim is contiguous.

Imported only where it runs (a CUDA device, or the tests under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rows_and_strides(x: torch.Tensor) -> tuple[int, int, int, int]:
    """x [..., n] as rows over its (at most two) leading dims: (rows, inner count, outer
    stride, inner stride); row r lies at (r // inner) * outer + (r % inner) * inner_stride."""
    if x.stride(-1) != 1:
        raise ValueError("the last dim must be contiguous")
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"expected 2 or 3 dims, got {x.dim()}")


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, inner, stride_outer, stride_inner, eps, n,
              BLOCK: tl.constexpr, SCALE_IN_FLOAT32: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + (row // inner) * stride_outer + (row % inner) * stride_inner + cols,
                mask=inside, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    out_type = out_ptr.dtype.element_ty
    if SCALE_IN_FLOAT32:  # noqa: SIM108 (Gemma: x * w in float32, then rounded)
        y = normed * w
    else:  # Llama: rounded, then times the weight in the model's dtype
        y = w * normed.to(out_type).to(tl.float32)
    tl.store(out_ptr + row * n + cols, y.to(out_type), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             scale_in_float32: bool) -> torch.Tensor:
    rows, inner, outer, inner_stride = rows_and_strides(x)
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rms_norm[(rows,)](x, weight, out, inner, outer, inner_stride, eps, n,
                       BLOCK=triton.next_power_of_2(n), SCALE_IN_FLOAT32=scale_in_float32)
    return out


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_token, stride_head, stride_angle,
          half, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # one head of one token
    token = row // heads
    cols = tl.arange(0, BLOCK)
    inside = cols < half
    source = x_ptr + token * stride_token + (row % heads) * stride_head + cols
    x1 = tl.load(source, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(source + half, mask=inside, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + token * stride_angle + cols, mask=inside, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_angle + cols, mask=inside, other=0.0).to(tl.float32)
    out_type = out_ptr.dtype.element_ty
    # Each product rounded to the dtype, as torch's x1 * cos - x2 * sin rounds it.
    first = (x1 * c).to(out_type).to(tl.float32) - (x2 * s).to(out_type).to(tl.float32)
    second = (x2 * c).to(out_type).to(tl.float32) + (x1 * s).to(out_type).to(tl.float32)
    target = out_ptr + row * 2 * half + cols
    tl.store(target, first.to(out_type), mask=inside)
    tl.store(target + half, second.to(out_type), mask=inside)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on x [tokens, heads, dim]; cos, sin [tokens, 1, dim / 2]."""
    tokens, heads, dim = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rope needs a contiguous last dim and cos, sin of one layout")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rope[(tokens * heads,)](x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0),
                             dim // 2, BLOCK=triton.next_power_of_2(dim // 2))
    return out


@triton.jit
def _silu_and_mul(x_ptr, out_ptr, stride_row, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    gate = tl.load(x_ptr + row * stride_row + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_row + n + cols, mask=inside, other=0.0).to(tl.float32)
    out_type = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_type).to(tl.float32)  # rounded, as F.silu's
    tl.store(out_ptr + row * n + cols, (silu * up).to(out_type), mask=inside)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of x [rows, 2n] times the second half."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError("silu_and_mul takes [rows, 2n] with a contiguous last dim")
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul[(rows, triton.cdiv(n, block))](x, out, x.stride(0), n, BLOCK=block)
    return out
