"""The CUDA path: choosing the device, sizing the KV cache from GPU memory, padded decode steps
(what a captured CUDA graph replays), and, where a GPU is (bench/device_check.sh), the runner on
it against transformers and across batch sizes.

Without a GPU the padded step runs eagerly over the same static buffers, so its padding, its
scratch block and its row order are tested on every CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import run_forced
from model_utils import build_tiny_model, greedy_decode, make_runner

from treadle.config import CacheConfig, ModelConfig
from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.capabilities import resolve_device, resolve_dtype
from treadle.model.cuda_graphs import DecodeGraphs
from treadle.model.memory import InsufficientMemoryError, size_kv_cache_on_gpu
from treadle.model.quantization import resolve_quantization
from treadle.model.runner import ModelRunner

GIB = 1 << 30
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@no_cuda
def test_auto_is_the_cpu_and_cuda_is_a_clear_error_without_a_gpu(tiny_folder):
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        ModelRunner.from_config(ModelConfig(model=str(tiny_folder), device="cuda"),
                                CacheConfig(num_blocks=8))
    with pytest.raises(ValueError, match="device must be one of"):
        ModelConfig(device="tpu")
    done = run_forced(["-m", "treadle.cli", "generate", "--model", str(tiny_folder),
                       "--device", "cuda", "hi"], {}, timeout=120)
    assert done.returncode != 0 and "torch sees no CUDA GPU" in done.stderr


def test_cuda_serves_bfloat16_weights_dequantized():
    assert resolve_dtype("auto", "cuda")[0] == "bfloat16"
    assert resolve_dtype("float32", "cuda")[0] == "float32"
    assert resolve_quantization("auto", is_gguf=True, device="cuda") == "none"
    assert resolve_quantization("auto", is_gguf=True, device="cpu") == "gguf"
    with pytest.raises(ValueError, match="CPU kernels only"):
        resolve_quantization("gguf", is_gguf=True, device="cuda")


def test_gpu_kv_cache_takes_what_the_utilization_leaves():
    per_token, block = 1024, 16
    cache = CacheConfig(block_size=block, gpu_memory_utilization=0.9)
    # 80 GiB card, 10 GiB in use (weights, context, others), 1 GiB of activations:
    # 72 - 10 - 1 = 61 GiB of blocks.
    size = size_kv_cache_on_gpu(cache, per_token, 2048, GIB, free=70 * GIB, total=80 * GIB,
                                dtype="bfloat16")
    assert size.num_blocks == 61 * GIB // (per_token * block)
    with pytest.raises(InsufficientMemoryError, match="no GPU memory left"):
        size_kv_cache_on_gpu(cache, per_token, 2048, GIB, free=8 * GIB, total=80 * GIB,
                             dtype="bfloat16")
    fixed = CacheConfig(block_size=block, num_blocks=4 * GIB // (per_token * block))
    with pytest.raises(InsufficientMemoryError, match="do not fit"):
        size_kv_cache_on_gpu(fixed, per_token, 2048, GIB, free=4 * GIB, total=80 * GIB,
                             dtype="bfloat16")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)


def decode_step(prompts: list[list[int]], tables: list[list[int]]) -> ModelInput:
    """Each prompt's last token, its earlier ones cached."""
    return ModelInput([ScheduledSequence(p[-1:], len(p) - 1, t)
                       for p, t in zip(prompts, tables, strict=True)])


@pytest.mark.parametrize("num_seqs", [1, 3, 5])
def test_a_padded_decode_step_gives_each_row_its_own_logits(tmp_path, num_seqs):
    """Steps padded to the graph sizes (1, 2, 4, 8 here) give the unpadded step's logits, and
    their padding rows write only the scratch block."""
    build_tiny_model("llama", tmp_path)
    plain = make_runner(tmp_path, block_size=4, num_blocks=64, enforce_eager=True)
    padded = make_runner(tmp_path, block_size=4, num_blocks=64, enforce_eager=True)
    padded.decode_graphs = DecodeGraphs(padded, max_num_seqs=8,
                                        capture=torch.cuda.is_available())
    assert padded.decode_graphs.sizes == [1, 2, 4, 8]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (9, 14, 4, 21, 6)]
    tables = [list(range(i, 60, 5))[:6] for i in range(5)]  # interleaved block ids
    prompts, tables = prompts[:num_seqs], tables[:num_seqs]
    prefill = ModelInput([ScheduledSequence(p[:-1], 0, t)
                          for p, t in zip(prompts, tables, strict=True)])
    for runner in (plain, padded):
        runner.execute(prefill)
    step = decode_step(prompts, tables)
    assert padded.decode_graphs.serves(step)
    expected = plain.execute(step)
    logits = padded.execute(step)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    pad = padded.kv_cache.pad_block
    for layer in range(len(plain.kv_cache.keys)):
        torch.testing.assert_close(padded.kv_cache.keys[layer][:pad],
                                   plain.kv_cache.keys[layer][:pad])
        torch.testing.assert_close(padded.kv_cache.values[layer][:pad],
                                   plain.kv_cache.values[layer][:pad])
    if num_seqs not in padded.decode_graphs.sizes:  # padding rows wrote the scratch block
        assert padded.kv_cache.keys[0][pad].abs().sum() > 0


