"""Loading: Hugging Face folders (sharded too), GGUF tensors of each quantization, and clear
errors naming what is wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from model_utils import build_tiny_model, make_runner, write_tiny_gguf
from safetensors.torch import load_file, save_file

from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.loader import (
    ModelLoadError,
    load_model,
    read_gguf_weights,
    read_spec,
)


def test_sharded_safetensors_load_like_one_file(tmp_path):
    model = build_tiny_model("qwen2", tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    one = load_model(tmp_path / "one", torch.float32).weights
    sharded = load_model(tmp_path / "sharded", torch.float32).weights
    assert one.keys() == sharded.keys()
    assert all(torch.equal(one[k], sharded[k]) for k in one)


def test_unsupported_architecture_is_named(tmp_path):
    build_tiny_model("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model(tmp_path, torch.float32)


def test_missing_config_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path, torch.float32)


def test_missing_path_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere", torch.float32)


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    build_tiny_model("llama", tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in weights.items() if k != name}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"missing tensor '{name}'"):
        load_model(tmp_path, torch.float32)
    weights[name] = weights[name][:, :10].contiguous()
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"'{name}' has shape \(128, 10\)"):
        load_model(tmp_path, torch.float32)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_tensors_dequantize_and_unpermute(tmp_path, qtype):
    model = build_tiny_model("llama", tmp_path)
    spec = read_spec(tmp_path)
    hf_weights = {k: v.numpy() for k, v in model.state_dict().items()}
    expected = write_tiny_gguf(model, spec, tmp_path / "tiny.gguf", qtype)

    loaded = read_gguf_weights(tmp_path / "tiny.gguf", spec)
    assert loaded.keys() == hf_weights.keys()
    tolerance = {Q.F32: 0, Q.F16: 1e-3, Q.Q8_0: 0.02, Q.Q4_0: 0.2, Q.Q4_1: 0.2}[qtype]
    for name, array in hf_weights.items():
        np.testing.assert_array_equal(loaded[name].numpy(), expected[name])
        assert np.abs(loaded[name].numpy() - array).max() <= tolerance * np.abs(array).max()


def test_bfloat16_runner_stays_close_to_float32(tmp_path):
    build_tiny_model("llama", tmp_path)
    ids = list(range(3, 40))
    seq = ScheduledSequence(ids, 0, [0, 1, 2], all_logits=True)
    fp32 = make_runner(tmp_path).execute(ModelInput([seq]))
    bf16 = make_runner(tmp_path, dtype="bfloat16").execute(ModelInput([seq]))
    assert bf16.dtype == torch.float32
    assert (bf16 - fp32).abs().max().item() < 0.1 * fp32.abs().max().item()


def test_gguf_of_another_family_than_its_config_is_named(tmp_path):
    model = build_tiny_model("llama", tmp_path)
    spec = read_spec(tmp_path)
    write_tiny_gguf(model, spec, tmp_path / "tiny.gguf", Q.F32)
    build_tiny_model("gemma3", tmp_path / "gemma")
    with pytest.raises(ModelLoadError, match="holds a 'llama' model.*'gemma3_text'"):
        read_gguf_weights(tmp_path / "tiny.gguf", read_spec(tmp_path / "gemma"))
