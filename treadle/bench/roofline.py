"""The machine's floor for a forward pass: measured memory bandwidth and matrix-multiply rate.

A decode step must at least read every weight once (and each sequence's KV cache), and must do
2 x params FLOPs per token; the slower of the two bounds is the step's floor.
`treadle bench roofline` prints the measurements and the floor for a model at a few batch sizes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from treadle.model.layers import DecoderModel


def best_seconds(fn, repeats: int = 5, cuda: bool = False) -> float:
    """The least of `repeats` timed calls; `cuda`: each waits for the GPU's work to finish."""
    fn()  # warm up caches and allocator
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass(frozen=True)
class Roofline:
    threads: int
    read_bandwidth_gbs: float  # GB/s streaming reads (a sum over a buffer far larger than cache)
    matmul_gflops: float  # GFLOP/s of a square matmul in the serving dtype
    dtype: str

    def step_floor_ms(self, bytes_read: float, flops: float) -> float:
        return 1e3 * max(bytes_read / (self.read_bandwidth_gbs * 1e9),
                         flops / (self.matmul_gflops * 1e9))

    def as_dict(self) -> dict:
        return asdict(self)


def measure_roofline(dtype: torch.dtype, buffer_bytes: int = 512 << 20,
                     matmul_size: int = 2048, device: str = "cpu") -> Roofline:
    """Measured with the current torch thread count, or on the GPU (`device` cuda: a buffer
    far beyond its L2, and matmuls large enough for its tensor cores)."""
    cuda = device == "cuda"
    if cuda:
        buffer_bytes, matmul_size = max(buffer_bytes, 4 << 30), max(matmul_size, 8192)
    buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32, device=device)
    read_s = best_seconds(lambda: buffer.sum(), cuda=cuda)
    a = torch.randn(matmul_size, matmul_size, device=device).to(dtype)
    b = torch.randn(matmul_size, matmul_size, device=device).to(dtype)
    mm_s = best_seconds(lambda: torch.mm(a, b), cuda=cuda)
    return Roofline(threads=torch.get_num_threads(),
                    read_bandwidth_gbs=buffer_bytes / read_s / 1e9,
                    matmul_gflops=2 * matmul_size ** 3 / mm_s / 1e9,
                    dtype=str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class DecodeCost:
    """What one decode step of a model must read and compute. A mixture of experts reads its
    other weights whole and, per layer, the experts its tokens choose: at `batch` tokens
    choosing k of E experts each (uniformly, as a trained router roughly does), an expected
    E * (1 - (1 - k/E)^batch) of them."""

    parameters: int  # read by a decode step (a tied embedding counts once), experts too
    weight_bytes: int  # all of them, as stored
    kv_bytes_per_token: int  # keys and values of one context token, all layers
    expert_parameters: int = 0  # the part of `parameters` in experts
    expert_bytes: int = 0  # the part of `weight_bytes` in experts
    expert_share: float = 0.0  # experts one token runs: k / E

    @classmethod
    def of(cls, model: DecoderModel, kv_cache_dtype: str) -> DecodeCost:
        """`kv_cache_dtype`: the cache's storage as resolved (resolve_kv_cache_dtype)."""
        from treadle.model.memory import kv_bytes_per_token

        moes = model.expert_layers()
        return cls(parameters=model.num_parameters(), weight_bytes=model.weight_bytes(),
                   kv_bytes_per_token=kv_bytes_per_token(model.spec, kv_cache_dtype),
                   expert_parameters=sum(m.expert_numel for m in moes),
                   expert_bytes=sum(m.expert_bytes for m in moes),
                   expert_share=moes[0].top_k / len(moes[0].experts) if moes else 0.0)

    def bytes_read(self, batch: int, context_len: int) -> int:
        experts_read = 1 - (1 - self.expert_share) ** batch
        return (self.weight_bytes - self.expert_bytes + round(self.expert_bytes * experts_read)
                + batch * context_len * self.kv_bytes_per_token)

    def flops(self, batch: int) -> int:
        active = self.parameters - self.expert_parameters \
            + self.expert_parameters * self.expert_share
        return round(2 * active * batch)

    def floor_ms(self, roof: Roofline, batch: int, context_len: int) -> float:
        return roof.step_floor_ms(self.bytes_read(batch, context_len), self.flops(batch))


def bench_roofline(model: str | None, dtype: str, batch_sizes: list[int],
                   context_len: int = 128, quantization: str = "auto",
                   load_format: str = "auto") -> dict:
    """The machine's measured bandwidth and matmul rate (current torch thread count), and the
    model's decode-step floor at each batch size, from the bytes its weights take as served."""
    from treadle.model.capabilities import resolve_dtype, resolve_kv_cache_dtype, torch_dtype
    from treadle.model.loader import load_model
    from treadle.model.registry import build_model

    loaded = load_model(model, torch_dtype(dtype), quantization, load_format=load_format)
    cost = DecodeCost.of(build_model(loaded.spec, loaded.weights, torch_dtype(dtype),
                                     context_len),
                         resolve_kv_cache_dtype("auto", resolve_dtype(dtype)[0], "cpu"))
    roof = measure_roofline(torch_dtype(dtype))
    rows = []
    for batch in batch_sizes:
        memory_ms = 1e3 * cost.bytes_read(batch, context_len) / (roof.read_bandwidth_gbs * 1e9)
        floor_ms = cost.floor_ms(roof, batch, context_len)
        rows.append({"batch": batch, "bytes_read": cost.bytes_read(batch, context_len),
                     "flops": cost.flops(batch), "floor_ms": floor_ms,
                     "bound": "memory" if memory_ms >= floor_ms else "compute",
                     "tokens_per_s": batch / floor_ms * 1e3})
    dtype_name, dtype_reason = resolve_dtype(dtype)
    return {"model": loaded.name, "dtype": dtype_name, "dtype_reason": dtype_reason,
            "quantization": loaded.quantization,
            "context_len": context_len, **asdict(cost),
            "roofline": roof.as_dict(), "rows": rows,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def format_roofline(report: dict) -> str:
    roof = report["roofline"]
    lines = [f"machine: {roof['read_bandwidth_gbs']:.1f} GB/s read bandwidth, "
             f"{roof['matmul_gflops']:.0f} GFLOP/s {roof['dtype']} matmul, "
             f"{roof['threads']} threads",
             f"model {report['model']}  params {report['parameters']:,}  weights "
             f"{report['weight_bytes'] / 1e6:.0f} MB  context {report['context_len']}  dtype "
             f"{report['dtype']} ({report['dtype_reason']})  quantization "
             f"{report['quantization']}",
             f"{'batch':>5} {'MB read':>8} {'GFLOP':>7} {'floor ms':>9} {'bound':>8} "
             f"{'tok/s max':>10}"]
    for r in report["rows"]:
        lines.append(f"{r['batch']:>5} {r['bytes_read'] / 1e6:>8.1f} {r['flops'] / 1e9:>7.2f} "
                     f"{r['floor_ms']:>9.3f} {r['bound']:>8} {r['tokens_per_s']:>10.0f}")
    return "\n".join(lines)
