"""The int8 KV cache (`--kv-cache-dtype int8`): quantization against numpy, decode attention over
int8 blocks (native kernel, on this CPU's variant and the AVX2 one, and the torch path) against
attention computed naively over the dequantized cache, a model's logits against its float cache,
the blocks a memory budget holds, the default model's perplexity, and the flag's refusals."""

from __future__ import annotations

import contextlib
import io
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import AVX2_ENV, ROOT, run_forced
from model_utils import build_tiny_model, greedy_decode, make_runner

from treadle.cli import main
from treadle.config import CacheConfig, SchedulerConfig
from treadle.errors import UnsupportedSetting
from treadle.model import attention, kernels
from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.capabilities import resolve_kv_cache_dtype
from treadle.model.memory import kv_bytes_per_token, size_kv_cache


def test_quantize_round_trip_is_within_half_a_step_of_numpy_scales():
    gen = torch.Generator().manual_seed(0)
    # Vectors of very different magnitudes, one all zeros, one with a single large outlier.
    x = torch.randn(37, 3, 64, generator=gen) * torch.logspace(-3, 2, 37)[:, None, None]
    x[5, 1] = 0
    x[9, 2, 7] = 500.0
    quantized, scales = attention.quantize_kv(x)
    assert quantized.dtype == torch.int8 and scales.dtype == torch.float32
    assert quantized.shape == x.shape and scales.shape == x.shape[:2]

    ref = x.numpy().astype(np.float64)
    ref_scales = np.abs(ref).max(-1) / 127
    np.testing.assert_allclose(scales.numpy(), ref_scales, rtol=1e-6)
    assert np.abs(quantized.numpy()).max() <= 127
    restored = attention.dequantize_kv(quantized, scales, torch.float32).numpy()
    error = np.abs(restored - ref).max(-1)  # per (slot, head)
    assert np.all(error <= ref_scales / 2 * (1 + 1e-5) + 1e-30)
    assert not restored[5, 1].any() and scales[5, 1] == 0
    # The vector's absmax survives exactly as 127 steps.
    assert np.all(np.abs(quantized.numpy()).max(-1)[ref_scales > 0] == 127)


def test_paged_attention_writes_quantized_slots_and_their_scales():
    block_size, num_blocks, kv_heads, dim = 4, 6, 2, 8
    cache = attention.KVCache(2, num_blocks, block_size, kv_heads, dim, torch.int8)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(3, kv_heads, dim, generator=gen)
    v = torch.randn(3, kv_heads, dim, generator=gen)
    slots = torch.tensor([5, 13, 22])
    meta = attention.AttentionMetadata(
        slot_mapping=slots, decode_indices=None, decode_block_tables=torch.tensor(
            [[1, 0], [3, 0], [5, 0]]), decode_context_lens=torch.tensor([2, 2, 3]), prefills=[])
    q = torch.randn(3, 4, dim, generator=gen)
    attention.paged_attention(q, k, v, cache.keys[1], cache.values[1], meta, 0.3,
                              cache.key_scales[1], cache.value_scales[1])
    for new, stored, scales in ((k, cache.keys[1], cache.key_scales[1]),
                                (v, cache.values[1], cache.value_scales[1])):
        expected_q, expected_scales = attention.quantize_kv(new)
        stored, scales = stored.flatten(0, 1), scales.flatten(0, 1)  # [slots, ...]
        assert torch.equal(stored[slots], expected_q)
        assert torch.equal(scales[slots], expected_scales)
        untouched = torch.ones(stored.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert not stored[untouched].any() and not scales[untouched].any()
    # The other layer's blocks, which lie beside these, are untouched.
    for other in (cache.keys[0], cache.values[0], cache.key_scales[0], cache.value_scales[0]):
        assert not other.any()


def random_int8_cache(gen: torch.Generator, num_blocks: int, block_size: int, kv_heads: int,
                      dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.randint(-127, 128, (num_blocks, block_size, kv_heads, dim), generator=gen,
                           dtype=torch.int8)
    scales = torch.rand(num_blocks, block_size, kv_heads, generator=gen) * 0.05 + 0.001
    return values, scales


def naive_attention(q, k_cache, k_scales, v_cache, v_scales, tables, lens, scale, window=None):
    """Per sequence in float64 over its own positions, the cache dequantized here."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for s, (table, n) in enumerate(zip(tables.tolist(), lens.tolist(), strict=True)):
        first = 0 if window is None else max(0, n - window)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(first, n)]
        keys = (k_cache.flatten(0, 1)[slots].double()
                * k_scales.flatten(0, 1)[slots].double()[..., None])  # [n, Hkv, D]
        values = (v_cache.flatten(0, 1)[slots].double()
                  * v_scales.flatten(0, 1)[slots].double()[..., None])
        for h in range(q.shape[1]):
            scores = keys[:, h // group] @ q[s, h].double() * scale
            out[s, h] = scores.softmax(0) @ values[:, h // group]
    return out


def check_decode_over_int8(dtype: torch.dtype, kv_heads: int, heads: int,
                           window: int | None) -> None:
    """decode_attention over a random int8 cache (block tables shuffled, contexts from one slot
    to past the native kernel's 128-position tasks) against `naive_attention`."""
    gen = torch.Generator().manual_seed(2)
    block_size, num_blocks, dim = 16, 128, 64
    k_cache, k_scales = random_int8_cache(gen, num_blocks, block_size, kv_heads, dim)
    v_cache, v_scales = random_int8_cache(gen, num_blocks, block_size, kv_heads, dim)
    lens = torch.tensor([1, 15, 16, 17, 129, 300])
    max_blocks = 19
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * max_blocks].view(-1,
                                                                                     max_blocks)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    expected = naive_attention(q, k_cache, k_scales, v_cache, v_scales, tables, lens, 0.125,
                               window)
    meta = attention.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), decode_indices=None,
        decode_block_tables=tables, decode_context_lens=lens, prefills=[], window=window)
    out = attention.decode_attention(q, k_cache, v_cache, meta, 0.125, k_scales, v_scales)
    assert out.dtype == dtype
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("kv_heads,heads", [(1, 1), (3, 9), (2, 8)])  # MHA and GQA groups
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["native", "torch"])
def test_decode_attention_over_int8_matches_naive(path, dtype, kv_heads, heads, window,
                                                  monkeypatch):
    if path == "native" and kernels.paged_decode_attention() is None:
        pytest.skip("native kernel unavailable")
    if path == "torch":
        monkeypatch.setattr(attention, "paged_decode_attention", lambda device: None)
    check_decode_over_int8(dtype, kv_heads, heads, window)


