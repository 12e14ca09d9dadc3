"""Quantized weights: the native kernel against the same arithmetic in float64 torch, its
dequantization against the gguf package's, and whole models served from quantized blocks
against the same model's dequantized float weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import AVX2_ENV, run_forced
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from model_utils import (
    build_tiny_model,
    greedy_decode,
    make_runner,
    permute_like_llama_cpp,
    write_tiny_gguf,
)

from treadle.config import CacheConfig, ModelConfig
from treadle.model import linear
from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.gguf_file import read_gguf
from treadle.model.kernels import quant_linear_kernels, this_build
from treadle.model.linear import QuantizedLinear, make_linear
from treadle.model.loader import (
    LoadedModel,
    gguf_weight,
    load_model,
    read_gguf_weights,
    read_spec,
)
from treadle.model.models.llama import FAMILY, LlamaModel
from treadle.model.parallel import slice_columns
from treadle.model.quantization import (
    BLOCK_BYTES,
    QuantizedWeight,
    dequantize,
    dequantize_torch,
    quantize,
    resolve_quantization,
)
from treadle.model.runner import ModelRunner
from treadle.model.source import ModelLoadError

QTYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
# Served as stored but not quantized to at load; the gguf package quantizes only Q5_0 of them.
GGUF_ONLY_QTYPES = [Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def integer_form(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each block of 32 weights as the kernel multiplies it, w = scale * q + offset, in float64:
    q [out, nb, 32] the integers its dot products take, scale [out, nb, 32] (one per block, per
    K-quant sub-block, or per 16 for Q6_K), offset [out, nb] (what multiplies the activation
    block's exact sum). Decoded as ggml's C dequantize_row_* loops read the bytes; the
    dequantization test checks it against the gguf package."""
    b = weight.data.numpy().reshape(weight.shape[0], -1, BLOCK_BYTES[weight.qtype])
    rows, nblocks = b.shape[:2]

    def f16(start: int) -> np.ndarray:
        return b[..., start:start + 2].copy().view(np.float16).astype(np.float64)  # [.., 1]

    def low_high(qs: np.ndarray) -> np.ndarray:
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float64)

    if weight.qtype in K_QUANTS:
        q = np.empty((rows, nblocks, 8, 32))
        scale = np.empty_like(q)
        offset = np.zeros((rows, nblocks, 8))
        for j in range(8):
            if weight.qtype in (Q.Q4_K, Q.Q5_K):
                sc = b[..., 4:16].astype(np.int64)
                if j < 4:
                    scale_j, min_j = sc[..., j] & 63, sc[..., j + 4] & 63
                else:
                    scale_j = (sc[..., j + 4] & 0xF) | ((sc[..., j - 4] >> 6) << 4)
                    min_j = (sc[..., j + 4] >> 4) | ((sc[..., j] >> 6) << 4)
                start = 16 if weight.qtype == Q.Q4_K else 48  # Q5_K: 32 bytes of qh first
                qs = b[..., start + 32 * (j // 2):start + 32 * (j // 2) + 32]
                q[:, :, j] = (qs >> 4) if j % 2 else (qs & 0x0F)
                if weight.qtype == Q.Q5_K:
                    q[:, :, j] += 16 * ((b[..., 16:48] >> j) & 1)
                scale[:, :, j] = (f16(0) * scale_j[..., None])
                offset[:, :, j] = -f16(2)[..., 0] * min_j
            else:
                h, s = divmod(j, 4)
                ql = b[..., 64 * h + 32 * (s % 2):64 * h + 32 * (s % 2) + 32]
                qh = b[..., 128 + 32 * h:128 + 32 * h + 32]
                q[:, :, j] = ((ql & 0x0F) if s < 2 else (ql >> 4)) | (((qh >> 2 * s) & 3) << 4)
                q[:, :, j] -= 32
                scales = b[..., 192 + 2 * j:194 + 2 * j].view(np.int8).astype(np.float64)
                scale[:, :, j] = f16(208) * np.repeat(scales, 16, axis=-1)
        q, scale, offset = (a.reshape(rows, nblocks * 8, *a.shape[3:]) for a in (q, scale, offset))
    else:
        d = f16(0)
        if weight.qtype == Q.Q8_0:
            q, offset = b[..., 2:].view(np.int8).astype(np.float64), np.zeros_like(d[..., 0])
        elif weight.qtype == Q.Q4_1:
            q, offset = low_high(b[..., 4:]), f16(2)[..., 0]
        elif weight.qtype == Q.Q4_0:
            q, offset = low_high(b[..., 2:]), -8 * d[..., 0]
        else:  # Q5_0
            bits = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little").astype(np.float64)
            q, offset = low_high(b[..., 6:]) + 16 * bits, -16 * d[..., 0]
        scale = np.broadcast_to(d, q.shape)
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, scale, offset))


