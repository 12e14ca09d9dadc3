"""Executor: what runs the model for `EngineCore` (vLLM's `Executor`).

The core knows the model only through this interface: the model's facts it schedules by
(`ModelFacts`), one `execute_model` call per step, and `platform_info` for logs. An executor
may run one `ModelRunner` in this process (`InProcessExecutor`) or drive several worker
processes, each holding a shard (`TensorParallelExecutor`, tensor_parallel.py): then
`execute_model` sends the step's `ModelInput` to every rank and returns the output of the first.
`build_executor` (this package's) picks one from the config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from treadle.config import EngineConfig
from treadle.model.batch import ModelInput, ModelOutput
from treadle.model.family import ModelSpec
from treadle.model.memory import KVCacheSize


@dataclass(frozen=True)
class ModelFacts:
    """What the scheduler and the frontend need to know of the loaded model and its cache."""

    spec: ModelSpec  # its hyperparameters, which a LoRA adapter's shapes must fit
    max_model_len: int
    num_blocks: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    kv_cache: KVCacheSize  # what the cache holds, for the startup log and EngineReady
    weights_bytes: int  # as held in memory (quantized blocks, dense copies)
    num_parameters: int = 0
    active_parameters: int = 0  # those one token runs through (a mixture of experts: fewer)


class Executor(ABC):
    facts: ModelFacts

    @abstractmethod
    def execute_model(self, model_input: ModelInput) -> ModelOutput:
        """Float32 logits [rows, vocab] of one step, and the final hidden states pooling
        sequences asked for (see `ModelRunner.run`)."""

    def lora_ready(self, lora_id: int, path: str) -> bool:
        """Whether the adapter's weights are in memory for the next step; if not, they start
        loading in the background. True where adapters load inside the step."""
        return True

    @abstractmethod
    def platform_info(self) -> dict[str, Any]:
        """The dtype served and why, and which fast paths run: for logs and /v1/models."""

    @abstractmethod
    def close(self) -> None:
        """Stop the processes the executor started; safe to call twice."""


def verify_rows(config: EngineConfig) -> int:
    """The rows of a step verifying one sequence's proposed tokens: its last token and the
    proposals (1 without speculative decoding)."""
    spec = config.speculative_config
    return 1 if spec is None else 1 + spec.num_speculative_tokens
