"""`AsyncLLM`: the engine as an asyncio Python API, as vLLM's `AsyncLLM` is. Prompts (text or
token ids) stream their outputs while the engine batches them with every other request; the
engine runs in its own process (torch is imported there, not here).

    async with AsyncLLM(max_model_len=2048) as llm:
        async for output in llm.generate("The sky is", SamplingParams(max_tokens=32)):
            print(output.outputs[0].text)  # the text so far; output.finished at the end
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import aclosing
from types import TracebackType
from typing import Any

from treadle.config import AsyncEngineConfig, build_config
from treadle.core.sampling_params import SamplingParams
from treadle.frontend.async_engine import AsyncEngine
from treadle.outputs import RequestOutput, request_output
from treadle.plugins import load_plugins
from treadle.tokenizer import Tokenizer


class AsyncLLM:
    def __init__(self, model: str | None = None, **settings: Any) -> None:
        """`model`: an HF folder or .gguf file (None: the default model); `settings`: any
        setting of `AsyncEngineConfig`'s sections by its flat name, as `LLM(...)` takes them
        (plus the frontend's: max_queued_requests, ...). ValueError naming a bad one. The
        engine starts on `start()` or `async with`."""
        load_plugins()  # first: a plugin's policy and its settings may be among `settings`
        self.engine = AsyncEngine(build_config(AsyncEngineConfig, {"model": model, **settings}))
        self.request_ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    async def start(self) -> None:
        """Start the engine process and wait until the model is loaded (RuntimeError if it
        fails to load)."""
        await self.engine.start()

    async def shutdown(self) -> None:
        """End what is in flight and stop the engine process."""
        await self.engine.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        await self.shutdown()

    def chat_prompt(self, messages: str | list[dict[str, str]]) -> list[int]:
        """A chat (or one user message) through the model's chat template, as token ids."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                  add_generation_prompt=True)

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as its tokens arrive: each `RequestOutput` holds every
        sample's text and tokens so far (vLLM's cumulative outputs); the last has `finished`.
        Text gets the tokenizer's special tokens, as `LLM.generate` does. `sampling_params`
        None: the model's generation config's defaults. Leaving the loop early aborts the
        request. ValueError for a request the engine refuses; EngineOverloaded when the queue
        is full; EngineUnavailable when the engine is down."""
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        if sampling_params is None:
            sampling_params = SamplingParams(**self.engine.sampling_defaults)
        if request_id is None:
            request_id = f"async-{next(self.request_ids)}"
        # aclosing: leaving early aborts the request now, not when the generator is collected.
        async with aclosing(self.engine.generate(request_id, ids, sampling_params,
                                                 priority)) as updates:
            async for update in updates:
                yield request_output(update.state)
