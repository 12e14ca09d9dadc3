"""Quantized weights: the native kernel against the same arithmetic in float64 torch, its
dequantization against the gguf package's, and whole models served from quantized blocks
against the same model's dequantized float weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from model_utils import build_tiny_model, make_runner, write_tiny_gguf

from treadle.config import CacheConfig, ModelConfig
from treadle.model import linear
from treadle.model.kernels import quant_linear_kernels
from treadle.model.linear import QuantizedLinear, make_linear
from treadle.model.loader import LoadedModel, load_model, read_gguf_weights, read_spec
from treadle.model.quantization import (
    BLOCK_BYTES,
    QuantizedWeight,
    dequantize_torch,
    quantize,
    resolve_quantization,
)
from treadle.model.runner import ModelInput, ModelRunner, ScheduledSequence

QTYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


def reference_quant_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The kernel's scheme in float64: each activation block of 32 quantized to int8 (scale
    amax / 127, rounded half to even), integer dot products with the weight's integers, scaled
    by both scales, plus the weight's offset times the activation block's exact sum."""
    rows, k = x.shape
    nb = k // 32
    xb = x.float().view(rows, nb, 32)
    scale = xb.abs().amax(-1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    xq = torch.round(xb * inverse[..., None]).double()
    blocks = weight.data.view(weight.data.shape[0], nb, BLOCK_BYTES[weight.qtype])
    d = blocks[..., 0:2].contiguous().view(torch.float16).double()[..., 0]
    if weight.qtype == Q.Q8_0:
        q, m = blocks[..., 2:].contiguous().view(torch.int8).double(), torch.zeros_like(d)
    else:
        qs = blocks[..., 4:] if weight.qtype == Q.Q4_1 else blocks[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], -1).double()
        m = (blocks[..., 2:4].contiguous().view(torch.float16).double()[..., 0]
             if weight.qtype == Q.Q4_1 else -8 * d)
    dots = torch.einsum("rbj,nbj->rnb", xq, q)
    return (dots * d[None] * scale.double()[:, None]
            + m[None] * xb.double().sum(-1)[:, None]).sum(-1)


def random_weight(qtype: int, out_features: int = 80, in_features: int = 160,
                  seed: int = 0) -> tuple[torch.Tensor, QuantizedWeight]:
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    return w, quantize(w, qtype)


@pytest.fixture
def kernels():
    module = quant_linear_kernels()
    if module is None:
        pytest.skip("native quantized kernels unavailable")
    return module


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_equals_the_gguf_package(qtype, kernels):
    _, weight = random_weight(qtype)
    expected = torch.from_numpy(gguf_dequantize(weight.data.numpy(), qtype)).view(weight.shape)
    assert torch.equal(kernels.dequantize(weight.data, qtype, weight.in_features), expected)
    assert torch.equal(dequantize_torch(weight), expected)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_its_reference(qtype, rows, dtype, kernels):
    _, weight = random_weight(qtype, seed=rows)
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(7))
    x = x.to(dtype)
    bias = torch.randn(weight.shape[0])
    out = kernels.quant_linear(x, weight.data, qtype, bias)
    assert out.dtype == dtype and out.shape == (rows, weight.shape[0])
    expected = reference_quant_linear(x, weight) + bias.double()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # the output's own rounding
    scale = expected.abs().max().item()
    assert (out.double() - expected).abs().max().item() <= tolerance * scale


def test_kernel_refuses_misshaped_weights(kernels):
    _, weight = random_weight(Q.Q4_1)
    with pytest.raises(RuntimeError, match="bytes"):
        kernels.quant_linear(torch.randn(2, 128), weight.data, int(Q.Q4_1), None)
    with pytest.raises(RuntimeError, match="unsupported"):
        kernels.quant_linear(torch.randn(2, 160), weight.data, 12, None)


@pytest.mark.parametrize("qtype", QTYPES)
def test_layer_stays_close_to_its_float_weights_on_every_path(qtype, monkeypatch):
    _, weight = random_weight(qtype)
    dense = dequantize_torch(weight)
    layer = QuantizedLinear(weight)
    for rows in (1, linear.QUANT_GEMV_MAX_ROWS + 5):
        x = torch.randn(rows, weight.in_features)
        expected = F.linear(x, dense)
        # int8 activations cost about 1% of the output's scale; dequantize + GEMM nothing.
        tolerance = 2e-2 if rows <= linear.QUANT_GEMV_MAX_ROWS else 1e-5
        assert (layer(x) - expected).abs().max() <= tolerance * expected.abs().max()
    monkeypatch.setattr(layer, "kernels", None)  # no compiler: the torch path, same weights
    x = torch.randn(2, weight.in_features)
    assert torch.allclose(layer(x), F.linear(x, dense), atol=1e-5)


def test_stacked_weights_of_one_type_stay_blocks_and_mixed_ones_go_dense():
    (_, a), (wb, b) = random_weight(Q.Q4_1, seed=1), random_weight(Q.Q4_1, seed=2)
    stacked = make_linear([a, b])
    assert isinstance(stacked, QuantizedLinear) and stacked.weight.shape == (160, 160)
    x = torch.randn(linear.QUANT_GEMV_MAX_ROWS + 1, 160)
    assert torch.allclose(stacked(x), torch.cat([F.linear(x, dequantize_torch(w))
                                                 for w in (a, b)], dim=1), atol=1e-4)
    mixed = make_linear([a, quantize(wb, Q.Q8_0)])
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
    assert all(rows in (0, *linear.TUNE_ROWS) for rows in chosen.values())
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
