"""Executor: what runs the model for `EngineCore` (vLLM's `Executor`).

The core knows the model only through this interface: the model's facts it schedules by
(`ModelFacts`), one `execute_model` call per step, and `platform_info` for logs. An executor
may run one `ModelRunner` in this process (`InProcessExecutor`) or drive several worker
processes, each holding a shard (`TensorParallelExecutor`, treadle/engine/tp_executor.py): then
`execute_model` sends the step's `ModelInput` to every rank and returns the output of the first.
`build_executor` picks one from the config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from treadle.config import EngineConfig
from treadle.model.capabilities import resolve_device, torch_dtype
from treadle.model.loader import load_model
from treadle.model.memory import KVCacheSize, check_weights_fit
from treadle.model.runner import ModelInput, ModelOutput, ModelRunner


@dataclass(frozen=True)
class ModelFacts:
    """What the scheduler and the frontend need to know of the loaded model and its cache."""

    max_model_len: int
    num_blocks: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    kv_cache: KVCacheSize  # what the cache holds, for the startup log and EngineReady
    weights_bytes: int  # as held in memory (quantized blocks, dense copies)


class Executor(ABC):
    facts: ModelFacts

    @abstractmethod
    def execute_model(self, model_input: ModelInput) -> ModelOutput:
        """Float32 logits [rows, vocab] of one step, and the final hidden states pooling
        sequences asked for (see `ModelRunner.run`)."""

    @abstractmethod
    def platform_info(self) -> dict[str, Any]:
        """The dtype served and why, and which fast paths run: for logs and /v1/models."""

    @abstractmethod
    def close(self) -> None:
        """Stop the processes the executor started; safe to call twice."""


def build_executor(config: EngineConfig) -> Executor:
    """The executor `config` asks for: one in-process runner, or tensor-parallel ranks."""
    if config.parallel.tensor_parallel_size > 1:
        if resolve_device(config.model.device) == "cuda":
            raise ValueError("tensor parallelism runs on CPU processes (gloo); on CUDA serve "
                             "with --tensor-parallel-size 1")
        # Imported here: tp_executor builds on this module's Executor.
        from treadle.engine.tp_executor import TensorParallelExecutor

        return TensorParallelExecutor(config)
    return InProcessExecutor(config)


class InProcessExecutor(Executor):
    """One `ModelRunner` in this process, on `engine_threads` torch threads."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.engine_threads is not None:
            torch.set_num_threads(config.parallel.engine_threads)
        model = config.model
        check_weights_fit(model)
        device = resolve_device(model.device)
        loaded = load_model(model.model, torch_dtype(model.dtype, device), model.quantization,
                            device=device)
        self.runner = ModelRunner(loaded, model, config.cache, config.scheduler)
        self.facts = ModelFacts(self.runner.max_model_len, self.runner.num_blocks,
                                loaded.spec.vocab_size, frozenset(loaded.spec.eos_token_ids),
                                self.runner.kv_size, self.runner.model.resident_bytes())

    def execute_model(self, model_input: ModelInput) -> ModelOutput:
        output = self.runner.run(model_input)
        if self.runner.device.type == "cuda":
            # The step's time is the GPU's, and a fault in it raises here, where the core
            # retries the batch one by one, not later in the sampler.
            torch.cuda.synchronize(self.runner.device)
        return output

    def platform_info(self) -> dict[str, Any]:
        return self.runner.platform_info()

    def close(self) -> None:
        pass  # no processes of its own
