"""Engine configuration: frozen dataclasses, each validated once when built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from treadle.server.auth import APIKey

DTYPES = ("auto", "float32", "bfloat16")
# auto: bfloat16 where the CPU computes it natively, else float32; the model's capability probe
# (treadle/model/capabilities.py) decides, at load.
DEFAULT_DTYPE = "auto"
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8", "int4")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to serve and how. `model` None means the default model."""

    model: str | None = None
    dtype: str = DEFAULT_DTYPE
    max_model_len: int | None = None  # None: the model's own context length
    # auto: a GGUF's quantized matrices served as stored; see treadle/model/quantization.py.
    quantization: str = "auto"
    # With quantization: also keep each quantized matrix dequantized and prepacked, for steps of
    # many rows (a float GEMM beats the row-by-row integer kernel there). False: the least
    # memory, and such steps dequantize their weights each time.
    dense_batch_weights: bool = True
    # Most rows a step may have for a quantized layer to take the integer kernel; None: measured
    # per layer shape when the model loads (the crossover depends on the CPU).
    quant_gemv_max_rows: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, "
                             f"got {self.quantization!r}")
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
    """Per-step limits (tokens and sequences in one pass, prefill per request and at once), the
    queue time limit, and the queue policies' settings."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    # Cap on one request's prefill tokens per step, so a long prompt cannot starve short ones.
    long_prefill_token_threshold: int = 256
    # Requests mid-prefill (more than one token left to compute) that get a chunk in one step:
    # long prompts cannot hold every prefill slot (vLLM's name).
    max_num_partial_prefills: int = 4
    # Seconds a request may wait without ever being scheduled; then it finishes with
    # finish_reason "queue_timeout". None: no limit.
    max_queue_wait: float | None = None
    # A request preempted this many times (for any reason) is no longer displaced by a waiting
    # request under the priority or fair policy; running short of blocks may still preempt it.
    max_policy_preemptions: int = 2
    # Fair share (the Virtual Token Counter): a tenant's service is w_p per prompt token plus
    # w_q per output token, divided by its weight (tenant -> weight; absent: 1).
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    fair_prompt_token_weight: float = 1.0
    fair_output_token_weight: float = 2.0
    # The most KV cache blocks one tenant's running requests may hold when another of its
    # requests is admitted (under every policy). None: no cap.
    max_kv_blocks_per_tenant: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be >= 1")
        if self.max_num_partial_prefills < 1:
            raise ValueError("max_num_partial_prefills must be >= 1")
        if self.max_queue_wait is not None and not self.max_queue_wait > 0:
            raise ValueError("max_queue_wait must be > 0 seconds (or None: no limit)")
        if self.max_policy_preemptions < 0:
            raise ValueError("max_policy_preemptions must be >= 0")
        bad = {t: w for t, w in self.tenant_weights.items() if not w > 0}
        if bad:
            raise ValueError(f"tenant weights must be > 0, got {bad}")
        if not (self.fair_prompt_token_weight >= 0 and self.fair_output_token_weight >= 0):
            raise ValueError("fair token weights must be >= 0")
        if self.max_kv_blocks_per_tenant is not None and self.max_kv_blocks_per_tenant < 1:
            raise ValueError("max_kv_blocks_per_tenant must be >= 1 (or None: no cap)")


@dataclass(frozen=True)
class ServerConfig:
    """The frontends `treadle serve` runs over one engine: REST always, gRPC unless
    `grpc_port` is None."""

    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = 50051
    # Bearer keys; empty: no auth. Each key's name is the tenant of its requests.
    api_keys: tuple[APIKey, ...] = ()
    metrics_without_auth: bool = False
    allowed_origins: tuple[str, ...] = ()  # CORS
    max_request_bytes: int = 4 << 20  # larger bodies get 413
    enable_debug_endpoints: bool = False
    # A Jinja chat template (the text, or a path to a file holding it) replacing the model's own;
    # a model with none (a base model) answers chat requests with 400 unless one is given.
    chat_template: str | None = None
    # On SIGTERM, seconds in-flight requests may take before they end with server_shutdown.
    shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name, port in (("port", self.port), ("grpc_port", self.grpc_port)):
            if port is not None and not 0 <= port < 65536:
                raise ValueError(f"{name} must be in 0..65535, got {port}")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be >= 1")
        if not self.shutdown_timeout >= 0:
            raise ValueError("shutdown_timeout must be >= 0 seconds")
