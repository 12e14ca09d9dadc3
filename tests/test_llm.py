"""LLM.generate on the default model (float32): stop strings, n > 1, logprobs and prompt
logprobs, each checked against an independent computation."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_engine_empty
from model_utils import make_runner

from treadle.core.sampling_params import SamplingParams
from treadle.llm import LLM
from treadle.model.batch import ModelInput, ScheduledSequence

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", quantization="none", kv_cache_dtype="float32",
               kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.chat_prompt("Write a haiku about the sea.")


@pytest.fixture(scope="module")
def greedy(llm, prompt):
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0),
                       use_tqdm=False)[0]
    assert_engine_empty(llm.engine)
    return out.outputs[0]


def test_text_is_the_decode_of_the_tokens(llm, greedy):
    assert greedy.text == llm.tokenizer.decode(greedy.token_ids, skip_special_tokens=True)
    assert greedy.finish_reason in ("stop", "length")


def test_stop_string_cuts_the_output(llm, prompt, greedy):
    words = greedy.text.split()
    stop = " ".join(words[3:5])  # two words: spans several tokens
    cut = greedy.text.index(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == greedy.text[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    kept = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop],
                                                 include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == greedy.text[:cut + len(stop)]
    assert_engine_empty(llm.engine)


def test_n_samples_share_the_prompt_blocks_and_differ(llm, prompt):
    kv = llm.engine.kv_cache_manager
    hits = kv.prefix_cache_hits
    params = SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in first.outputs}) == 3
    assert kv.prefix_cache_hits - hits >= 2 * (len(prompt) // 16) * 16
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
    assert_engine_empty(llm.engine)


def test_logprobs_match_the_model(llm, prompt, greedy):
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3,
                                                prompt_logprobs=2), use_tqdm=False)[0]
    runner = make_runner(None, num_blocks=16)
    ids = prompt + greedy.token_ids[:8]
    reference = runner.execute(ModelInput([ScheduledSequence(ids, 0, list(range(16)),
                                                             all_logits=True)]))
    reference = reference.log_softmax(dim=-1)
    sample = out.outputs[0]
    assert sample.token_ids == greedy.token_ids[:8]
    for i, lp in enumerate(sample.logprobs):
        row = reference[len(prompt) - 1 + i]
        assert lp.token_id == sample.token_ids[i] and lp.rank == 1
        assert lp.logprob == pytest.approx(row.max().item(), abs=1e-4)
        assert lp.top_token_ids == row.topk(3).indices.tolist()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position, lp in enumerate(out.prompt_logprobs[1:], start=1):
        expected = reference[position - 1, prompt[position]].item()
        assert lp.token_id == prompt[position]
        assert lp.logprob == pytest.approx(expected, abs=1e-4)
        assert len(lp.top_token_ids) == 2
    assert_engine_empty(llm.engine)


def test_bad_token_ids_in_params_are_refused(llm, prompt):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([prompt], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert_engine_empty(llm.engine)


def test_penalties_change_greedy_output(llm, prompt, greedy):
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0,
                                                repetition_penalty=1.5, frequency_penalty=1.0),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids != greedy.token_ids
    assert torch.tensor(out.token_ids).unique().numel() >= torch.tensor(
        greedy.token_ids).unique().numel()
    assert_engine_empty(llm.engine)
