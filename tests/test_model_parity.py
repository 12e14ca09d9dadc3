"""Logits and greedy tokens of our runner against transformers, on tiny random-weight models of
every supported architecture (float32). The runner takes `--device auto`: on a machine with a
GPU (bench/device_check.sh) these compare its CUDA path with transformers on the CPU."""

from __future__ import annotations

import pytest
import torch
from model_utils import ARCHITECTURES, build_tiny_model, greedy_decode, make_runner

from treadle.model.batch import ModelInput, ScheduledSequence


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_logits_match_transformers_at_every_position(arch, tmp_path):
    model = build_tiny_model(arch, tmp_path)
    runner = make_runner(tmp_path, block_size=4, num_blocks=64)
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = reference_logits(model, ids)
    table = list(range(20, 35))  # not starting at block 0

    whole = runner.execute(ModelInput([ScheduledSequence(ids, 0, table, all_logits=True)]))
    assert (whole.cpu() - ref).abs().max().item() < 1e-3

    # Chunks of 7 over the same blocks: later chunks attend to the cached earlier ones.
    chunks = [runner.execute(ModelInput([ScheduledSequence(ids[s:s + 7], s, table,
                                                           all_logits=True)]))
              for s in range(0, len(ids), 7)]
    assert (torch.cat(chunks).cpu() - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_transformers_generate(arch, tmp_path):
    model = build_tiny_model(arch, tmp_path)
    runner = make_runner(tmp_path, block_size=4, num_blocks=256)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 30, 9)]
    ours = greedy_decode(runner, prompts, max_tokens=24, chunk_size=7)
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()


def test_mixed_batch_rows_follow_sequence_order(tmp_path):
    """Decode tokens and prefill chunks in one step: each logits row belongs to its sequence."""
    model = build_tiny_model("llama", tmp_path)
    runner = make_runner(tmp_path, block_size=4, num_blocks=64)
    a = list(range(3, 23))
    b = list(range(40, 52))
    runner.execute(ModelInput([ScheduledSequence(a[:-1], 0, [0, 1, 2, 3, 4])]))
    logits = runner.execute(ModelInput([
        ScheduledSequence(b[:5], 0, [10, 11, 12]),
        ScheduledSequence(a[-1:], len(a) - 1, [0, 1, 2, 3, 4]),  # one decode-shaped token
        ScheduledSequence(b[5:], 5, [10, 11, 12], all_logits=True),
    ]))
    assert logits.shape[0] == 1 + 1 + len(b) - 5
    logits = logits.cpu()
    ref_a, ref_b = reference_logits(model, a), reference_logits(model, b)
    assert (logits[0] - ref_b[4]).abs().max().item() < 1e-3
    assert (logits[1] - ref_a[-1]).abs().max().item() < 1e-3
    assert (logits[2:] - ref_b[5:]).abs().max().item() < 1e-3
