"""bench/random_gguf.py: the random-weight GGUF of a config's shape that llama.cpp quantizes for
side-by-side runs, loaded by Treadle and by transformers from the same file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import pytest
import torch
from model_utils import TINY, greedy_decode, make_runner
from transformers import AutoModelForCausalLM

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


def test_the_file_has_the_configs_shape_and_the_default_tokenizer(tmp_path):
    path = tmp_path / "tiny.gguf"
    random_gguf.write_random_gguf(write_config(tmp_path / "cfg"), path)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    # rope_freqs, the embedding, 9 a layer, the final norm, the untied output
    assert len(tensors) == 1 + 1 + 9 * TINY["num_hidden_layers"] + 2
    assert tensors["blk.1.attn_k.weight"].shape.tolist() == [64, 2 * 16]
    assert tensors["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    # llama3 scaling: the highest frequencies unscaled, the lowest divided by the factor
    assert tensors["rope_freqs.weight"].data[0] == 1.0
    assert tensors["rope_freqs.weight"].data[-1] == 32.0
    default = gguf.GGUFReader(str(default_model_path()))
    assert (reader.fields["tokenizer.ggml.tokens"].contents()
            == default.fields["tokenizer.ggml.tokens"].contents())
    weights = torch.from_numpy(tensors["blk.0.ffn_up.weight"].data.view("int16").copy())
    std = weights.view(torch.bfloat16).float().std().item()
    assert 0.019 < std < 0.021


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


@pytest.mark.parametrize("overrides, message", [
    ({"model_type": "qwen3_moe"}, "only Llama-family"),
    ({"vocab_size": 1000}, "not the default tokenizer"),
])
def test_shapes_it_cannot_write_are_refused(tmp_path, overrides, message):
    with pytest.raises(SystemExit, match=message):
        random_gguf.write_random_gguf(write_config(tmp_path / "cfg", **overrides),
                                      tmp_path / "x.gguf")
