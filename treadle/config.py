"""Configuration: frozen dataclasses, each validated once when built, the defaults here only.

Sections nest: `EngineConfig` (what the engine process needs: model, cache, scheduler,
parallelism, policy) inside `AsyncEngineConfig` (plus the frontend's admission, supervision and
observability), inside `ServeConfig` (plus the servers' `ServerConfig`). Every setting has one
flat name, unique across sections: the field's name, which is also its `treadle serve` flag
(`--block-size`), its `LLM(...)` keyword and its key in a `--config` file; `build_config` puts
flat settings into their sections.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

DTYPES = ("auto", "float32", "bfloat16")
# auto: cuda where torch sees a GPU, else cpu (treadle/model/capabilities.py resolve_device).
DEVICES = ("auto", "cpu", "cuda")
# auto: bfloat16 where the CPU computes it natively, else float32; the model's capability probe
# (treadle/model/capabilities.py) decides, at load.
DEFAULT_DTYPE = "auto"
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8", "int4")
# auto: the weights in the model's files; dummy: random weights of the shapes its config.json
# gives (vLLM's), for measuring a model nobody can download here.
LOAD_FORMATS = ("auto", "dummy")
# How /v1/embeddings pools a prompt's final hidden states (treadle/model/pooling.py): the last
# token's, vLLM's default for decoder LLMs, or the mean of all.
POOLING_TYPES = ("last", "mean")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to serve and how. `model` None means the default model."""

    model: str | None = None
    device: str = "auto"  # one of DEVICES
    dtype: str = DEFAULT_DTYPE
    max_model_len: int | None = None  # None: the model's own context length
    # auto: a GGUF's quantized matrices served as stored; see treadle/model/quantization.py.
    quantization: str = "auto"
    load_format: str = "auto"  # one of LOAD_FORMATS
    # With quantization: also keep each quantized matrix dequantized and prepacked, and run
    # steps of many rows as a float GEMM over it (memory for speed where the integer GEMM over
    # the blocks is slower). False: every step takes the integer kernels, the weights' memory
    # is the file's.
    dense_batch_weights: bool = False
    # Most rows a step may have for a quantized layer to take the integer kernel; None: measured
    # per layer shape when the model loads (the crossover depends on the CPU).
    quant_gemv_max_rows: int | None = None
    pooling: str = "last"  # embeddings: one of POOLING_TYPES
    # Sampling defaults for requests that omit them: "auto", the model's generation_config.json
    # (temperature, top_p, top_k, min_p, repetition_penalty), as vLLM does; "vllm": none (the
    # API's own defaults); or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # Most logprobs (and prompt_logprobs) one request may ask for per token (vLLM's default).
    max_logprobs: int = 20
    # Seeds the engine process's random generator, so requests without a seed of their own
    # sample the same across restarts (given the same batches). None: not seeded.
    seed: int | None = None
    # CUDA: run every step eagerly, without capturing decode steps as CUDA graphs (vLLM's flag).
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {self.pooling!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, "
                             f"got {self.load_format!r}")
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
    # None: sized from free memory; the rule and why: treadle/model/memory.py size_kv_cache.
    kv_cache_memory_bytes: int | None = None
    # CUDA: the share of the GPU's memory this engine may take, weights, activations and the
    # KV cache together; the cache gets what the rest leaves (vLLM's flag and default).
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be >= 1 (or None: from free memory)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


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
    # Under fair share, while more than one tenant is known, the most prompt tokens per step of
    # a prompt longer than long_prefill_token_threshold, so that steps stay short for the
    # others' arrivals. None: long_prefill_token_threshold.
    fair_chunk_tokens: int | None = None
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
        if self.fair_chunk_tokens is not None and self.fair_chunk_tokens < 1:
            raise ValueError("fair_chunk_tokens must be >= 1 (or None: no cap)")
        if self.max_kv_blocks_per_tenant is not None and self.max_kv_blocks_per_tenant < 1:
            raise ValueError("max_kv_blocks_per_tenant must be >= 1 (or None: no cap)")


@dataclass(frozen=True)
class APIKey:
    """A bearer key and its name, the tenant of its requests (treadle/server/auth.py reads
    them)."""

    name: str
    key: str
    weight: float | None = None  # the tenant's fair-share weight (None: not set here)


