"""`treadle bench forward`: decode-step time of the model runner against the machine's floor.

Each batch decodes one token per sequence at a fixed context length (the same positions every
step, so the context stays constant); the floor counts the weight bytes and each sequence's KV
bytes read per step, and 2 x params x batch multiply-add FLOPs.
"""

from __future__ import annotations

import time

import torch

from treadle.bench.roofline import DecodeCost, best_seconds, measure_roofline
from treadle.config import CacheConfig, ModelConfig
from treadle.model.capabilities import torch_dtype
from treadle.model.loader import load_model
from treadle.model.runner import ModelInput, ModelRunner, ScheduledSequence


def bench_forward(model: str | None, dtype: str, batch_sizes: list[int], threads: list[int],
                  context_len: int = 128, block_size: int = 16, steps: int = 10) -> dict:
    blocks_per_seq = context_len // block_size + 1
    num_blocks = max(batch_sizes) * blocks_per_seq
    model_config = ModelConfig(model=model, dtype=dtype)
    loaded = load_model(model, torch_dtype(dtype))
    runner = ModelRunner(loaded, model_config, CacheConfig(block_size=block_size,
                                                           num_blocks=num_blocks))
    cost = DecodeCost.of(runner.model)
    rows = []
    saved_threads = torch.get_num_threads()
    try:
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            roof = measure_roofline(runner.dtype)
            for batch in batch_sizes:
                model_input = ModelInput([
                    ScheduledSequence([100 + i], context_len - 1,
                                      list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
                    for i in range(batch)])
                step_s = best_seconds(lambda mi=model_input: runner.execute(mi), repeats=steps)
                floor_ms = cost.floor_ms(roof, batch, context_len)
                rows.append({
                    "threads": n_threads, "batch": batch, "ms_per_step": step_s * 1e3,
                    "tokens_per_s": batch / step_s, "floor_ms": floor_ms,
                    "ratio_to_floor": step_s * 1e3 / floor_ms,
                    "bandwidth_gbs": roof.read_bandwidth_gbs, "matmul_gflops": roof.matmul_gflops,
                })
    finally:
        torch.set_num_threads(saved_threads)
    return {"model": loaded.name, **runner.platform_info(), "parameters": cost.parameters,
            "weight_bytes": cost.weight_bytes, "context_len": context_len, "rows": rows,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


def format_forward(report: dict) -> str:
    lines = [f"model {report['model']}  params {report['parameters']:,}"
             f"  weights {report['weight_bytes'] / 1e6:.0f} MB  context {report['context_len']}",
             f"dtype {report['dtype']} ({report['dtype_reason']}); {report['isa']}, oneDNN "
             f"linear {on_off(report['onednn_linear'])}, native attention "
             f"{on_off(report['native_attention'])}",
             f"{'threads':>7} {'batch':>5} {'ms/step':>8} {'tok/s':>8} {'floor ms':>8} "
             f"{'x floor':>7} {'GB/s':>6} {'GFLOP/s':>8}"]
    for r in report["rows"]:
        lines.append(f"{r['threads']:>7} {r['batch']:>5} {r['ms_per_step']:>8.2f} "
                     f"{r['tokens_per_s']:>8.1f} {r['floor_ms']:>8.2f} "
                     f"{r['ratio_to_floor']:>7.2f} {r['bandwidth_gbs']:>6.1f} "
                     f"{r['matmul_gflops']:>8.0f}")
    return "\n".join(lines)