AVX2_CHECK = ("import sys, torch\n"
              "sys.path.insert(0, 'tests')\n"
              "from treadle.model import kernels\n"
              "assert kernels.this_build().variant == 'avx2', kernels.this_build()\n"
              "assert kernels.paged_decode_attention() is not None\n"
              "from test_kv_int8 import check_decode_over_int8\n"
              "for dtype in (torch.float32, torch.bfloat16):\n"
              "    check_decode_over_int8(dtype, 3, 9, None)\n"
              "print('ok')\n")


def test_the_avx2_variant_reads_int8_alike():
    """The AVX2 build's own int8 conversion (its first use builds it where not prebuilt)."""
    if kernels.paged_decode_attention() is None:
        pytest.skip("native kernel unavailable")
    done = run_forced(["-c", AVX2_CHECK], AVX2_ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model("llama", folder)
    return folder


def logits_of(runner, prompts: list[list[int]], chunk: int, decode_tokens: list[list[int]],
              blocks_per_prompt: int = 8) -> list[torch.Tensor]:
    """Each prompt prefilled `chunk` tokens a step (every position's logits), then its
    `decode_tokens` (as many for each) fed one a step, all prompts in the same steps: logits
    [positions, vocab] per prompt."""
    bs, n = runner.block_size, blocks_per_prompt
    tables = [list(range(i * n, i * n + n)) for i in range(len(prompts))]
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    longest = max(len(p) for p in prompts)
    for start in range(0, longest, chunk):
        seqs, owners = [], []
        for i, p in enumerate(prompts):
            if start < len(p):
                seqs.append(ScheduledSequence(p[start:start + chunk], start, tables[i],
                                              all_logits=True))
                owners.append(i)
        logits = runner.execute(ModelInput(seqs))
        row = 0
        for i, seq in zip(owners, seqs, strict=True):
            out[i].append(logits[row:row + len(seq.token_ids)])
            row += len(seq.token_ids)
    lengths = [len(p) for p in prompts]
    for step in range(len(decode_tokens[0])):
        seqs = [ScheduledSequence([decode_tokens[i][step]], lengths[i], tables[i])
                for i in range(len(prompts))]
        logits = runner.execute(ModelInput(seqs))
        for i in range(len(prompts)):
            out[i].append(logits[i:i + 1])
            lengths[i] += 1
    assert all(length <= n * bs for length in lengths)
    return [torch.cat(o) for o in out]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_with_int8_kv_stays_close_to_the_float_cache(tiny_llama, dtype):
    """A tiny random Llama: every prefill position (whole and in chunks of 5) and 12 decode
    steps, int8 KV against the model's dtype; and the int8 cache reads the same values
    whatever the chunking (its prefill attends over the cache as stored)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (23, 40, 7)]
    decode = [torch.randint(3, 256, (12,), generator=gen).tolist()] * len(prompts)
    float_runner = make_runner(tiny_llama, dtype=dtype, num_blocks=32)
    int8_runner = make_runner(tiny_llama, dtype=dtype, num_blocks=32, kv_cache_dtype="int8")
    assert int8_runner.kv_cache.keys[0].dtype == torch.int8
    assert int8_runner.platform_info()["kv_cache_dtype"] == "int8"
    reference = logits_of(float_runner, prompts, 64, decode)
    whole = logits_of(int8_runner, prompts, 64, decode)
    chunked = logits_of(int8_runner, prompts, 5, decode)
    # Measured: mean |diff| ~1.4% of the logits' spread, the largest 11% (bfloat16 against
    # float32 weights differ as much); a random model with 16-wide heads amplifies KV noise.
    spread = torch.cat(reference).std().item()
    for ref, a, b in zip(reference, whole, chunked, strict=True):
        for quantized in (a, b):
            assert (quantized - ref).abs().mean().item() < 0.025 * spread
            assert (quantized - ref).abs().max().item() < 0.2 * spread
        assert (a - b).abs().max().item() < 1e-3 * spread
    # Not vacuous: the int8 cache does change the logits a little.
    assert any((a - ref).abs().max().item() > 0 for ref, a in zip(reference, whole, strict=True))


def test_a_float32_models_bfloat16_cache_stays_close_to_a_float32_one(tiny_llama):
    """The CPU's default cache under a float32 model is bfloat16: half the bytes of a float32
    cache, so a memory budget holds twice the blocks; its logits stay close to a float32
    cache's, and every read sees the stored rounding, so chunked and whole prefills agree."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (23, 40, 7)]
    decode = [torch.randint(3, 256, (12,), generator=gen).tolist()] * len(prompts)
    float_runner = make_runner(tiny_llama, num_blocks=32, kv_cache_dtype="float32")
    bf16_runner = make_runner(tiny_llama, num_blocks=32, kv_cache_dtype="auto")
    assert bf16_runner.kv_cache.keys[0].dtype == torch.bfloat16
    assert bf16_runner.platform_info()["kv_cache_dtype"] == "bfloat16"
    assert float_runner.kv_cache.keys[0].dtype == torch.float32
    reference = logits_of(float_runner, prompts, 64, decode)
    whole = logits_of(bf16_runner, prompts, 64, decode)
    chunked = logits_of(bf16_runner, prompts, 5, decode)
    spread = torch.cat(reference).std().item()
    for ref, a, b in zip(reference, whole, chunked, strict=True):
        assert (a - ref).abs().mean().item() < 0.01 * spread
        assert (a - ref).abs().max().item() < 0.1 * spread
        assert (a - b).abs().max().item() < 1e-4 * spread
    assert any((a - ref).abs().max().item() > 0 for ref, a in zip(reference, whole, strict=True))
    assert kv_bytes_per_token(DefaultModelShape(), "float32") == 2 * kv_bytes_per_token(
        DefaultModelShape(), "bfloat16")


def test_gemma3_windows_over_an_int8_cache(tmp_path):
    """Sliding-window layers read only their window's int8 blocks, in prefill and decode."""
    build_tiny_model("gemma3", tmp_path)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (30, 11)]
    decode = [torch.randint(3, 256, (10,), generator=gen).tolist()] * len(prompts)
    reference = logits_of(make_runner(tmp_path, num_blocks=32), prompts, 64, decode)
    quantized = logits_of(make_runner(tmp_path, num_blocks=32, kv_cache_dtype="int8"), prompts,
                          6, decode)
    spread = torch.cat(reference).std().item()
    for ref, q in zip(reference, quantized, strict=True):
        assert (q - ref).abs().mean().item() < 0.025 * spread
        assert (q - ref).abs().max().item() < 0.2 * spread


