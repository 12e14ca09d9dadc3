"""--load-format dummy: random weights of the shapes a config.json gives, for measuring models
nobody can download here; a config-only folder (bench/configs/) takes the default model's
tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_utils import TINY

from treadle.core.sampling_params import SamplingParams
from treadle.llm import LLM
from treadle.model.loader import DUMMY_RANGE, load_model, read_spec
from treadle.model.quantization import QuantizedWeight, dequantize_torch
from treadle.model.source import ModelLoadError, resolve_model

CONFIGS = Path(__file__).parent.parent / "bench" / "configs"


@pytest.fixture(scope="module")
def config_folder(tmp_path_factory) -> Path:
    """A tiny Llama's config.json alone: no weights, no tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-config")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY,
        "vocab_size": 49152, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}))
    return folder


def test_a_config_alone_takes_the_default_models_tokenizer(config_folder):
    source = resolve_model(config_folder)
    assert not source.has_weights and source.name == config_folder.name
    default = resolve_model(None).folder
    assert (source.folder / "tokenizer.json").read_bytes() == \
        (default / "tokenizer.json").read_bytes()
    assert json.loads((source.folder / "config.json").read_text())["hidden_size"] == 64


def test_without_dummy_a_config_alone_says_how_to_serve_it(config_folder):
    with pytest.raises(ModelLoadError, match="--load-format dummy"):
        load_model(str(config_folder), torch.float32)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_dummy_weights_have_every_shape_within_their_range(config_folder, quantization):
    loaded = load_model(str(config_folder), torch.bfloat16, quantization, load_format="dummy")
    expected = loaded.spec.expected_shapes()
    assert loaded.weights.keys() == expected.keys()
    for name, weight in loaded.weights.items():
        assert tuple(weight.shape) == expected[name], name
        if isinstance(weight, QuantizedWeight):
            assert quantization != "none"
            values = dequantize_torch(weight)
        else:
            assert weight.dtype == torch.bfloat16
            values = weight.float()
        if len(weight.shape) == 1:
            assert torch.all(values == (1.0 if "norm" in name else 0.0)), name
        else:
            assert values.abs().max() <= DUMMY_RANGE * 1.01 and values.std() > 0, name
    quantized = [w for w in loaded.weights.values() if isinstance(w, QuantizedWeight)]
    assert bool(quantized) == (quantization != "none")
    again = load_model(str(config_folder), torch.bfloat16, quantization, load_format="dummy")
    name = "model.layers.0.mlp.down_proj.weight"
    first, second = loaded.weights[name], again.weights[name]
    assert torch.equal(first.data if isinstance(first, QuantizedWeight) else first,
                       second.data if isinstance(second, QuantizedWeight) else second)


def test_an_engine_serves_dummy_weights(config_folder):
    llm = LLM(model=str(config_folder), load_format="dummy", dtype="float32",
              quantization="int4", num_blocks=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(["Once upon a time", "Hello"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]


@pytest.mark.parametrize("name,billions", [("llama-3.2-1b", 1.0), ("llama-3.2-3b", 3.0),
                                           ("llama-3.1-8b", 7.3), ("qwen3-30b-a3b", 30.1)])
def test_the_shipped_configs_have_their_models_shapes(name, billions):
    spec = read_spec(CONFIGS / name)
    parameters = sum(torch.Size(s).numel() for s in spec.expected_shapes().values())
    # The default model's 49,152-token vocabulary, not the real one: a little smaller.
    assert abs(parameters / 1e9 - billions) < 0.3, parameters


def test_attention_break_even_is_the_matmul_flops_over_attention_s_per_position():
    """Llama-3.2-1B's shape, by hand: a token's matmuls are 2 FLOPs a weight of q, k, v, o and
    the MLP's three in 16 layers; its attention 4 a position, head and dimension."""
    spec = read_spec(CONFIGS / "llama-3.2-1b")
    hidden, kv, mlp = 2048, 8 * 64, 8192
    weights = 16 * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp)
    expected = 2 * weights / (4 * 16 * 32 * 64)
    assert abs(spec.attention_break_even() - expected) / expected < 0.001  # norms: a little