@dataclass(frozen=True)
class ServerConfig:
    """The frontends `treadle serve` runs over one engine: REST always, gRPC only when
    `grpc_port` is set (as vLLM's gRPC server is opt-in)."""

    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = None
    # Names clients may give as `model`, the first in responses; empty: the model's own name.
    served_model_name: tuple[str, ...] = ()
    # Bearer keys; empty: no auth. Each key's name is the tenant of its requests.
    api_keys: tuple[APIKey, ...] = ()
    metrics_without_auth: bool = False
    allowed_origins: tuple[str, ...] = ()  # CORS
    max_request_bytes: int = 4 << 20  # larger bodies get 413
    enable_debug_endpoints: bool = False
    # A Jinja chat template (the text, or a path to a file holding it) replacing the model's own;
    # a model with none (a base model) answers chat requests with 400 unless one is given.
    chat_template: str | None = None
    # How the model writes tool calls, read back into OpenAI's tool_calls (as vLLM's flag):
    # hermes (Hermes, Qwen 2.5/3) or llama3_json (server/openai/tool_parsers.py).
    tool_call_parser: str = "hermes"
    # On SIGTERM, seconds in-flight requests may take before they end with server_shutdown.
    shutdown_timeout: float = 30.0
    # A streamed response silent this long (queued, or holding text back) gets an SSE comment,
    # so that proxies with idle timeouts (nginx's 60 s by default) keep it open.
    sse_keepalive_interval: float = 15.0
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    # The path prefix a proxy serves the API under (ASGI root_path), for its docs' links.
    root_path: str = ""
    ssl_keyfile: str | None = None  # both: serve REST over HTTPS
    ssl_certfile: str | None = None

    def __post_init__(self) -> None:
        if not self.sse_keepalive_interval > 0:
            raise ValueError("sse_keepalive_interval must be > 0 seconds")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {UVICORN_LOG_LEVELS}, "
                             f"got {self.uvicorn_log_level!r}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile must be given together")
        if not all(self.served_model_name):
            raise ValueError("served_model_name must not be empty")
        for name, port in (("port", self.port), ("grpc_port", self.grpc_port)):
            if port is not None and not 0 <= port < 65536:
                raise ValueError(f"{name} must be in 0..65535, got {port}")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be >= 1")
        if not self.shutdown_timeout >= 0:
            raise ValueError("shutdown_timeout must be >= 0 seconds")


@dataclass(frozen=True)
class ParallelConfig:
    """How the engine process computes."""

    engine_threads: int | None = None  # torch intra-op threads; None: torch's, one per core
    # Ranks the model is split across (treadle/core/executor/tensor_parallel.py), each on
    # engine_threads // tensor_parallel_size threads; whether the model's heads allow it is
    # checked when its config is read, before any worker starts.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.engine_threads is not None and self.engine_threads < 1:
            raise ValueError(f"engine_threads must be >= 1, got {self.engine_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")


# The queue orderings of treadle/core/sched/policies.py (its POLICIES registry; a test keeps the two
# equal), named here so that a bad name fails before any process starts.
POLICY_NAMES = ("fcfs", "priority", "fair", "deadline")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine process needs, built once and passed whole."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    policy: str = "fcfs"
    trace_file: str | None = None  # a Chrome-trace/Perfetto JSON file of every engine step

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {POLICY_NAMES}, got {self.policy!r}")