class DefaultModelShape:
    """SmolLM2-135M's attention: 30 layers, 3 KV heads of 64 (no model files read)."""

    num_layers, num_kv_heads, head_dim = 30, 3, 64


def test_a_memory_budget_holds_about_twice_the_blocks_in_int8():
    spec = DefaultModelShape()
    bf16 = kv_bytes_per_token(spec, "bfloat16")
    int8 = kv_bytes_per_token(spec, "int8")
    assert bf16 == 2 * 30 * 3 * 64 * 2
    assert int8 == 2 * 30 * 3 * (64 + 4)  # a byte an element, a float32 scale a vector
    assert kv_bytes_per_token(spec, "float32") == 2 * bf16
    cache = CacheConfig(block_size=16, kv_cache_memory_bytes=1 << 30)
    blocks = {dtype: size_kv_cache(cache, SchedulerConfig(), per_token, 2048, 0, 8 << 30, dtype)
              for dtype, per_token in (("bfloat16", bf16), ("int8", int8))}
    ratio = blocks["int8"].num_blocks / blocks["bfloat16"].num_blocks
    assert 1.85 < ratio < 1.9  # 128 / 68 bytes per vector
    assert blocks["int8"].dtype == "int8" and "int8" in blocks["int8"].describe()
    assert blocks["int8"].bytes <= 1 << 30


