"""`treadle bench forward`: decode-step time of the model runner against the machine's floor.

Each batch decodes one token per sequence at a fixed context length (the same positions every
step, so the context stays constant); the floor counts the weight bytes and each sequence's KV
bytes read per step, and 2 x params x batch multiply-add FLOPs.
"""

from __future__ import annotations

import time
from itertools import product

import torch

from treadle.bench.roofline import DecodeCost, best_seconds, measure_roofline
from treadle.config import CacheConfig, ModelConfig, SchedulerConfig
from treadle.model.attention import KVCache
from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.capabilities import resolve_device, torch_dtype
from treadle.model.loader import load_model
from treadle.model.runner import ModelRunner
from treadle.model.source import resolve_model


def bench_forward(model: str | None, dtype: str, batch_sizes: list[int], threads: list[int],
                  context_len: int = 128, block_size: int = 16, steps: int = 10,
                  quantizations: tuple[str, ...] = ("none", "auto"), device: str = "auto",
                  load_format: str = "auto", kv_cache_dtypes: tuple[str, ...] = ("auto",)
                  ) -> dict:
    """Each quantization's runner with each KV cache dtype in turn, in this one run, so their
    rows compare. On CUDA
    every quantization is served as `none` (one runner), torch's thread count does not apply,
    and decode steps replay CUDA graphs captured up to the largest batch."""
    device = resolve_device(device)
    if device == "cuda":
        quantizations, threads = ("none",), [torch.get_num_threads()]
    num_blocks = max(batch_sizes) * (context_len // block_size + 1)
    rows, runs = [], []
    saved_threads = torch.get_num_threads()
    try:
        for quantization, kv_cache_dtype in product(quantizations, kv_cache_dtypes):
            model_config = ModelConfig(model=model, dtype=dtype, quantization=quantization,
                                       device=device, load_format=load_format)
            runner = ModelRunner(
                load_model(model, torch_dtype(dtype, device), quantization, device=device,
                           load_format=load_format),
                model_config, CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                          kv_cache_dtype=kv_cache_dtype),
                SchedulerConfig(max_num_seqs=max(batch_sizes)))
            fill_kv_cache(runner.kv_cache)
            cost = DecodeCost.of(runner.model, runner.kv_cache_dtype)
            runs.append({**runner.platform_info(), "weight_bytes": cost.bytes_read(1, 0),
                         "resident_bytes": runner.model.resident_bytes()})
            rows += time_decode_steps(runner, cost, batch_sizes, threads, context_len, steps)
    finally:
        torch.set_num_threads(saved_threads)
    return {"model": resolve_model(model).name, "parameters": cost.parameters, "runs": runs,
            "context_len": context_len, "rows": rows,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def fill_kv_cache(kv_cache: KVCache) -> None:
    """Random keys and values in every slot: a CPU cache allocated untouched reads as one
    shared page of zeros, from cache, where a server's contexts stream from memory."""
    generator = torch.Generator(device=kv_cache.keys[0].device).manual_seed(0)
    for cache in kv_cache.keys + kv_cache.values:
        if cache.dtype == torch.int8:
            cache.random_(-127, 128, generator=generator)
        else:
            cache.normal_(generator=generator)
    for scales in kv_cache.key_scales + kv_cache.value_scales:
        if scales is not None:
            scales.fill_(1 / 127)


def time_decode_steps(runner: ModelRunner, cost: DecodeCost, batch_sizes: list[int],
                      threads: list[int], context_len: int, steps: int) -> list[dict]:
    blocks_per_seq = context_len // runner.block_size + 1
    rows = []
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        cuda = runner.device.type == "cuda"
        roof = measure_roofline(runner.dtype, device=runner.device.type)
        for batch in batch_sizes:
            model_input = ModelInput([
                ScheduledSequence([100 + i], context_len - 1,
                                  list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
                for i in range(batch)])
            step_s = best_seconds(lambda mi=model_input: runner.execute(mi), repeats=steps,
                                  cuda=cuda)
            floor_ms = cost.floor_ms(roof, batch, context_len)
            rows.append({
                "quantization": runner.quantization, "kv_cache_dtype": runner.kv_cache_dtype,
                "threads": n_threads, "batch": batch,
                "ms_per_step": step_s * 1e3, "tokens_per_s": batch / step_s,
                "floor_ms": floor_ms, "ratio_to_floor": step_s * 1e3 / floor_ms,
                "bandwidth_gbs": roof.read_bandwidth_gbs, "matmul_gflops": roof.matmul_gflops})
    return rows


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


def format_forward(report: dict) -> str:
    lines = [f"model {report['model']}  params {report['parameters']:,}  context "
             f"{report['context_len']}"]
    for run in report["runs"]:
        lines.append(
            f"quantization {run['quantization']} ({run['quantized_types']}): weights read per "
            f"one-token step {run['weight_bytes'] / 1e6:.0f} MB, resident "
            f"{run['resident_bytes'] / 1e6:.0f}"
            f" MB; device {run['device']}"
            + (f" (CUDA graphs: {run['cuda_graphs']})" if "cuda_graphs" in run else "")
            + f"; dtype {run['dtype']} ({run['dtype_reason']}), KV cache "
            f"{run['kv_cache_dtype']}; "
            f"{run['isa']}, oneDNN linear {on_off(run['onednn_linear'])}, native attention "
            f"{on_off(run['native_attention'])}, quantized kernels "
            f"{on_off(run['quant_kernels'])} (integer path up to rows: {run['gemv_rows']})")
    lines.append(f"{'quant':>6} {'KV':>8} {'threads':>7} {'batch':>5} {'ms/step':>8} "
                 f"{'tok/s':>8} {'floor ms':>8} {'x floor':>7} {'GB/s':>6} {'GFLOP/s':>8}")
    for r in report["rows"]:
        lines.append(f"{r['quantization']:>6} {r['kv_cache_dtype']:>8} {r['threads']:>7} "
                     f"{r['batch']:>5} "
                     f"{r['ms_per_step']:>8.2f} {r['tokens_per_s']:>8.1f} {r['floor_ms']:>8.2f} "
                     f"{r['ratio_to_floor']:>7.2f} {r['bandwidth_gbs']:>6.1f} "
                     f"{r['matmul_gflops']:>8.0f}")
    return "\n".join(lines)
