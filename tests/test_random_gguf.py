"""bench/random_gguf.py: the random-weight GGUF of a config's shape that llama.cpp quantizes for
side-by-side runs, loaded by Treadle and by transformers from the same file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from model_utils import TINY, greedy_decode, make_runner
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from treadle.model.source import default_model_path

SCRIPT = Path(__file__).parent.parent / "bench" / "random_gguf.py"
spec = importlib.util.spec_from_file_location("random_gguf", SCRIPT)
random_gguf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(random_gguf)


def write_config(folder: Path, **overrides) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY,
        "vocab_size": 49152, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}, **overrides}))
    return folder


@pytest.mark.default_model
@pytest.mark.parametrize("tied", [False, True])
def test_the_file_has_the_configs_shape_and_the_default_tokenizer(tmp_path, tied):
    folder = write_config(tmp_path / "cfg", tie_word_embeddings=tied)
    path = tmp_path / "tiny.gguf"
    random_gguf.write_random_gguf(folder, path)
    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.")}
    assert fields == {
        "llama.block_count": 2, "llama.context_length": 256, "llama.embedding_length": 64,
        "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2, "llama.attention.key_length": 16,
        "llama.attention.value_length": 16, "llama.rope.dimension_count": 16,
        "llama.rope.freq_base": 500000.0, "llama.vocab_size": 49152,
        "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-5)}
    tensors = {t.name: t for t in reader.tensors}
    # rope_freqs, the embedding, 9 a layer, the final norm, and an untied output
    assert len(tensors) == 1 + 1 + 9 * TINY["num_hidden_layers"] + 1 + (not tied)
    assert ("output.weight" in tensors) == (not tied)
    assert tensors["blk.1.attn_k.weight"].shape.tolist() == [64, 2 * 16]
    assert tensors["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    # llama3 scaling's factors: transformers' unscaled frequencies over its llama3 ones
    config = LlamaConfig.from_pretrained(folder)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    unscaled = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    factors = torch.from_numpy(tensors["rope_freqs.weight"].data.copy()).double()
    assert torch.allclose(factors, unscaled / scaled.double(), rtol=1e-5)
    assert len(set(factors.tolist())) > 2  # the smoothed band is in the test, not only the ends
    default = gguf.GGUFReader(str(default_model_path()))
    assert (reader.fields["tokenizer.ggml.tokens"].contents()
            == default.fields["tokenizer.ggml.tokens"].contents())
    weights = torch.from_numpy(tensors["blk.0.ffn_up.weight"].data.view("int16").copy())
    std = weights.view(torch.bfloat16).float().std().item()
    assert 0.019 < std < 0.021


@pytest.mark.default_model
def test_treadle_and_transformers_load_the_same_model_from_it(tmp_path):
    path = tmp_path / "tiny.gguf"
    random_gguf.write_random_gguf(write_config(tmp_path / "cfg"), path, seed=3)
    prompt = [1, 504, 3250, 314, 1345, 28, 6082]
    ours = greedy_decode(make_runner(path, quantization="none"), [prompt], 8)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                             eos_token_id=None)[0, len(prompt):].tolist()
    assert ours == theirs


@pytest.mark.default_model
def test_a_mixture_of_experts_shape_loads_in_treadle_and_transformers_alike(tmp_path):
    """Experts stacked per matrix and the router in float32, as llama.cpp's converter writes a
    Qwen3-MoE model."""
    folder = write_config(tmp_path / "cfg", architectures=["Qwen3MoeForCausalLM"],
                          model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, norm_topk_prob=True, head_dim=16,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    path = tmp_path / "tiny-moe.gguf"
    random_gguf.write_random_gguf(folder, path, seed=3)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert tensors["blk.0.ffn_gate_exps.weight"].shape.tolist() == [64, 32, 4]
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    prompt = [1, 504, 3250, 314, 1345, 28, 6082]
    ours = greedy_decode(make_runner(path, quantization="none"), [prompt], 8)[0]
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    config.moe_intermediate_size = 32  # the expert width transformers' conversion misses
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, config=config,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                             eos_token_id=None)[0, len(prompt):].tolist()
    assert ours == theirs


MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 256, "norm_topk_prob": True,
       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.mark.default_model
@pytest.mark.parametrize("moe", [False, True], ids=["llama", "qwen3-moe"])
def test_q4_k_m_blocks_written_directly_follow_llama_cpp_s_mix_and_serve(tmp_path, moe):
    folder = write_config(tmp_path / "cfg", hidden_size=256, intermediate_size=512,
                          num_hidden_layers=8, head_dim=64, **(MOE if moe else {}))
    path = tmp_path / "tiny-q4km.gguf"
    random_gguf.write_random_gguf(folder, path, seed=1, q4_k_m=True)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    down = "ffn_down_exps" if moe else "ffn_down"
    q6_k = {name for name, t in tensors.items() if t.tensor_type == Q.Q6_K}
    # use_more_bits over 8 layers: the first and last eighth (0, 7), and (i - 1) % 3 == 2 (3, 6)
    assert q6_k == {"output.weight"} | {f"blk.{i}.{m}.weight" for i in (0, 3, 6, 7)
                                        for m in ("attn_v", down)}
    assert {t.tensor_type for name, t in tensors.items() if name not in q6_k
            and len(t.shape) > 1 and "ffn_gate_inp" not in name} == {Q.Q4_K}
    for name in ("blk.0.attn_q.weight", f"blk.0.{down}.weight"):
        weights = dequantize(tensors[name].data, tensors[name].tensor_type)
        assert np.isfinite(weights).all() and 0.01 < np.abs(weights).max() < 0.07
    runner = make_runner(path, quantization="auto")
    assert {layer.type_name for layer in runner.model.quantized_layers()} >= {"Q4_K", "Q6_K"}
    tokens = greedy_decode(runner, [[1, 504, 3250, 314]], 4)[0]
    assert len(tokens) == 4


@pytest.mark.default_model
@pytest.mark.parametrize("overrides, message", [
    ({"model_type": "olmoe"}, "only llama, mistral, qwen3_moe"),
    ({"vocab_size": 1000}, "not the default tokenizer"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "only unscaled and llama3"),
])
def test_shapes_it_cannot_write_are_refused(tmp_path, overrides, message):
    with pytest.raises(SystemExit, match=message):
        random_gguf.write_random_gguf(write_config(tmp_path / "cfg", **overrides),
                                      tmp_path / "x.gguf")
