"""`treadle bench offline`: output tokens/s of `LLM.generate` against Hugging Face `generate` with
static batches, on the same ShareGPT-like requests (`workloads.synthetic_chat`), model weights,
dtype, torch thread count and machine, in one run.

Both sides get the same prompt token ids and must produce exactly each request's output length,
greedily: Treadle with `ignore_eos`; Hugging Face with EOS unset, in static batches taken in
prompt (arrival) order, left-padded with an attention mask, each batch decoding until its longest
request is done. Arrival order, as in vLLM's own Hugging Face baseline (benchmark_throughput):
a static-batching server cannot know output lengths in advance, so sorting by them would be an
oracle. Like that baseline it counts only each request's requested tokens as output, not those a
batch computes past a request's end (reported as `computed_tokens`).

`hf_batch_size` 8 is Hugging Face's best of 1, 4, 8, 16, 32 on the 2-core development machine
(docs/decisions.md); pass another size where the machine differs.

Only generation is timed (not loading); each side first runs one small untimed request.
"""

from __future__ import annotations

import gc
import time

import torch

from treadle.bench.workloads import BenchRequest, summarize, synthetic_chat
from treadle.model.capabilities import resolve_device, torch_dtype
from treadle.model.loader import read_spec
from treadle.model.source import resolve_model

# The bar Treadle is held to against static batching: on a GPU, where Hugging Face's per-step
# Python is a larger share of a step, 5x (issue 20); on the CPU 3x.
TARGET_RATIO = {"cpu": 3.0, "cuda": 5.0}
WARMUP = BenchRequest(prompt_token_ids=[100 + i for i in range(16)], output_len=4)