def reference_quant_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The kernel's scheme in float64: the activations quantized to int8 (scale amax / 127,
    rounded half to even) per block of 32, or per 256 for the K-quants (llama.cpp's Q8_K); dot
    products with the weight's integers (times their scales), scaled by the activation's scale,
    plus each weight block's offset times the activation block's sum: exact for the 32-wide
    types, the sum of its integers times their scale for the K-quants (as llama.cpp's)."""
    rows, k = x.shape
    nb, group = k // 32, weight.block_weights
    xg = x.float().view(rows, k // group, group)
    scale = xg.abs().amax(-1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    xq = torch.round(xg * inverse[..., None]).double().view(rows, nb, 32)
    scale = scale.double().repeat_interleave(group // 32, dim=-1)  # [rows, nb]
    sums = (xq.sum(-1) * scale if group == 256
            else x.float().view(rows, nb, 32).double().sum(-1))
    q, q_scale, offset = integer_form(weight)
    dots = torch.einsum("rbj,nbj->rnb", xq, q * q_scale)
    return (dots * scale[:, None] + offset[None] * sums[:, None]).sum(-1)


def random_weight(qtype: int, out_features: int = 80, in_features: int = 160,
                  seed: int = 0) -> tuple[torch.Tensor, QuantizedWeight]:
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    return w, quantize(w, qtype)


def random_blocks(qtype: int, out_features: int = 48, in_features: int = 512,
                  seed: int = 0) -> QuantizedWeight:
    """Valid random blocks: the gguf package's quantizer where it has one, else random bytes
    with fp16 scales (d, and dmin for Q4_K) set to finite values of a weight's size."""
    if qtype not in K_QUANTS:
        return random_weight(qtype, out_features, in_features, seed)[1]
    rng = np.random.default_rng(seed)
    nblocks = in_features // 256
    blocks = rng.integers(0, 256, (out_features, nblocks, BLOCK_BYTES[qtype]), dtype=np.uint8)
    scales = rng.uniform(1e-3, 3e-3, (out_features, nblocks, 2)).astype(np.float16)
    if qtype in (Q.Q4_K, Q.Q5_K):
        blocks[..., 0:4] = scales.view(np.uint8)  # d, dmin
    else:
        blocks[..., 208:210] = scales[..., :1].view(np.uint8)  # d
    return QuantizedWeight(qtype, torch.from_numpy(blocks.reshape(out_features, -1)),
                           in_features)


@pytest.fixture
def kernels():
    module = quant_linear_kernels()
    if module is None:
        pytest.skip("native quantized kernels unavailable")
    return module


def assert_dequantizes_as_the_gguf_package(weight: QuantizedWeight, kernels) -> None:
    expected = torch.from_numpy(gguf_dequantize(weight.data.numpy(), weight.qtype)
                                ).view(weight.shape)
    assert torch.equal(kernels.dequantize(weight.data, weight.qtype, weight.in_features),
                       expected)
    # bfloat16 (the float path's GEMM input): rounded as torch rounds, compared as bits
    as_bf16 = kernels.dequantize_bf16(weight.data, weight.qtype, weight.in_features)
    assert torch.equal(as_bf16.view(torch.int16), expected.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(dequantize_torch(weight), expected)
    q, scale, offset = integer_form(weight)  # what the kernel's reference reads
    assert torch.equal((q * scale + offset[..., None]).float().view(weight.shape), expected)


def assert_kernel_matches_its_reference(weight: QuantizedWeight, x: torch.Tensor,
                                        kernels) -> None:
    bias = torch.randn(weight.shape[0])
    out = kernels.quant_linear(x, weight.data, weight.qtype, bias)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], weight.shape[0])
    expected = reference_quant_linear(x, weight) + bias.double()
    tolerance = 1e-5 if x.dtype == torch.float32 else 1e-2  # the output's own rounding
    scale = expected.abs().max().item()
    assert (out.double() - expected).abs().max().item() <= tolerance * scale


@pytest.mark.parametrize("qtype", QTYPES + GGUF_ONLY_QTYPES)
def test_dequantize_equals_the_gguf_package(qtype, kernels):
    assert_dequantizes_as_the_gguf_package(random_blocks(qtype), kernels)


@pytest.mark.parametrize("qtype", QTYPES + GGUF_ONLY_QTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_its_reference(qtype, rows, dtype, kernels):
    weight = random_blocks(qtype, seed=rows)
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(7))
    assert_kernel_matches_its_reference(weight, x.to(dtype), kernels)


@pytest.mark.parametrize("qtype, in_features", [(Q.Q4_0, 224), (Q.Q4_1, 288), (Q.Q8_0, 224),
                                                (Q.Q8_0, 288), (Q.Q5_0, 288), (Q.Q4_K, 768),
                                                (Q.Q5_K, 768), (Q.Q6_K, 768)])
def test_kernel_matches_its_reference_for_every_row_tile(qtype, in_features, kernels):
    """The kernel runs tiles of weight rows by activation rows (the 32-wide types 4 by 2; the
    K-quants 2 by 2 or 4, 4 weight rows for one activation row): 1-9 rows give every partial
    tile, 7 and 9 blocks a row (224, 288 weights) odd counts of blocks, and 37 output rows are
    no multiple of the threads' chunks of 16 nor of the weight tiles."""
    weight = random_blocks(qtype, out_features=37, in_features=in_features, seed=in_features)
    x = torch.randn(9, in_features, generator=torch.Generator().manual_seed(5))
    for rows in range(1, 10):
        assert_kernel_matches_its_reference(weight, x[:rows], kernels)


@pytest.mark.parametrize("qtype", QTYPES + GGUF_ONLY_QTYPES)
def test_rows_do_not_depend_on_the_batch(qtype, kernels):
    """A row's output is the same bits alone as in a batch of any size (a decode step against a
    prefill chunk): every tile runs the same arithmetic for each (row, output) pair. 70 rows
    span two of the GEMM's blocks of 64 rows."""
    weight = random_blocks(qtype, out_features=37, in_features=512, seed=3)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(11))
    batch = kernels.quant_linear(x, weight.data, int(qtype), None)
    for r in (0, 5, 63, 64, 69):
        alone = kernels.quant_linear(x[r:r + 1], weight.data, int(qtype), None)
        assert torch.equal(alone[0], batch[r]), r


@pytest.mark.parametrize("qtype", QTYPES + GGUF_ONLY_QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_integer_gemm_matches_its_reference(qtype, dtype, kernels):
    """The GEMM of many rows (panels of 8 or 16 weight rows repacked per call, tiles of 3 or 6
    activation rows, 4 for AVX2's K-quants) computes the row kernel's scheme: 37 outputs leave
    a partial panel, 1-14 rows every partial tile, 288 and 768 weights odd counts of blocks. A
    type the build serves only row by row (Q8_0 without VNNI: q + 128 overflows maddubs' 16-bit
    pairs) is refused."""
    if not kernels.quant_gemm_types():
        pytest.skip("this build has no integer GEMM (not x86-64 with AVX2)")
    check_gemm_against_reference(qtype, dtype, kernels)


def check_gemm_against_reference(qtype: int, dtype: torch.dtype, kernels) -> None:
    in_features = 768 if qtype in K_QUANTS else 288
    weight = random_blocks(qtype, out_features=37, in_features=in_features, seed=in_features)
    x = torch.randn(14, in_features, generator=torch.Generator().manual_seed(9)).to(dtype)
    if int(qtype) not in kernels.quant_gemm_types():
        assert qtype == Q.Q8_0 and kernels.quant_gemm_types()  # only on the AVX2 build
        with pytest.raises(RuntimeError, match="no integer GEMM"):
            kernels.quant_gemm_parts(x, [weight.data], [int(qtype)], None)
        return
    bias = torch.randn(37)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # the output's own rounding
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 14):
        out = kernels.quant_gemm_parts(x[:rows], [weight.data], [int(qtype)], bias)
        assert out.dtype == dtype and out.shape == (rows, 37)
        expected = reference_quant_linear(x[:rows], weight) + bias.double()
        scale = expected.abs().max().item()
        assert (out.double() - expected).abs().max().item() <= tolerance * scale, rows
        # Without a bias, bfloat16 outputs are rounded in the kernel: as torch rounds them
        unbiased = kernels.quant_gemm_parts(x[:rows], [weight.data], [int(qtype)], None)
        assert torch.equal(unbiased, kernels.quant_gemm_parts(
            x[:rows], [weight.data], [int(qtype)], torch.zeros(37)))


# Each type's bytes of quantized values in a block (the rest: scales, offsets).
VALUE_BYTES = {Q.Q4_0: slice(2, 18), Q.Q4_1: slice(4, 20), Q.Q5_0: slice(2, 22),
               Q.Q8_0: slice(2, 34), Q.Q4_K: slice(16, 144), Q.Q5_K: slice(16, 176),
               Q.Q6_K: slice(0, 192)}


# The K-quants' sub-block scales and the byte that gives each its largest magnitude: 63 for
# Q4_K/Q5_K's 6-bit scales and mins, -128 for Q6_K's signed 8-bit scales.
SCALE_BYTES = {Q.Q4_K: (slice(4, 16), 0xFF), Q.Q5_K: (slice(4, 16), 0xFF),
               Q.Q6_K: (slice(192, 208), 0x80)}


def check_largest_products(qtype: int, kernels) -> None:
    """Every weight at its type's largest stored value (all bits set), a K-quant's sub-block
    scales at their largest magnitude, against activations all quantized to +127 or all to
    -127: the GEMM's integer sums at their extremes (AVX2 adds several vectors' 16-bit pair
    sums before widening them, and sums a K-quant's super-block in int32 under its integer
    scales) still equal the reference."""
    in_features = 512 if qtype in K_QUANTS else 256
    weight = random_blocks(qtype, out_features=24, in_features=in_features)
    blocks = weight.data.view(24, -1, BLOCK_BYTES[qtype]).clone()
    if qtype == Q.Q8_0:  # signed bytes: 127 is the largest, -127 its opposite
        blocks[..., VALUE_BYTES[qtype]] = 127
    else:
        blocks[..., VALUE_BYTES[qtype]] = 0xFF
    if qtype in SCALE_BYTES:
        where, value = SCALE_BYTES[qtype]
        blocks[..., where] = value
    weight = QuantizedWeight(qtype, blocks.view(24, -1), in_features)
    for sign in (1.0, -1.0):
        x = torch.full((8, in_features), sign)
        out = kernels.quant_gemm_parts(x, [weight.data], [int(qtype)], None)
        expected = reference_quant_linear(x, weight)
        assert (out.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


@pytest.mark.parametrize("qtype", QTYPES + GGUF_ONLY_QTYPES)
def test_integer_gemm_sums_the_largest_products_exactly(qtype, kernels):
    if not kernels.quant_gemm_types():
        pytest.skip("this build has no integer GEMM (not x86-64 with AVX2)")
    if int(qtype) not in kernels.quant_gemm_types():
        assert qtype == Q.Q8_0  # only on the AVX2 build, served row by row
        return
    check_largest_products(qtype, kernels)


AVX2_LARGEST = ("import sys\n"
                "sys.path.insert(0, 'tests')\n"
                "from treadle.model import kernels\n"
                "assert kernels.this_build().variant == 'avx2', kernels.this_build()\n"
                "module = kernels.quant_linear_kernels()\n"
                "from test_quantized import check_largest_products\n"
                "from test_quantized import check_gemm_against_reference\n"
                "import torch\n"
                "for qtype in module.quant_gemm_types():\n"
                "    check_largest_products(qtype, module)\n"
                "    for dtype in (torch.float32, torch.bfloat16):\n"
                "        check_gemm_against_reference(qtype, dtype, module)\n"
                "print('ok')\n")


def test_the_avx2_variant_sums_the_largest_products_exactly(kernels):
    """The AVX2 build's 16-bit partial sums and its K-quants' integer tiles: on an AVX-512
    machine, whose own build never runs them, in a child process forced to the AVX2 variant
    (against the reference too); elsewhere in this one."""
    if this_build().variant != "avx512":
        for qtype in kernels.quant_gemm_types():
            check_largest_products(qtype, kernels)
        return
    done = run_forced(["-c", AVX2_LARGEST], AVX2_ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_row_kernels_give_the_integer_gemm_s_bits_for_the_32_wide_types(dtype, kernels):
    """A layer of these types may take either kernel at any row count and a row's result stays
    the same: 37 outputs leave a partial tile of 8 (and of the GEMM's panels), 1-9 rows every
    row tile, parts of different types side by side, with and without a bias. The K-quants'
    kernels round otherwise and are not listed."""
    same = set(kernels.quant_gemm_same_bits_types())
    if not kernels.quant_gemm_types():
        pytest.skip("this build has no integer GEMM (not x86-64 with AVX2)")
    assert same == {int(q) for q in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0)} & set(
        kernels.quant_gemm_types())
    parts = [random_blocks(Q(qtype), out_features=37, in_features=288, seed=qtype)
             for qtype in sorted(same)]
    for part in parts:
        part.data[5, :2] = 0  # a block whose scale is zero
        if part.qtype == Q.Q8_0:  # a block of -128s (no quantizer writes them)
            part.data[2, 34 + 2:34 + 34] = 0x80
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 288, generator=gen)
    x[0, 64:96] = 0  # a zero block: scale 0
    x[1, :32] = 5 + 0.01 * torch.randn(32, generator=gen)  # a large mean: large offset sums
    x[2, 32:64] = 1e-39  # subnormal values: a scale below FLT_MIN
    x = x.to(dtype)
    data, qtypes = [p.data for p in parts], [p.qtype for p in parts]
    for bias in (None, torch.randn(37 * len(parts))):
        for rows in range(1, 10):
            rows_out = kernels.quant_linear_parts(x[:rows], data, qtypes, bias)
            assert torch.equal(rows_out, kernels.quant_gemm_parts(x[:rows], data, qtypes, bias))


def test_a_layer_s_batch_path_is_the_integer_gemm_unless_a_dense_copy_is_kept(kernels):
    if not kernels.quant_gemm_types():
        pytest.skip("this build has no integer GEMM (not x86-64 with AVX2)")
    parts = [random_blocks(Q.Q4_K, 40, seed=1), random_blocks(Q.Q6_K, 24, seed=2)]
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(3))
    layer = make_linear(parts)
    assert layer.integer_gemm and x.shape[0] > layer.max_gemv_rows
    assert torch.equal(layer(x), kernels.quant_gemm_parts(x, layer.data, layer.qtypes, None))
    dense = make_linear(parts, dense_for_batches=True)
    assert not dense.integer_gemm and torch.equal(dense(x), dense.dense(x))


def test_parts_of_different_types_stack_along_the_output_axis(kernels):
    """q/k/v stored in different types (a Q4_K_M file's Q6_K v_proj beside Q4_K q and k) stay
    apart, each read as stored, and the outputs come back side by side."""
    parts = [random_blocks(Q.Q4_K, 48, seed=1), random_blocks(Q.Q6_K, 16, seed=2),
             random_blocks(Q.Q8_0, 8, seed=3)]
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(72)
    got = kernels.quant_linear_parts(x, [p.data for p in parts], [p.qtype for p in parts], bias)
    expected = torch.cat([kernels.quant_linear(x, p.data, p.qtype, None) for p in parts], 1)
    assert torch.equal(got, expected + bias)
    layer = make_linear(parts)
    assert isinstance(layer, QuantizedLinear) and layer.shape == (72, 512)
    assert layer.type_name == "Q4_K+Q6_K+Q8_0" and layer.nbytes == sum(p.nbytes for p in parts)
    assert torch.equal(layer(x), kernels.quant_linear_parts(x, layer.data, layer.qtypes, None))


def test_kernel_refuses_misshaped_weights(kernels):
    _, weight = random_weight(Q.Q4_1)
    with pytest.raises(RuntimeError, match="bytes"):
        kernels.quant_linear(torch.randn(2, 128), weight.data, int(Q.Q4_1), None)
    with pytest.raises(RuntimeError, match="unsupported"):
        kernels.quant_linear(torch.randn(2, 160), weight.data, int(Q.Q2_K), None)
    k_quant = random_blocks(Q.Q4_K)  # 256 weights a super-block
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernels.quant_linear(torch.randn(2, 480), k_quant.data[:, :-144].contiguous(),
                              int(Q.Q4_K), None)


@pytest.mark.parametrize("qtype", QTYPES + GGUF_ONLY_QTYPES)
def test_layer_stays_close_to_its_float_weights_on_every_path(qtype, monkeypatch):
    weight = random_blocks(qtype)
    dense = dequantize_torch(weight)
    layer = QuantizedLinear(weight)
    # The float path's slices: 16 rows (of 48 or 80) at a time.
    monkeypatch.setattr(linear, "DEQUANTIZED_SLICE_BYTES", 16 * 4 * weight.in_features)
    torch.manual_seed(qtype)  # the activations: the same draw whatever ran before
    for rows in (1, 9, 70):  # a decode step, a GEMM's partial tiles, two blocks of rows
        x = torch.randn(rows, weight.in_features)
        expected = F.linear(x, dense)
        # int8 activations cost about 1% of the output's scale (worst of 100 draws: 2.4%, Q5_0)
        integer = layer.integer_path(x) if layer.kernels is not None else expected
        assert (integer - expected).abs().max() <= 3e-2 * expected.abs().max()
        # dequantized slices + GEMM: nothing (in float32)
        assert (layer.float_path(x) - expected).abs().max() <= 1e-5 * expected.abs().max()
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(5, weight.in_features).to(dtype)
        got = layer.float_path(x).float()
        expected = F.linear(x, dense.to(dtype)).float()
        assert (got - expected).abs().max() <= tolerance * expected.abs().max()
    monkeypatch.setattr(layer, "kernels", None)  # no compiler: the torch path, same weights
    x = torch.randn(2, weight.in_features)
    assert torch.allclose(layer(x), F.linear(x, dense), atol=1e-5)


def test_stacked_quantized_weights_stay_blocks_and_a_mix_with_floats_goes_dense():
    (_, a), (wb, b) = random_weight(Q.Q4_1, seed=1), random_weight(Q.Q4_1, seed=2)
    stacked = make_linear([a, b])
    assert isinstance(stacked, QuantizedLinear) and stacked.shape == (160, 160)
    assert stacked.data[0] is a.data and stacked.data[1] is b.data  # no copy
    x = torch.randn(linear.QUANT_GEMV_MAX_ROWS + 1, 160)
    assert torch.allclose(stacked.float_path(x), torch.cat([F.linear(x, dequantize_torch(w))
                                                            for w in (a, b)], dim=1), atol=1e-4)
    mixed = make_linear([a, wb])
    assert isinstance(mixed, linear.Linear)


def test_a_dense_copy_serves_batches_as_the_float_path():
    _, weight = random_weight(Q.Q4_1)
    layer = make_linear([weight], dense_for_batches=True)
    assert isinstance(layer, QuantizedLinear) and layer.dense is not None
    assert layer.resident_bytes == weight.nbytes + layer.dense.nbytes
    x = torch.randn(linear.QUANT_GEMV_MAX_ROWS + 1, weight.in_features)
    assert torch.equal(layer(x), linear.Linear(dequantize_torch(weight))(x))


def test_crossover_is_measured_per_shape_and_shared_by_its_layers():
    (_, a), (_, b) = random_weight(Q.Q4_1, seed=1), random_weight(Q.Q4_1, seed=2)
    _, c = random_weight(Q.Q8_0, out_features=32)
    layers = [QuantizedLinear(w) for w in (a, b, c)]
    if layers[0].kernels is None:
        pytest.skip("native quantized kernels unavailable")
    chosen = linear.tune_gemv_rows(layers, torch.float32)
    assert set(chosen) == {"80x160 Q4_1", "32x160 Q8_0"}
    assert all(rows in linear.TUNE_ROWS for rows in chosen.values())  # the kernel takes 1
    assert layers[0].max_gemv_rows == layers[1].max_gemv_rows == chosen["80x160 Q4_1"]
    assert layers[2].max_gemv_rows == chosen["32x160 Q8_0"]


def test_resolve_quantization():
    assert resolve_quantization("auto", is_gguf=True) == "gguf"
    assert resolve_quantization("auto", is_gguf=False) == "none"
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_quantization("q3", is_gguf=True)


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_model_served_as_stored_stays_close_to_its_dequantized_weights(qtype, tmp_path):
    model = build_tiny_model("llama", tmp_path)
    spec = read_spec(tmp_path)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, spec, path, qtype)

    def runner(keep_quantized: bool) -> ModelRunner:
        weights = read_gguf_weights(path, spec, keep_quantized=keep_quantized)
        loaded = LoadedModel(spec, weights, tmp_path, "tiny",
                             "gguf" if keep_quantized else "none")
        return ModelRunner(loaded, ModelConfig(dtype="float32", quant_gemv_max_rows=5),
                           CacheConfig(block_size=4, num_blocks=128))

    quantized, dense = runner(True), runner(False)
    assert quantized.quantized_types == {Q(qtype).name: 7 * spec.num_layers + 2}
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = dense.execute(ModelInput([ScheduledSequence(ids, 0, list(range(10)),
                                                           all_logits=True)]))
    # Chunks of 5 rows: every layer runs the kernel's integer path (a whole-prompt step of 40
    # rows would dequantize and run one GEMM).
    got = torch.cat([quantized.execute(ModelInput([ScheduledSequence(
        ids[s:s + 5], s, list(range(10)), all_logits=True)])) for s in range(0, 40, 5)])
    # int8 activations against 4-bit weights' integers cost more than against 8-bit ones;
    # a wiring fault (a row order, a block offset) costs the whole scale.
    tolerance = 0.05 if qtype == Q.Q8_0 else 0.1
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("mode, qtype", [("int8", Q.Q8_0), ("int4", Q.Q4_1)])
def test_float_model_quantized_at_load(mode, qtype, tmp_path):
    model = build_tiny_model("qwen2", tmp_path)
    quantized = make_runner(tmp_path, quantization=mode, quant_gemv_max_rows=6)
    assert quantized.quantized_types == {Q(qtype).name: 7 * 2 + 2}
    dense = make_runner(tmp_path)
    assert quantized.model.weight_bytes() < dense.model.weight_bytes() / (3 if mode == "int8"
                                                                           else 5)
    loaded = load_model(str(tmp_path), torch.float32, mode)
    for name, original in model.state_dict().items():
        weight = loaded.weights[name]
        if not isinstance(weight, QuantizedWeight):
            continue
        # Within half a quantization step of each block: amax / 127 (Q8_0), range / 15 (Q4_1).
        step = (original.abs().max() / 127 if mode == "int8"
                else (original.max() - original.min()) / 15)
        assert (dequantize_torch(weight) - original).abs().max() <= step / 2 * 1.05  # fp16 d
    # The same quantized weights as dense floats: what serving them as blocks must stay near.
    as_float = {k: dequantize_torch(v) if isinstance(v, QuantizedWeight) else v
                for k, v in loaded.weights.items()}
    reference = ModelRunner(LoadedModel(loaded.spec, as_float, tmp_path, "tiny"),
                            ModelConfig(dtype="float32"), CacheConfig(num_blocks=8))
    ids = list(range(3, 45))
    expected = reference.execute(ModelInput([ScheduledSequence(ids, 0, [0, 1, 2],
                                                               all_logits=True)]))
    got = torch.cat([quantized.execute(ModelInput([ScheduledSequence(
        ids[s:s + 6], s, [0, 1, 2], all_logits=True)])) for s in range(0, 42, 6)])
    tolerance = 0.05 if mode == "int8" else 0.1
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("arch, dtype, row_kernel_rows, kv_cache_dtype", [
    ("llama", "float32", 4, "auto"), ("qwen2", "bfloat16", 4, "auto"),
    ("llama", "bfloat16", 1, "auto"), ("llama", "float32", 4, "int8"),
    ("qwen2", "bfloat16", 1, "int8"), ("llama", "float32", 4, "float32")])
def test_native_decoder_steps_give_the_bits_of_the_layer_by_layer_path(
        arch, dtype, row_kernel_rows, kv_cache_dtype, tmp_path, kernels, monkeypatch):
    """The native decoder runs a whole decode step in one call: the same kernels in the same
    order as the Python layers, so the same logits to the bit (qwen2: with the qkv bias), over
    sequences of different lengths whose new keys land in different blocks; steps of more rows
    than the row kernels take run the integer GEMM inside it. An int8 cache gets the same bytes
    and scales from both."""
    if row_kernel_rows == 1 and not kernels.quant_gemm_types():
        pytest.skip("no integer GEMM in this build: the fused decoder takes one row")
    build_tiny_model(arch, tmp_path)
    native, layered = (make_runner(tmp_path, dtype, block_size=4, quantization="int4",
                                   quant_gemv_max_rows=row_kernel_rows,
                                   kv_cache_dtype=kv_cache_dtype) for _ in range(2))
    taken = []
    fused_decode = LlamaModel.fused_decode

    def record(model, meta, hidden):
        taken.append(fused_decode(model, meta, hidden) if model is native.model else False)
        return taken[-1]

    monkeypatch.setattr(LlamaModel, "fused_decode", record)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 9, 14)]
    tables = [list(range(10 * i, 10 * i + 10)) for i in range(len(prompts))]
    for runner in (native, layered):
        for prompt, table in zip(prompts, tables, strict=True):
            runner.execute(ModelInput([ScheduledSequence(prompt, 0, table)]))
    lengths = [len(p) for p in prompts]
    for step in range(6):
        batch = ModelInput([ScheduledSequence([40 + step + i], lengths[i], tables[i])
                            for i in range(len(prompts)) if step % 3 or i != 1])
        got, expected = native.execute(batch), layered.execute(batch)
        assert taken[-2:] == [True, False]
        assert torch.equal(got, expected), step
        lengths = [n + 1 if step % 3 or i != 1 else n for i, n in enumerate(lengths)]
    for name in ("keys", "values", "key_scales", "value_scales"):
        for mine, theirs in zip(getattr(native.kv_cache, name), getattr(layered.kv_cache, name),
                                strict=True):
            assert (mine is None and theirs is None) or torch.equal(mine, theirs), name
    native.model.native_decoder_rows = 2  # as where a projection has no integer GEMM
    batch = ModelInput([ScheduledSequence([7], n, t) for n, t in zip(lengths, tables, strict=True)])
    native.execute(batch)
    assert taken[-1] is False