@dataclass(frozen=True)
class AdmissionConfig:
    """What the frontend checks before a request reaches the engine: queue and tenant limits,
    tenants, cache isolation, default objectives. See treadle/frontend/admission.py."""

    # Requests waiting for their first token; past it: 429. None: no limit.
    max_queued_requests: int | None = 256
    max_queued_tokens: int | None = None  # prompt tokens waiting for their first token
    max_requests_per_tenant: int | None = None  # requests in flight per tenant
    max_queued_tokens_per_tenant: int | None = None
    # Distinct tenants named by clients' `user` fields that are tracked; later ones are "other".
    max_tenants: int = 1024
    isolate_prefix_cache_by_tenant: bool = False
    # Objectives of requests that set none (milliseconds; None: none).
    default_ttft_ms: float | None = None
    default_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_queued_tokens", "max_requests_per_tenant",
                     "max_queued_tokens_per_tenant"):
            value, least = getattr(self, name), 0 if name == "max_queued_requests" else 1
            if value is not None and value < least:
                raise ValueError(f"{name} must be >= {least} (or None: no limit), got {value}")
        if self.max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {self.max_tenants}")
        for name in ("default_ttft_ms", "default_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and value != float("inf")):
                raise ValueError(f"{name} must be > 0 milliseconds, got {value}")


@dataclass(frozen=True)
class SupervisionConfig:
    """How the frontend watches its engine process."""

    # Restarts of a dead engine in a row (backing off 0.5 s, 1 s, 2 s, ...) before its status is
    # "dead"; 0: never restart.
    max_engine_restarts: int = 5
    # Seconds a busy engine may go without finishing a step before it counts as stalled.
    engine_stall_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.max_engine_restarts < 0:
            raise ValueError(f"max_engine_restarts must be >= 0, got {self.max_engine_restarts}")
        if not self.engine_stall_timeout > 0:
            raise ValueError(f"engine_stall_timeout must be > 0 seconds, "
                             f"got {self.engine_stall_timeout}")


@dataclass(frozen=True)
class ObservabilityConfig:
    """Metrics labels, request timelines and the request log."""

    log_prompts: bool = False  # the prompt's text in each finished request's log line
    max_timelines: int = 1000  # the last finished samples' timelines kept for /debug/requests
    max_tenant_labels: int = 32  # distinct `tenant` label values; later tenants are "other"
    # Where to send one OpenTelemetry span per request (vLLM's flag); None: no tracing.
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.max_timelines < 0:
            raise ValueError(f"max_timelines must be >= 0, got {self.max_timelines}")
        if self.max_tenant_labels < 0:
            raise ValueError(f"max_tenant_labels must be >= 0, got {self.max_tenant_labels}")


# How a request's replica is picked under data parallelism (treadle/frontend/router.py).
ROUTER_NAMES = ("round-robin", "least-load", "prefix")


@dataclass(frozen=True)
class DataParallelConfig:
    """Engine replicas as Ray actors behind the frontend's router (treadle/frontend/
    data_parallel.py); 1: one engine process, no Ray."""

    data_parallel_size: int = 1
    router: str = "prefix"

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.router not in ROUTER_NAMES:
            raise ValueError(f"router must be one of {ROUTER_NAMES}, got {self.router!r}")


@dataclass(frozen=True)
class AsyncEngineConfig:
    """What `AsyncEngine` needs: the engine process's config and the frontend's side of it."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)


@dataclass(frozen=True)
class ServeConfig:
    """What `treadle serve` runs: one engine and the frontends over it."""

    engine: AsyncEngineConfig = field(default_factory=AsyncEngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


Config = TypeVar("Config")


def is_section(f: Field) -> bool:
    return f.default_factory is not MISSING and is_dataclass(f.default_factory)


def setting_fields(cls: type) -> dict[str, Field]:
    """Every flat setting of `cls` and its sections, by name."""
    found: dict[str, Field] = {}
    for f in fields(cls):
        found.update(setting_fields(f.default_factory) if is_section(f) else {f.name: f})
    return found


def setting_default(cls: type, name: str) -> Any:
    f = setting_fields(cls)[name]
    return f.default_factory() if f.default is MISSING else f.default


def build_config(cls: type[Config], settings: Mapping[str, Any]) -> Config:
    """`cls` (a config class) from flat settings (`{"block_size": 32, "port": 9000}`): each goes
    to the section that has it, absent ones keep their defaults. ValueError, naming the setting,
    for an unknown name, a value of the wrong type or out of range."""
    known = setting_fields(cls)
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ValueError(f"unknown setting {unknown[0]!r}; known: {', '.join(sorted(known))}")
    return _build(cls, {name: checked_value(name, value, known[name].type)
                        for name, value in settings.items()})


def _build(cls: type[Config], settings: Mapping[str, Any]) -> Config:
    return cls(**{f.name: _build(f.default_factory, settings) if is_section(f)
                  else settings[f.name] for f in fields(cls)
                  if is_section(f) or f.name in settings})


def checked_value(name: str, value: Any, annotation: str) -> Any:
    """`value` as setting `name` of type `annotation` (a string, as `from __future__ import
    annotations` leaves it) takes it: lists become tuples, an int named *_bytes may be written
    "2GiB"; ValueError if the type is wrong."""
    kinds = {part.strip().split("[")[0] for part in annotation.split("|")}
    if value is None and "None" in kinds:
        return None
    if name.endswith("_bytes") and isinstance(value, str):
        return parse_bytes(value, name)
    if isinstance(value, bool):
        ok = "bool" in kinds
    elif isinstance(value, int):
        ok = bool(kinds & {"int", "float"})
    elif isinstance(value, float):
        ok = "float" in kinds
    elif isinstance(value, str) and "str" not in kinds and "tuple" in kinds:
        value, ok = (value,), True  # one name where a list of names is expected
    elif isinstance(value, str):
        ok = "str" in kinds
    elif isinstance(value, Mapping):
        ok = "Mapping" in kinds
    elif isinstance(value, list | tuple):
        value, ok = tuple(value), "tuple" in kinds
    else:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be {annotation}, got {value!r}")
    return value


BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str, name: str = "size") -> int:
    """"2GiB", "512MiB", "1.5GB" or "1073741824" -> bytes; ValueError naming `name`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and BYTE_UNITS.get(match[2].lower())
    if not unit:
        raise ValueError(f"{name} must be a number of bytes such as 1073741824, 512MiB or 2GiB, "
                         f"got {text!r}")
    return int(float(match[1]) * unit)


def read_settings_file(path: str | Path) -> dict[str, Any]:
    """Flat settings from a YAML (.yaml, .yml), TOML (.toml) or JSON (.json) file: the same names
    as the flags, with underscores (`block_size: 32`). ValueError for an unreadable or malformed
    file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"config file {str(path)!r}: {e.strerror}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            settings = yaml.safe_load(text)
        elif path.suffix == ".toml":
            settings = tomllib.loads(text)
        elif path.suffix == ".json":
            settings = json.loads(text)
        else:
            raise ValueError("expected a .yaml, .toml or .json file")
    # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors; yaml's are not.
    except (ValueError, yaml.YAMLError) as e:
        raise ValueError(f"config file {str(path)!r}: {e}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"config file {str(path)!r}: expected a table of settings")
    return settings