def test_plan_shows_the_kv_dtype_and_twice_the_concurrency(tiny_folder):
    reports = {}
    for kv in ("auto", "int8"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["plan", "--model", str(tiny_folder), "--dtype", "bfloat16",
                         "--kv-cache-dtype", kv, "--concurrency", "4"]) == 0
        reports[kv] = out.getvalue()
    assert "bfloat16, 256 bytes/token" in reports["auto"]  # 2 x 2 layers x 2 heads x 16 x 2
    assert "int8, 160 bytes/token" in reports["int8"]  # 2 x 2 x 2 x (16 + 4)


def test_bad_kv_cache_dtypes_are_refused_clearly():
    for command in (["plan"], ["serve"]):
        done = subprocess.run([sys.executable, "-m", "treadle.cli", *command,
                               "--kv-cache-dtype", "int4"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2
        assert "--kv-cache-dtype" in done.stderr and "invalid choice: 'int4'" in done.stderr
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp16")
    with pytest.raises(UnsupportedSetting, match="CPU only") as refused:
        resolve_kv_cache_dtype("int8", "bfloat16", "cuda")
    assert refused.value.setting == "kv_cache_dtype"
    assert resolve_kv_cache_dtype("auto", "bfloat16", "cuda") == "bfloat16"
    assert resolve_kv_cache_dtype("int8", "float32", "cpu") == "int8"
    # A float32 model's cache: bfloat16 on the CPU unless asked, the model's own on CUDA.
    assert resolve_kv_cache_dtype("auto", "float32", "cpu") == "bfloat16"
    assert resolve_kv_cache_dtype("float32", "float32", "cpu") == "float32"
    assert resolve_kv_cache_dtype("auto", "float32", "cuda") == "float32"
    with pytest.raises(UnsupportedSetting, match="CPU only"):
        resolve_kv_cache_dtype("bfloat16", "float32", "cuda")
    with pytest.raises(UnsupportedSetting, match="served in bfloat16"):
        resolve_kv_cache_dtype("float32", "bfloat16", "cpu")


def test_the_triton_kernel_refuses_an_int8_cache(triton_attention):
    k_cache = torch.zeros(2, 4, 1, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8 KV cache is CPU-only"):
        triton_attention.paged_decode_attention(
            torch.zeros(1, 2, 16), k_cache, k_cache, torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, dtype=torch.long), 0.25, k_scales=torch.zeros(2, 4, 1),
            v_scales=torch.zeros(2, 4, 1))


PERPLEXITY_TOKENS, DECODED = 1024, 64
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain what a hash map is in two sentences.", "Why is the sky blue?"]
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def default_tokenizer():
    from transformers import AutoTokenizer

    from treadle.model.source import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.default_model
@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", "int8"), ("bfloat16", "int8"),
                                                   ("float32", "bfloat16")])
