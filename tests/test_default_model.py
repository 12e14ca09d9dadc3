"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same
GGUF file itself, in float32: logits at every position, and greedy tokens across batching,
chunked prefill and block sizes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from model_utils import greedy_decode, make_runner
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.source import default_model_path

pytestmark = pytest.mark.default_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash map is in two sentences.",
    "List three prime numbers greater than 50.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):",
    "Once upon a time, in a village at the edge of a forest,",
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def tokenizer():
    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_model():
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS[:6]]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in chats + QUESTIONS[6:]]


@pytest.fixture(scope="module")
def runner():
    return make_runner(None, block_size=16, num_blocks=128)


@pytest.fixture(scope="module")
def reference_tokens(runner, prompts):
    return greedy_decode(runner, prompts, MAX_TOKENS)


def test_logits_match_transformers_at_every_position(runner, hf_model, prompts):
    ids = prompts[0] + prompts[6]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    ours = runner.execute(ModelInput([ScheduledSequence(ids, 0, list(range(10, 20)),
                                                        all_logits=True)]))
    assert (ours - ref).abs().max().item() < 1e-3


def test_greedy_matches_transformers_generate(hf_model, prompts, reference_tokens):
    for prompt, tokens in zip(prompts, reference_tokens, strict=True):
        ids = torch.tensor([prompt])
        # An explicit mask: the prompt holds <|im_end|>, which is also the pad token, and
        # generate would otherwise mask it out.
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                    max_new_tokens=MAX_TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=2)
        assert tokens == out[0, len(prompt):].tolist()


def test_greedy_one_at_a_time_equals_batch(runner, prompts, reference_tokens):
    assert greedy_decode(runner, prompts, MAX_TOKENS, together=False) == reference_tokens


def test_greedy_chunked_prefill_equals_batch(runner, prompts, reference_tokens):
    assert greedy_decode(runner, prompts, MAX_TOKENS, chunk_size=7) == reference_tokens


@pytest.mark.parametrize("block_size", [1, 32])
def test_greedy_block_size_does_not_matter(block_size, prompts, reference_tokens):
    runner = make_runner(None, block_size=block_size, num_blocks=2048 // block_size)
    assert greedy_decode(runner, prompts, MAX_TOKENS) == reference_tokens


# Served as stored: the file's Q4_1 matrices (Q8_0 embedding and LM head) through the integer
# kernel, against the float path over the same weights dequantized (the `runner` above).
PERPLEXITY_TEXT = Path(__file__).parent / "data" / "python_license.txt"  # CPython's LICENSE.txt
KERNEL_ROWS = 16  # steps of up to this many rows take the integer kernel (fixed, not measured)


@pytest.fixture(scope="module")
def quantized_runner():
    return make_runner(None, block_size=16, num_blocks=256, quantization="gguf",
                       quant_gemv_max_rows=KERNEL_ROWS)


def test_quantized_greedy_agrees_with_the_float_path(quantized_runner, prompts,
                                                     reference_tokens):
    """Teacher-forced over the float path's greedy continuations: at each of the 8 x 64
    positions, does the quantized model pick the same next token? (Free-running, one early
    disagreement would make every later token differ.)"""
    agree = 0
    for prompt, continuation in zip(prompts, reference_tokens, strict=True):
        ids = prompt + continuation
        logits = run_in_chunks(quantized_runner, ids, KERNEL_ROWS)
        picks = logits[len(prompt) - 1:-1].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(picks, continuation, strict=True))
    rate = agree / (len(prompts) * MAX_TOKENS)
    print(f"quantized greedy picks equal to the float path's: {100 * rate:.1f}%")
    assert rate >= 0.9


def run_in_chunks(runner, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position, `chunk` tokens a step (at most KERNEL_ROWS: each layer runs
    the row kernels, as decode steps do; more: the integer GEMM, as prefill chunks do)."""
    table = list(range((len(ids) + runner.block_size - 1) // runner.block_size))
    return torch.cat([runner.execute(ModelInput([ScheduledSequence(
        ids[s:s + chunk], s, table, all_logits=True)])) for s in range(0, len(ids), chunk)])


def perplexity(runner, ids: list[int], chunk: int) -> float:
    """exp of the mean negative log-likelihood of each token after the first."""
    logits = run_in_chunks(runner, ids, chunk)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return math.exp(nll.item())


def test_quantized_perplexity_stays_within_five_percent(quantized_runner, runner, tokenizer):
    ids = tokenizer(PERPLEXITY_TEXT.read_text())["input_ids"][:2048]
    reference = perplexity(runner, ids, chunk=256)
    # Row by row (16-token steps), and as the integer GEMM of 256-row steps (prefill chunks).
    for chunk in (KERNEL_ROWS, 256):
        quantized = perplexity(quantized_runner, ids, chunk=chunk)
        print(f"perplexity over {len(ids)} tokens: float {reference:.3f}, quantized in "
              f"{chunk}-token steps {quantized:.3f} ({100 * (quantized / reference - 1):+.2f}%)")
        assert abs(quantized / reference - 1) < 0.05

