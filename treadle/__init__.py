"""Treadle: `from treadle import LLM, SamplingParams` (the offline API), `AsyncLLM` (the asyncio
API), as vLLM names them. Each is imported on first use, so that importing `treadle` (or the
server, which never needs torch) does not import torch until an engine is built."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# The built-in queue policies register their names and settings with treadle.config as they are
# imported (config, below them, cannot import them): here, so that every config knows them.
import treadle.core.sched  # noqa: F401

if TYPE_CHECKING:
    from treadle.async_llm import AsyncLLM
    from treadle.core.lora_request import LoRARequest
    from treadle.core.sampling_params import SamplingParams
    from treadle.llm import LLM
    from treadle.outputs import CompletionOutput, RequestOutput

# name -> the module that defines it
LAZY = {"LLM": "treadle.llm", "AsyncLLM": "treadle.async_llm",
        "SamplingParams": "treadle.core.sampling_params",
        "LoRARequest": "treadle.core.lora_request",
        "RequestOutput": "treadle.outputs", "CompletionOutput": "treadle.outputs"}
__all__ = ["LLM", "AsyncLLM", "SamplingParams", "LoRARequest", "RequestOutput",
           "CompletionOutput"]


def __getattr__(name: str) -> Any:
    if name not in LAZY:
        raise AttributeError(f"module 'treadle' has no attribute {name!r}")
    return getattr(import_module(LAZY[name]), name)
