"""Offline API: `LLM(model).generate(prompts, sampling_params)` runs requests to completion;
`LLM(model).embed(prompts)` embeds prompts (the engine's `pooling`, normalised), as vLLM's."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from treadle.config import EngineConfig, build_config
from treadle.core.generation_defaults import sampling_defaults
from treadle.core.lora_request import LoRARequest
from treadle.core.sampling_params import SamplingParams
from treadle.frontend.output_processor import OutputProcessor, RequestState
from treadle.model.source import resolve_model
from treadle.outputs import RequestOutput, request_output
from treadle.plugins import load_plugins
from treadle.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding, shaped as vLLM's (`.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


class LLM:
    def __init__(self, model: str | None = None, **settings: Any) -> None:
        """`model`: an HF folder or .gguf file (None: the default model); `settings`: any
        setting of `EngineConfig`'s sections by its flat name (dtype, quantization,
        max_model_len, block_size, kv_cache_memory_bytes, max_num_seqs, policy, ...).
        ValueError naming the setting for an unknown or bad one."""
        load_plugins()  # first: a plugin's policy and its settings may be among `settings`
        config = build_config(EngineConfig, {"model": model, **settings})
        source = resolve_model(model)
        self.model_name = source.name
        self.tokenizer = Tokenizer.from_folder(source.folder)
        # What generate() samples with when given no SamplingParams (--generation-config).
        self.default_sampling_params = SamplingParams(**sampling_defaults(
            source.folder, config.model.generation_config))
        from treadle.core.engine_core import EngineCore  # torch: only once an engine is built

        self.engine = EngineCore(config)
        self.next_request_id = 0
        info = self.engine.executor.platform_info()
        logger.info("dtype %s (%s); %s, oneDNN linear %s, native attention %s, quantization "
                    "%s (%s)", info["dtype"], info["dtype_reason"], info["isa"],
                    info["onednn_linear"], info["native_attention"], info["quantization"],
                    info["quantized_types"])

    def chat_prompt(self, message: str) -> list[int]:
        """A one-turn chat through the model's chat template, as token ids."""
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=True, add_generation_prompt=True)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt (text, or token ids) to completion; outputs in prompt order.
        `lora_request`: the adapter every prompt runs with, or one per prompt (None: the base
        model), as vLLM's."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.default_sampling_params
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        loras = (lora_request if isinstance(lora_request, list)
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        processor = OutputProcessor(self.tokenizer)
        states: list[RequestState] = []
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                # Text gets the tokenizer's special tokens (Gemma's <bos>), as vLLM's does; chat
                # prompts come as ids, their template having placed them.
                ids = (self.tokenizer(prompt)["input_ids"]
                       if isinstance(prompt, str) else list(prompt))
                request_id = str(self.next_request_id)
                self.next_request_id += 1
                for engine_id, engine_params in processor.add_request(request_id, ids, p):
                    self.engine.add_request(engine_id, ids, engine_params, lora_request=lora)
                states.append(processor.requests[request_id])
            self._run(processor, len(states), use_tqdm)
        finally:  # on an error or an interrupt, leave nothing behind in the engine
            for engine_id in processor.samples:
                self.engine.abort_request(engine_id)
        return [request_output(state) for state in states]

    def embed(self, prompts: str | list[str] | list[list[int]],
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (text, or token ids) as prefill-only requests; outputs in prompt
        order. ValueError for a prompt the engine refuses (empty, longer than max_model_len),
        RuntimeError if the engine fails one."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompt_ids = [self.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p)
                      for p in prompts]
        request_ids: list[str] = []
        embeddings: dict[str, list[float]] = {}
        try:
            for ids in prompt_ids:
                request_id = str(self.next_request_id)
                self.next_request_id += 1
                self.engine.add_request(request_id, ids, SamplingParams(), pooling=True)
                request_ids.append(request_id)
            with tqdm(total=len(request_ids), desc="embed", unit="req",
                      disable=not use_tqdm) as bar:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished and out.embedding is None:
                            raise RuntimeError(f"request {out.request_id} ended with "
                                               f"{out.finish_reason}")
                        if out.embedding is not None:
                            embeddings[out.request_id] = out.embedding
                            bar.update(1)
        finally:  # on an error or an interrupt, leave nothing behind in the engine
            for request_id in request_ids:
                self.engine.abort_request(request_id)
        return [EmbeddingRequestOutput(r, ids, EmbeddingOutput(embeddings[r]))
                for r, ids in zip(request_ids, prompt_ids, strict=True)]

    def _run(self, processor: OutputProcessor, num_requests: int, use_tqdm: bool) -> None:
        with tqdm(total=num_requests, desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                deltas, to_abort = processor.process(self.engine.step())
                for engine_id in to_abort:
                    self.engine.abort_request(engine_id)
                bar.update(sum(1 for d in deltas if d.finished
                               and processor.requests[d.request_id].finished))
