"""The machine's floor for a forward pass: measured memory bandwidth and matrix-multiply rate.

A decode step must at least read every weight once (and each sequence's KV cache), and must do
2 x params multiply-adds per token; the slower of the two bounds is the step's floor.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


def best_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm up caches and allocator
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
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
                     matmul_size: int = 2048) -> Roofline:
    """Measured with the current torch thread count."""
    buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    read_s = best_seconds(lambda: buffer.sum())
    a = torch.randn(matmul_size, matmul_size).to(dtype)
    b = torch.randn(matmul_size, matmul_size).to(dtype)
    mm_s = best_seconds(lambda: torch.mm(a, b))
    return Roofline(threads=torch.get_num_threads(),
                    read_bandwidth_gbs=buffer_bytes / read_s / 1e9,
                    matmul_gflops=2 * matmul_size ** 3 / mm_s / 1e9,
                    dtype=str(dtype).removeprefix("torch."))