def test_stored_blocks_are_the_files_bytes(tmp_path):
    """Served as stored: the blocks in memory are the file's, rows un-permuted as bytes."""
    model = build_tiny_model("llama", tmp_path)
    spec = read_spec(tmp_path)
    expected = write_tiny_gguf(model, spec, tmp_path / "tiny.gguf", Q.Q4_1)
    weights = read_gguf_weights(tmp_path / "tiny.gguf", spec, keep_quantized=True)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedWeight) and q.data.dtype == torch.uint8
    np.testing.assert_array_equal(dequantize_torch(q).numpy(),
                                  expected["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("qtype", QTYPES + GGUF_ONLY_QTYPES)
def test_column_slices_stay_blocks_on_block_boundaries_and_go_dense_inside_one(qtype):
    """Tensor parallelism's input-feature slices: bytes on the type's block boundaries (256 for
    K-quants), dequantized floats where a block would be cut."""
    weight = random_blocks(qtype, in_features=1024)
    dense = dequantize_torch(weight)
    whole = slice_columns(weight, range(256, 768))
    assert isinstance(whole, QuantizedWeight) and whole.shape == (48, 512)
    assert torch.equal(dequantize_torch(whole), dense[:, 256:768])
    cut = slice_columns(weight, range(0, 288))  # 9 blocks of 32, not whole super-blocks
    assert isinstance(cut, QuantizedWeight) == (weight.block_weights == 32)
    assert torch.equal(dequantize_torch(cut) if isinstance(cut, QuantizedWeight) else cut,
                       dense[:, :288])


@pytest.mark.gemma3_model
@pytest.mark.parametrize("name, qtype", [("blk.0.attn_q.weight", Q.Q5_0),
                                         ("blk.0.attn_output.weight", Q.Q4_K),
                                         ("blk.0.ffn_down.weight", Q.Q6_K)])
def test_real_gemma3_matrices(name, qtype, gemma_path, kernels):
    """The first 64 rows of Gemma 3 270M's own matrices: dequantized as the gguf package does,
    multiplied as the kernel's reference says, and close to the float product."""
    tensor = next(t for t in read_gguf(gemma_path).tensors if t.name == name)
    assert tensor.tensor_type == qtype
    blocks = torch.from_numpy(np.array(tensor.data[:64]))
    weight = QuantizedWeight(int(qtype), blocks, int(tensor.shape[0]))
    assert_dequantizes_as_the_gguf_package(weight, kernels)
    x = torch.randn(3, weight.in_features, generator=torch.Generator().manual_seed(1))
    assert_kernel_matches_its_reference(weight, x, kernels)
    expected = F.linear(x, dequantize_torch(weight))
    got = kernels.quant_linear(x, weight.data, int(qtype), None)
    # int8 activations: measured at most 2.2% of the output's scale (Q5_0 attn_q)
    assert (got - expected).abs().max() <= 0.05 * expected.abs().max()


@pytest.mark.gemma3_model
def test_real_gemma3_served_as_stored_stays_close_to_its_dequantized_weights(gemma_path):
    """Gemma 3 270M (Q5_0, Q4_K, Q6_K and Q8_0 matrices) served as its blocks, every step of at
    most 8 rows on the kernel's integer path, against the same weights dequantized (what
    `--quantization none` serves: the dequantization equals the gguf package's)."""
    loaded = load_model(str(gemma_path), torch.float32, "gguf")
    assert set(loaded.quantized_types()) == {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    cache = CacheConfig(block_size=16, num_blocks=16)
    quantized = ModelRunner(loaded, ModelConfig(dtype="float32", quant_gemv_max_rows=8,
                                                dense_batch_weights=False), cache)
    as_float = {k: dequantize(v) if isinstance(v, QuantizedWeight) else v
                for k, v in loaded.weights.items()}
    dense = ModelRunner(LoadedModel(loaded.spec, as_float, loaded.folder, loaded.name),
                        ModelConfig(dtype="float32"), cache)
    # A decode step reads each matrix's blocks as the file stores them.
    stored = {t.name: t.n_bytes for t in read_gguf(gemma_path).tensors}
    layer = quantized.model.layers[0]
    assert layer["o"].nbytes == stored["blk.0.attn_output.weight"]  # Q4_K
    assert layer["down"].nbytes == stored["blk.0.ffn_down.weight"]  # Q6_K
    assert layer["gate_up"].nbytes == (stored["blk.0.ffn_gate.weight"]
                                       + stored["blk.0.ffn_up.weight"])  # Q5_0
    prompt = [2, 818, 5279, 529, 7001, 563]  # <bos>The capital of France is
    ids = prompt + list(range(1000, 1010))
    table = list(range(1))
    expected = dense.execute(ModelInput([ScheduledSequence(ids, 0, table, all_logits=True)]))
    got = torch.cat([quantized.execute(ModelInput([ScheduledSequence(
        ids[s:s + 8], s, table, all_logits=True)])) for s in range(0, len(ids), 8)])
    # Measured: 5% of the logits' scale (int8 activations against 4- and 5-bit weights); a
    # wiring fault (a nibble order, a scale's index) costs the whole scale.
    assert (got - expected).abs().max() <= 0.1 * expected.abs().max()
    # Greedy picks, teacher-forced on the float path's own continuation: equal wherever the
    # float path is not at a near-tie (free-running, a tie at step 6 flipped with the summation
    # order of one kernel change, and everything after it differed). What a near-tie is, was
    # measured: the int8 activations' rounding is chaotic, and a 1e-7 relative change to the
    # norms' outputs (a native norm kernel) moved the quantized path's margin between the float
    # path's top two by up to 0.36, and flipped a pick whose float margin was 0.26.
    reference = greedy_decode(dense, [prompt], 10)[0]
    full = prompt + reference
    want = dense.execute(ModelInput([ScheduledSequence(full, 0, table, all_logits=True)]))
    have = torch.cat([quantized.execute(ModelInput([ScheduledSequence(
        full[s:s + 8], s, table, all_logits=True)])) for s in range(0, len(full), 8)])
    picks = slice(len(prompt) - 1, len(full) - 1)
    top2 = want[picks].topk(2, dim=-1).values
    confident = (top2[:, 0] - top2[:, 1]) > 0.5
    assert confident.sum() >= 6
    assert torch.equal(have[picks].argmax(-1)[confident], want[picks].argmax(-1)[confident])


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.IQ4_XS, Q.Q5_1])
def test_types_not_served_as_stored_load_as_the_gguf_package_dequantizes_them(qtype, tmp_path):
    """A matrix in a type the kernels do not serve (random bytes: every pattern is a block)
    loads as the gguf package dequantizes it, its q rows un-permuted after; a type nothing
    dequantizes is a ModelLoadError naming it."""
    build_tiny_model("llama", tmp_path)
    spec = read_spec(tmp_path)
    rows = spec.num_heads * spec.head_dim
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    stored = np.random.default_rng(qtype).integers(0, 256, (rows, 256 // block * size),
                                                   dtype=np.uint8)
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", stored, raw_dtype=qtype)
    unserved = np.zeros((8, 256 // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_k.weight", unserved, raw_dtype=Q.Q8_1)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file,
                  writer.write_tensors_to_file, writer.close):
        write()
    q, k = read_gguf(tmp_path / "q.gguf").tensors
    fix = FAMILY.gguf_fix
    got = gguf_weight(q, "model.layers.0.self_attn.q_proj.weight", spec, fix, True)
    assert got.dtype == torch.float32 and got.shape == (rows, 256)
    np.testing.assert_array_equal(permute_like_llama_cpp(got.numpy(), spec.num_heads),
                                  gguf_dequantize(stored, qtype))
    with pytest.raises(ModelLoadError, match="uses Q8_1, which Treadle cannot serve"):
        gguf_weight(k, "model.layers.0.self_attn.k_proj.weight", spec, fix, True)