def test_default_model_perplexity_over_a_narrower_cache_within_one_percent(default_tokenizer,
                                                                            dtype,
                                                                            kv_cache_dtype):
    """SmolLM2-135M over CPython's licence, against the same model over a cache in its own
    dtype: every token read from the cache as stored (prefill chunks of 128 over the blocks,
    the last 64 tokens in decode steps through the decode kernel)."""
    text = (ROOT / "tests" / "data" / "python_license.txt").read_text()
    ids = default_tokenizer(text)["input_ids"][:PERPLEXITY_TOKENS]
    results = {kv: perplexity(make_runner(None, dtype=dtype, num_blocks=80, kv_cache_dtype=kv),
                              ids) for kv in (dtype, kv_cache_dtype)}
    change = results[kv_cache_dtype] / results[dtype] - 1
    print(f"{dtype}: perplexity over {len(ids)} tokens, KV {dtype} {results[dtype]:.4f}, "
          f"{kv_cache_dtype} {results[kv_cache_dtype]:.4f} ({100 * change:+.2f}%)")
    assert abs(change) < 0.01


def perplexity(runner, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of tokens 1..: prefill chunks of 128, then the
    last DECODED tokens' predictions from decode steps."""
    prefilled = len(ids) - DECODED
    logits = logits_of(runner, [ids[:prefilled]], 128, [ids[prefilled:-1]],
                       blocks_per_prompt=math.ceil(len(ids) / runner.block_size))[0]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(nll.item())


@pytest.mark.default_model
def test_default_model_greedy_picks_with_int8_kv(default_tokenizer):
    """Teacher-forced over the bfloat16 cache's greedy continuations of chat prompts, in decode
    steps: how often int8 KV picks the same next token."""
    prompts = [default_tokenizer(default_tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    reference = greedy_decode(make_runner(None, dtype="bfloat16", num_blocks=64), prompts,
                              GREEDY_TOKENS)
    logits = logits_of(make_runner(None, dtype="bfloat16", num_blocks=64, kv_cache_dtype="int8"),
                       prompts, 256, reference)
    agree = sum(int((rows[len(p) - 1:len(p) - 1 + GREEDY_TOKENS].argmax(-1)
                     == torch.tensor(ref)).sum()) for rows, p, ref in zip(
                         logits, prompts, reference, strict=True))
    rate = agree / (len(prompts) * GREEDY_TOKENS)
    print(f"int8 KV greedy picks equal to the bfloat16 cache's: {100 * rate:.1f}% of "
          f"{len(prompts) * GREEDY_TOKENS}")
    assert rate >= 0.9


def test_bench_forward_measures_each_kv_cache_dtype(tiny_llama):
    from treadle.bench.forward import bench_forward, format_forward

    report = bench_forward(str(tiny_llama), "float32", [2], [1], context_len=32, steps=1,
                           quantizations=("none",), kv_cache_dtypes=("auto", "float32", "int8"))
    assert [r["kv_cache_dtype"] for r in report["rows"]] == ["bfloat16", "float32", "int8"]
    assert [r["kv_cache_dtype"] for r in report["runs"]] == ["bfloat16", "float32", "int8"]
    assert "KV cache int8" in format_forward(report)


def test_quantized_decode_steps_over_int8_kv_stay_close_to_a_float_cache(tiny_llama):
    """Q4_1 weights whose decode steps of up to 4 rows run in the native decoder, over an int8
    cache (which it quantizes as the layers' path does: tests/test_quantized.py) and over a
    float one: the two stay close."""
    if kernels.llama_decoder_class() is None:
        pytest.skip("native kernels unavailable")
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (9, 20, 4)]
    decode = [torch.randint(3, 256, (8,), generator=gen).tolist()] * len(prompts)
    fused, quantized = (make_runner(tiny_llama, num_blocks=32, quantization="int4",
                                    quant_gemv_max_rows=4, kv_cache_dtype=kv)
                        for kv in ("auto", "int8"))
    reference = logits_of(fused, prompts, 64, decode)
    got = logits_of(quantized, prompts, 64, decode)
    assert fused.model.native_decoder is not None
    # Measured: mean |diff| 4.9-5.6% of the spread, the largest 27-33% (~2.2% and 22-47% while
    # prefill rows took a float GEMM, not the integer GEMM): int8 activations amplify the
    # cache's noise (the fused and layers' paths give the same bits over one cache).
    spread = torch.cat(reference).std().item()
    for ref, q in zip(reference, got, strict=True):
        assert (q - ref).abs().mean().item() < 0.08 * spread
        assert (q - ref).abs().max().item() < 0.6 * spread