def load_hf_model(model: str | None, dtype: str, device: str = "cpu", random: bool = False):
    """The same weights as Treadle loads, through transformers, as dense `dtype` tensors (a GGUF
    file is dequantized, as Treadle does, rather than kept in blocks for transformers' GGUF
    kernels), with EOS never ending generation (Treadle's `ignore_eos`). `random`: transformers'
    own random initialisation of the model's config (speed does not depend on the values)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GgufConfig

    source = resolve_model(model)
    folder, gguf = source.folder, source.gguf
    if random:
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)),
                                              dtype=torch_dtype(dtype, device))
    elif gguf is not None:
        hf = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch_dtype(dtype, device),
            quantization_config=GgufConfig(dequantize=True))
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(folder),
                                                  dtype=torch_dtype(dtype, device))
    # A GenerationConfig passed to generate() cannot unset EOS: the model's own default wins.
    hf.generation_config.eos_token_id = None
    return hf.to(device).eval()


def run_treadle(llm, requests: list[BenchRequest]) -> tuple[float, list[list[int]]]:
    from treadle.core.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
              for r in requests]
    prompts = [r.prompt_token_ids for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, [list(o.outputs[0].token_ids) for o in outputs]


def run_hf_static(hf_model, requests: list[BenchRequest], batch_size: int, pad_token_id: int
                  ) -> tuple[float, list[list[int]], int]:
    """Greedy `generate` over static batches in prompt order; (seconds, each request's first
    output_len tokens, tokens computed including those past each request's end)."""
    from transformers import GenerationConfig

    outputs: list[list[int]] = []
    computed = 0
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        width = max(r.prompt_len for r in batch)
        new = max(r.output_len for r in batch)
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding: every prompt ends at the same column
            input_ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            attention_mask[row, width - r.prompt_len:] = 1
        config = GenerationConfig(max_new_tokens=new, do_sample=False, num_beams=1,
                                  pad_token_id=pad_token_id)
        with torch.inference_mode():
            out = hf_model.generate(input_ids=input_ids.to(hf_model.device),
                                    attention_mask=attention_mask.to(hf_model.device),
                                    generation_config=config)
        if out.shape[1] != width + new:
            raise RuntimeError(f"Hugging Face generated {out.shape[1] - width} tokens, "
                               f"expected {new}")
        computed += len(batch) * new
        outputs.extend(out[row, width:width + r.output_len].tolist()
                       for row, r in enumerate(batch))
    return time.perf_counter() - start, outputs, computed


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def bench_offline(model: str | None = None, dtype: str = "auto", num_prompts: int = 200,
                  seed: int = 0, max_input_len: int | None = None,
                  max_output_len: int | None = None, hf_batch_size: int = 8,
                  threads: int | None = None, device: str = "auto",
                  load_format: str = "auto") -> dict:
    from treadle.llm import LLM
    from treadle.tokenizer import Tokenizer

    if hf_batch_size < 1:
        raise ValueError(f"hf_batch_size must be >= 1, got {hf_batch_size}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    folder = resolve_model(model).folder
    spec = read_spec(folder)
    tokenizer = Tokenizer.from_folder(folder)
    requests = synthetic_chat(tokenizer, num_prompts, seed=seed,
                              max_model_len=spec.max_position_embeddings,
                              max_input_len=max_input_len, max_output_len=max_output_len,
                              with_text=False)
    workload = summarize(requests)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = spec.eos_token_ids[0] if spec.eos_token_ids else 0

    saved_threads = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        n_threads = torch.get_num_threads()

        device = resolve_device(device)
        llm = LLM(model=model, dtype=dtype, device=device, load_format=load_format)
        model_name, platform = llm.model_name, llm.engine.executor.platform_info()
        dtype = platform["dtype"]  # the HF baseline runs the dtype Treadle resolved
        run_treadle(llm, [WARMUP])
        treadle_s, treadle_out = run_treadle(llm, requests)
        del llm
        gc.collect()

        hf_model = load_hf_model(model, dtype, device, random=load_format == "dummy")
        run_hf_static(hf_model, [WARMUP], 1, pad)
        hf_s, hf_out, hf_computed = run_hf_static(hf_model, requests, hf_batch_size, pad)
        del hf_model
        gc.collect()
    finally:
        torch.set_num_threads(saved_threads)

    treadle_tokens = sum(len(o) for o in treadle_out)
    hf_tokens = sum(len(o) for o in hf_out)
    prefixes = [common_prefix(a, b) for a, b in zip(treadle_out, hf_out, strict=True)]
    treadle_tps = treadle_tokens / treadle_s
    hf_tps = hf_tokens / hf_s
    return {
        "model": model_name, **platform, "threads": n_threads, "seed": seed,
        "workload": "synthetic-chat (ShareGPT-like lengths)",
        "max_input_len": max_input_len, "max_output_len": max_output_len, **workload,
        "treadle": {"seconds": treadle_s, "output_tokens": treadle_tokens,
                    "output_tokens_per_s": treadle_tps,
                    "requests_per_s": len(requests) / treadle_s,
                    "short_requests": sum(len(o) != r.output_len
                                          for o, r in zip(treadle_out, requests, strict=True))},
        "hf": {"seconds": hf_s, "output_tokens": hf_tokens, "output_tokens_per_s": hf_tps,
               "requests_per_s": len(requests) / hf_s, "batch_size": hf_batch_size,
               "num_batches": -(-len(requests) // hf_batch_size),
               "computed_tokens": hf_computed, "order": "prompt order"},
        "ratio": treadle_tps / hf_tps, "target_ratio": TARGET_RATIO[device],
        "greedy_identical": sum(a == b for a, b in zip(treadle_out, hf_out, strict=True)),
        "greedy_common_prefix": sum(prefixes) / hf_tokens if hf_tokens else 1.0,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def format_offline(report: dict) -> str:
    t, h = report["treadle"], report["hf"]
    lines = [
        f"model {report['model']}  dtype {report['dtype']} ({report['dtype_reason']})  "
        f"threads {report['threads']}  seed {report['seed']}",
        f"workload {report['workload']}: {report['num_prompts']} prompts, "
        f"{report['total_prompt_tokens']:,} prompt tokens (mean {report['mean_prompt_len']:.0f}), "
        f"{report['total_output_tokens']:,} output tokens (mean {report['mean_output_len']:.0f})",
        f"{'':<28} {'seconds':>9} {'out tokens':>10} {'out tok/s':>10} {'req/s':>7}",
        f"{'treadle LLM.generate':<28} {t['seconds']:>9.2f} {t['output_tokens']:>10,} "
        f"{t['output_tokens_per_s']:>10.1f} {t['requests_per_s']:>7.2f}",
        f"{'HF generate, static b=' + str(h['batch_size']):<28} {h['seconds']:>9.2f} "
        f"{h['output_tokens']:>10,} {h['output_tokens_per_s']:>10.1f} {h['requests_per_s']:>7.2f}",
        f"ratio treadle / HF: {report['ratio']:.2f}x (target >= {report['target_ratio']:g}x)",
        f"HF computed {h['computed_tokens']:,} tokens for {h['output_tokens']:,} requested "
        f"({h['num_batches']} batches in {h['order']}); greedy outputs identical "
        f"{report['greedy_identical']}/{report['num_prompts']}, common prefix "
        f"{100 * report['greedy_common_prefix']:.0f}% of tokens",
    ]
    if t["short_requests"]:
        lines.append(f"WARNING: {t['short_requests']} Treadle requests ended before their "
                     "output length")
    return "\n".join(lines)
