"""Engine configuration: frozen dataclasses, each validated once when built."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16")
# auto: bfloat16 where the CPU computes it natively, else float32; the model's capability probe
# (treadle/model/capabilities.py) decides, at load.
DEFAULT_DTYPE = "auto"


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to serve and how. `model` None means the default model."""

    model: str | None = None
    dtype: str = DEFAULT_DTYPE
    max_model_len: int | None = None  # None: the model's own context length

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: `num_blocks` blocks of `block_size` token slots per layer."""

    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: tokens in one model pass, sequences in one pass, prefill per request."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    # Cap on one request's prefill tokens per step, so a long prompt cannot starve short ones.
    long_prefill_token_threshold: int = 256

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be >= 1")