def test_steps_a_graph_cannot_replay_run_eagerly(tmp_path):
    build_tiny_model("llama", tmp_path)
    runner = make_runner(tmp_path, block_size=4, num_blocks=64, enforce_eager=True)
    graphs = DecodeGraphs(runner, max_num_seqs=2, capture=False)
    prefill = ModelInput([ScheduledSequence([5, 6, 7], 0, [0])])
    assert not graphs.serves(prefill)
    assert not graphs.serves(ModelInput([ScheduledSequence([5], 3, [0], all_logits=True)]))
    assert not graphs.serves(decode_step([[1, 2]] * 3, [[0], [1], [2]]))  # more than fit
    assert graphs.serves(decode_step([[1, 2]] * 2, [[0], [1]]))


def test_greedy_with_padded_decode_steps_equals_eager(tmp_path):
    """Whole generations: prefill chunks mixed with decodes run eagerly, decode-only steps
    padded; every sequence's tokens are those of the eager runner."""
    build_tiny_model("qwen3", tmp_path)
    eager = make_runner(tmp_path, block_size=4, num_blocks=256, enforce_eager=True)
    padded = make_runner(tmp_path, block_size=4, num_blocks=256, enforce_eager=True)
    padded.decode_graphs = DecodeGraphs(padded, max_num_seqs=8,
                                        capture=torch.cuda.is_available())
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 30)]
    assert greedy_decode(padded, prompts, 20, chunk_size=7) == \
        greedy_decode(eager, prompts, 20, chunk_size=7)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_the_triton_kernels_in_a_model_match_transformers(arch, tmp_path, monkeypatch):
    """The CUDA path's kernels (decode attention, RMS norm, rope, SiLU-and-multiply) inside
    whole models, interpreted on the CPU (compiled on a GPU): greedy tokens as transformers
    generates them, over q/k views, Qwen3's and Gemma's q/k norms and Gemma's windows."""
    pytest.importorskip("triton")
    import treadle.model.triton_attention
    import treadle.model.triton_layers
    from treadle.model import attention, layers

    monkeypatch.setattr(layers, "elementwise_kernels",
                        lambda device: treadle.model.triton_layers)
    monkeypatch.setattr(attention, "paged_decode_attention",
                        lambda device: treadle.model.triton_attention.paged_decode_attention)
    model = build_tiny_model(arch, tmp_path)
    runner = make_runner(tmp_path, block_size=4, num_blocks=128)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 14)]
    ours = greedy_decode(runner, prompts, max_tokens=8, chunk_size=6)
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()


# On a GPU only (bench/device_check.sh runs these).

@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_bfloat16_on_cuda_matches_transformers(arch, tmp_path):
    """The runner in bfloat16 on the GPU against transformers in float32 on the CPU: the
    logits of a prompt at every position, whole and in chunks over the cache, within
    bfloat16's rounding."""
    model = build_tiny_model(arch, tmp_path)
    runner = make_runner(tmp_path, dtype="bfloat16", block_size=4, num_blocks=64,
                         device="cuda")
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    table = list(range(20, 35))
    whole = runner.execute(ModelInput([ScheduledSequence(ids, 0, table, all_logits=True)]))
    scale = ref.abs().max().item()
    assert (whole.cpu() - ref).abs().max().item() < 0.05 * scale
    chunks = [runner.execute(ModelInput([ScheduledSequence(ids[s:s + 7], s, table,
                                                           all_logits=True)]))
              for s in range(0, len(ids), 7)]
    assert (torch.cat(chunks).cpu() - ref).abs().max().item() < 0.05 * scale


@cuda
@pytest.mark.default_model
def test_default_model_on_cuda_matches_transformers_on_cuda():
    """SmolLM2 in bfloat16 on the GPU, ours (decode steps replayed as CUDA graphs) against
    transformers loading the same GGUF in bfloat16 on the same GPU: logits at every position
    within bfloat16's rounding, the same greedy token at nearly all of them."""
    from transformers import AutoModelForCausalLM

    from treadle.model.source import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.bfloat16).cuda().eval()
    runner = make_runner(None, dtype="bfloat16", num_blocks=256, device="cuda")
    assert runner.decode_graphs is not None
    ids = torch.randint(100, 40000, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
    ours = runner.execute(ModelInput([ScheduledSequence(ids, 0, list(range(13)),
                                                        all_logits=True)]))
    assert (ours - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9


GREEDY_LENGTHS = (12, 40, 7, 90, 33, 18, 64, 25)


@cuda
@pytest.mark.default_model
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_model_greedy_is_the_same_with_and_without_graphs(dtype):
    """Greedy tokens of 8 prompts, decode steps replayed as graphs or run eagerly: the same
    shapes reach the same kernels, so the same tokens."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in GREEDY_LENGTHS]
    graphs = make_runner(None, dtype=dtype, num_blocks=512, device="cuda")
    eager = make_runner(None, dtype=dtype, num_blocks=512, device="cuda", enforce_eager=True)
    assert greedy_decode(graphs, prompts, 32) == greedy_decode(eager, prompts, 32)


@cuda
@pytest.mark.default_model
def test_default_model_greedy_is_the_same_at_every_batch_size_on_cuda():
    """Greedy tokens of 8 prompts decoded together (graph of 8), one at a time (graph of 1)
    and with chunked prefill: equal, in float32 (in bfloat16 cuBLAS's kernels for 1 and for 8
    rows round differently, and a near tie can flip a token: no GPU engine promises that)."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in GREEDY_LENGTHS]
    runner = make_runner(None, dtype="float32", num_blocks=512, device="cuda")
    together = greedy_decode(runner, prompts, 32)
    assert greedy_decode(runner, prompts, 32, together=False) == together
    assert greedy_decode(runner, prompts, 32, chunk_size=16) == together
