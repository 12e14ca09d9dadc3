"""A decoder layer's elementwise steps (RMS norm, rope, SiLU-and-multiply), native kernel, Triton
kernels (interpreted on the CPU, compiled on a GPU) and torch path, against the same formulas in
float64; and the kernels against the torch path, which they must match to the last bit but for
float32 rounding of exp and fused multiply-adds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import on_triton_device

from treadle.model import kernels, layers
from treadle.model.layers import (
    Rotary,
    apply_rope,
    default_rope_frequencies,
    rms_norm,
    silu_and_mul,
)

DTYPES = [torch.float32, torch.bfloat16]
# One float32 ulp-scale error on values of order one, or one bfloat16 ulp (2^-8 relative).
PATH_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6),
                  torch.bfloat16: dict(rtol=2 ** -7, atol=1e-6)}
REFERENCE_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5),
                       torch.bfloat16: dict(rtol=2 ** -6, atol=2 ** -6)}


def path_tolerance(path: str, dtype: torch.dtype) -> dict:
    """How close a kernel path must come to the torch path. Triton's CPU interpreter truncates
    float32 to bfloat16 (compiled Triton rounds to nearest even, as torch does), which costs up
    to two more bfloat16 ulps where a formula rounds twice (of the products, where rope subtracts
    them); on a GPU the tight bound holds."""
    if path == "triton" and dtype == torch.bfloat16 and not torch.cuda.is_available():
        return dict(rtol=2 ** -5, atol=2 ** -7)
    return PATH_TOLERANCE[dtype]


@pytest.fixture(params=["native", "triton", "torch"])
def path(request, monkeypatch) -> str:
    if request.param == "native" and kernels.elementwise_kernels() is None:
        pytest.skip("native kernel unavailable")
    if request.param == "triton":
        pytest.importorskip("triton")
        import treadle.model.triton_layers

        triton_kernels = SimpleNamespace(**{
            name: on_triton_device(getattr(treadle.model.triton_layers, name))
            for name in ("rms_norm", "rope", "silu_and_mul")})
        monkeypatch.setattr(layers, "elementwise_kernels", lambda device: triton_kernels)
    if request.param == "torch":
        monkeypatch.setattr(layers, "elementwise_kernels", lambda device: None)
    return request.param


def torch_path(fn, *args, **kwargs) -> torch.Tensor:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers, "elementwise_kernels", lambda device: None)
        return fn(*args, **kwargs)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view whose rows are not contiguous (as q/k within a qkv output)."""
    wide = torch.full((t.shape[0], *t.shape[1:-1], t.shape[-1] + 5), float("nan"), dtype=t.dtype)
    wide[..., 3:3 + t.shape[-1]] = t
    return wide[..., 3:3 + t.shape[-1]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 4, 32)])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("scale_in_float32", [False, True])
def test_rms_norm(path, dtype, shape, layout, scale_in_float32):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=gen)
    weight = weight if scale_in_float32 else weight.to(dtype)  # Gemma's is float32
    if layout == "strided":
        x = strided(x)
    out = rms_norm(x, weight, 1e-5, scale_in_float32)
    assert out.shape == x.shape and out.dtype == dtype
    x64 = x.double()
    expected = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5) * weight.double()
    torch.testing.assert_close(out.double(), expected, **REFERENCE_TOLERANCE[dtype])
    if path != "torch":
        torch.testing.assert_close(out, torch_path(rms_norm, x, weight, 1e-5, scale_in_float32),
                                   **path_tolerance(path, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_rope_on_a_qkv_view(path, dtype, num_tokens):
    """As self_attention calls it: q and k heads viewed inside the fused qkv output."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim = 3, 1, 16
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim)
    rotary = Rotary(default_rope_frequencies(head_dim, 10000.0), 64, dtype)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen)
    cos, sin = rotary.at(positions)
    out = apply_rope(qk, cos, sin)
    assert out.shape == qk.shape and out.dtype == dtype
    half = head_dim // 2
    x1, x2 = qk[..., :half].double(), qk[..., half:].double()
    c, s = cos.double(), sin.double()
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    torch.testing.assert_close(out.double(), expected, **REFERENCE_TOLERANCE[dtype])
    if path != "torch":
        torch.testing.assert_close(out, torch_path(apply_rope, qk, cos, sin),
                                   **path_tolerance(path, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 6])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_silu_and_mul(path, dtype, num_tokens, layout):
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(num_tokens, 2 * 40, generator=gen) * 4).to(dtype)
    if layout == "strided":
        gate_up = strided(gate_up)
    out = silu_and_mul(gate_up)
    assert out.shape == (num_tokens, 40) and out.dtype == dtype
    gate, up = gate_up[:, :40].double(), gate_up[:, 40:].double()
    expected = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(out.double(), expected, **REFERENCE_TOLERANCE[dtype])
    if path != "torch":
        torch.testing.assert_close(out, torch_path(silu_and_mul, gate_up),
                                   **path_tolerance(path, dtype))


def test_the_native_kernel_refuses_other_dtypes():
    module = kernels.elementwise_kernels()
    if module is None:
        pytest.skip("native kernel unavailable")
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        module.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64),
                        1e-5, False)
