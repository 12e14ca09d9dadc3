"""InProcessExecutor: one ModelRunner in the engine process."""

from __future__ import annotations

from typing import Any

import torch

from treadle.config import EngineConfig
from treadle.core.executor.base import Executor, ModelFacts, verify_rows
from treadle.model.batch import ModelInput, ModelOutput
from treadle.model.capabilities import resolve_device, torch_dtype
from treadle.model.loader import load_model
from treadle.model.memory import check_weights_fit
from treadle.model.runner import ModelRunner


class InProcessExecutor(Executor):
    """One `ModelRunner` in this process, on `engine_threads` torch threads."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.engine_threads is not None:
            torch.set_num_threads(config.parallel.engine_threads)
        model = config.model
        check_weights_fit(model)
        device = resolve_device(model.device)
        loaded = load_model(model.model, torch_dtype(model.dtype, device), model.quantization,
                            device=device, load_format=model.load_format)
        self.runner = ModelRunner(loaded, model, config.cache, config.scheduler,
                                  verify_rows(config))
        self.facts = ModelFacts(loaded.spec, self.runner.max_model_len, self.runner.num_blocks,
                                loaded.spec.vocab_size, frozenset(loaded.spec.eos_token_ids),
                                self.runner.kv_size, self.runner.model.resident_bytes(),
                                loaded.spec.num_parameters(), loaded.spec.active_parameters())

    def execute_model(self, model_input: ModelInput) -> ModelOutput:
        output = self.runner.run(model_input)
        if self.runner.device.type == "cuda":
            # The step's time is the GPU's, and a fault in it raises here, where the core
            # retries the batch one by one, not later in the sampler.
            torch.cuda.synchronize(self.runner.device)
        return output

    def lora_ready(self, lora_id: int, path: str) -> bool:
        return self.runner.lora is None or self.runner.lora.ready(lora_id, path)

    def platform_info(self) -> dict[str, Any]:
        return self.runner.platform_info()

    def close(self) -> None:
        pass  # no processes of its own
