"""Executors: what runs the model for the engine core, one process or tensor-parallel ranks."""

from __future__ import annotations

from treadle.config import EngineConfig
from treadle.core.executor.base import Executor, ModelFacts
from treadle.core.executor.in_process import InProcessExecutor
from treadle.core.executor.tensor_parallel import TensorParallelExecutor
from treadle.model.capabilities import resolve_device

__all__ = ["Executor", "InProcessExecutor", "ModelFacts", "TensorParallelExecutor",
           "build_executor"]


def build_executor(config: EngineConfig) -> Executor:
    """The executor `config` asks for: one in-process runner, or tensor-parallel ranks."""
    if config.parallel.tensor_parallel_size > 1:
        if resolve_device(config.model.device) == "cuda":
            raise ValueError("tensor parallelism runs on CPU processes (gloo); on CUDA serve "
                             "with --tensor-parallel-size 1")
        return TensorParallelExecutor(config)
    return InProcessExecutor(config)
