"""Tensor parallelism (--tensor-parallel-size): logits of TP=2 against transformers on tiny random
models (even, uneven and replicated KV-head splits, a padded vocabulary split), greedy outputs of
TP=2 equal TP=1 through `LLM`, no process left behind, and bad sizes refused before any worker
starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
import torch
import transformers
from model_utils import TINY, build_tiny_model

from treadle.config import EngineConfig, build_config
from treadle.core.executor import build_executor
from treadle.core.sampling_params import SamplingParams
from treadle.llm import LLM
from treadle.model.batch import ModelInput, ScheduledSequence


def save_tiny_llama(folder, **overrides) -> torch.nn.Module:
    """A random Llama of TINY's sizes but `overrides`, every tensor random (as model_utils')."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{**TINY, **overrides})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name
                    else 0.15 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


# Each case: how to build the model, and what its split exercises.
CASES = {
    # 2 KV heads over 2 ranks: one KV group each.
    "llama": lambda folder: build_tiny_model("llama", folder),
    # 3 KV groups of 2 query heads: 2 groups on rank 0, 1 on rank 1 (SmolLM2's case); 5 MLP
    # blocks of 32 split 3 / 2; 255 vocabulary ids split 128 / 127 (the gather pads).
    "llama-uneven": lambda folder: save_tiny_llama(
        folder, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=160,
        vocab_size=255),
    # 1 KV head replicated on both ranks, which split its 4 query heads.
    "llama-replicated-kv": lambda folder: save_tiny_llama(folder, num_key_value_heads=1),
    # Gemma 3: sliding-window layers, (1 + w) norms after attention and the MLP, q/k norms.
    "gemma3": lambda folder: build_tiny_model("gemma3", folder),
    # Qwen2: q/k/v biases, sliced with their rows.
    "qwen2": lambda folder: build_tiny_model("qwen2", folder),
}


def live_workers() -> list[psutil.Process]:
    """This process's tensor-parallel workers still running (not other children, such as a
    kernel build's compiler)."""
    workers = []
    for p in psutil.Process().children(recursive=True):
        try:
            command = " ".join(p.cmdline())
            if "executor.tensor_parallel" in command and p.status() != psutil.STATUS_ZOMBIE:
                workers.append(p)
        except psutil.NoSuchProcess:
            pass
    return workers


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_logits_match_transformers(case, tmp_path):
    model = CASES[case](tmp_path)
    vocab = model.config.vocab_size
    config = build_config(EngineConfig, {"model": str(tmp_path), "dtype": "float32",
                                         "kv_cache_dtype": "float32",
                                         "block_size": 4, "num_blocks": 64,
                                         "tensor_parallel_size": 2, "engine_threads": 2})
    executor = build_executor(config)
    try:
        workers = live_workers()
        assert len(workers) == 1
        ids = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(1)).tolist()
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].float()
        table = list(range(20, 30))
        # The prompt in chunks (later ones read the sharded cache), then decode-shaped steps.
        rows = [executor.execute_model(ModelInput([ScheduledSequence(
            ids[s:s + 13], s, table, all_logits=True)])).logits for s in range(0, 34, 13)]
        rows += [executor.execute_model(ModelInput([ScheduledSequence([ids[s]], s, table)]))
                 .logits for s in range(39, 40)]
        logits = torch.cat(rows)
        assert logits.shape == (len(ids), vocab)
        assert (logits - ref).abs().max().item() < 1e-4
    finally:
        executor.close()
    assert not live_workers()


def test_tp2_greedy_equals_tp1_through_llm_and_leaves_no_process(tiny_folder):
    prompts = [[1, 450, 4996, 17354], list(range(100, 137)), [1, 22]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    settings = {"dtype": "float32", "kv_cache_dtype": "float32", "engine_threads": 2,
                "block_size": 4, "num_blocks": 128}
    single = [o.outputs[0].token_ids for o in
              LLM(str(tiny_folder), **settings).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_folder), tensor_parallel_size=2, **settings)
    workers = live_workers()
    assert len(workers) == 1
    split = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert split == single
    llm.engine.executor.close()
    psutil.wait_procs(workers, timeout=10)
    assert not live_workers()


def test_workers_exit_when_the_engine_process_is_killed(tiny_folder):
    script = (f"from treadle.llm import LLM; llm = LLM({str(tiny_folder)!r}, dtype='float32', "
              f"tensor_parallel_size=2, num_blocks=16); print('ready', flush=True); "
              f"import time; time.sleep(600)")
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "ready"
        workers = live_workers()
        assert len(workers) == 1 and workers[0].ppid() == engine.pid
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait()
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, "a worker outlived its engine"
    finally:
        engine.kill()


def test_bad_sizes_are_refused_before_any_worker_starts(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        build_config(EngineConfig, {"tensor_parallel_size": 0})
    save_tiny_llama(tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    for size, message in ((8, "exceeds the model's 6 attention heads"),
                          (4, "cannot split the model's 3 KV heads")):
        config = build_config(EngineConfig, {"model": str(tmp_path), "dtype": "float32",
                                             "tensor_parallel_size": size})
        with pytest.raises(ValueError, match=message):
            build_executor(config)
        assert not live_workers()


@pytest.mark.default_model
@pytest.mark.slow  # 27 s alone on 2 cores: two loads of the model, one with a worker
def test_default_model_tp2_greedy_equals_tp1():
    """SmolLM2-135M (its Q4_1 blocks sliced as blocks: o_proj and down_proj on block
    boundaries): 3 KV heads split 2 / 1. The float path over the blocks' dense copies: the
    integer kernel quantizes each activation block to int8, and an ulp of difference from the
    all-reduce's order flips some roundings (measured: logits apart by ~1 after 4 decode steps,
    as far as either is from the float path), so TP=1 and TP=2 agree only in distribution."""
    prompts = ["What is the capital of France?", "def fibonacci(n):",
               "Once upon a time, in a village at the edge of a forest,"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    settings = {"dtype": "float32", "kv_cache_dtype": "float32", "engine_threads": 2,
                "num_blocks": 64, "quant_gemv_max_rows": 0}
    single = [o.outputs[0].token_ids for o in
              LLM(None, **settings).generate(prompts, params, use_tqdm=False)]
    llm = LLM(None, tensor_parallel_size=2, **settings)
    try:
        split = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.executor.close()
    assert split == single
