"""Configuration: frozen dataclasses, each validated once when built, the defaults here only.

Sections nest: `EngineConfig` (what the engine process needs: model, cache, scheduler,
parallelism, policy) inside `AsyncEngineConfig` (plus the frontend's admission, supervision and
observability), inside `ServeConfig` (plus the servers' `ServerConfig`). Every setting has one
flat name, unique across sections: the field's name, which is also its `treadle serve` flag
(`--block-size`), its `TREADLE_BLOCK_SIZE` variable, its `LLM(...)` keyword, its key in a
`--config` file and, for the engine settings a simulation can act on, its `treadle sim` option;
`build_config` puts flat settings into their sections. Each is declared once, with `setting`:
its default and its help (the flag's) travel together.

Queue policies bring their own settings: each registered policy's section (a dataclass of
`setting`s, in its own module under treadle/core/sched/) joins `EngineConfig.policies`, so its
settings get flat names, flags and checks as the others do. Config sits below the policies and
cannot import them: they register here (`register_policy`) when imported.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
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
# The KV cache's storage (vLLM's flag): auto, the model's dtype but bfloat16 under a float32
# model on the CPU (model/capabilities.py resolve_kv_cache_dtype); bfloat16; float32; int8, keys
# and values in 8 bits with a float32 scale per token slot and KV head (model/attention.py).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

# The titles the settings' flags are grouped under in `treadle serve --help`.
MODEL, CACHE, SCHEDULING, ADMISSION, SERVER = "model", "KV cache", "scheduling", "admission", \
    "server"
OPERATIONS = "observability and supervision"
DATA_PARALLEL = 'data parallelism (Ray; pip install -e ".[ray]")'


def setting(default: Any, help: str | Callable[[], str], *, none: str = "none",
            choices: Any = None, group: str | None = None,
            flag: Mapping[str, Any] | None = None) -> Any:
    """A setting's field: its default and help. `none`: what a default of None means (shown in
    the help); `choices`: the values it takes (a container, checked by its flag); `group`: the
    help's group when not its section's; `flag`: argparse options of its flag beyond its name,
    type, default and help (`aliases`, `nargs`, `action`, `metavar`), or `{"skip": True}` for a
    setting given by other flags."""
    metadata = {"help": help, "none": none, "choices": choices, "group": group,
                "flag": flag or {}}
    if isinstance(default, dict):  # mutable: each config gets its own
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, title: str | None = None) -> Any:
    """A field holding a section (`cls`, with its defaults); `title`: its settings' group in
    the help (None: each setting's own, or its parent section's)."""
    return field(default_factory=cls, metadata={"title": title})


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to serve and how. `model` None means the default model."""

    model: str | None = setting(None, "Hugging Face folder or .gguf file",
                                none="SmolLM2-135M-Instruct")
    device: str = setting("auto", "auto: cuda where torch sees a GPU, else cpu", choices=DEVICES)
    dtype: str = setting(DEFAULT_DTYPE, "auto: bfloat16 on CUDA and where the CPU computes it "
                         "natively (AVX-512 BF16, AMX), else float32", choices=DTYPES)
    # See treadle/model/quantization.py.
    quantization: str = setting("auto", "auto: a GGUF's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K "
                                "matrices served as stored; none: dequantized to --dtype; "
                                "int8/int4: quantized at load", choices=QUANTIZATION_CHOICES)
    load_format: str = setting("auto", "auto: the weights in the model's files; dummy: random "
                               "weights of the shapes its config.json gives (bench/configs/)",
                               choices=LOAD_FORMATS)
    max_model_len: int | None = setting(None, "context length", none="the model's own")
    # Memory for speed where a float GEMM over a dense copy beats dequantizing slices of the
    # weights for each large step. False: the weights' memory is the file's.
    dense_batch_weights: bool = setting(False, "with quantization, also keep each quantized "
                                        "matrix dequantized and prepacked for steps of many "
                                        "rows (more memory, faster large steps)")
    # None: measured per layer shape when the model loads (the crossover depends on the CPU).
    quant_gemv_max_rows: int | None = setting(None, "most rows a step may have for a quantized "
                                              "layer to take the integer kernel",
                                              none="measured at load")
    pooling: str = setting("last", "how /v1/embeddings pools a prompt's final hidden states: "
                           "the last token's (vLLM's default for decoder LLMs) or their mean; "
                           "normalised", choices=POOLING_TYPES)
    # "vllm": the API's own defaults, as vLLM's flag.
    generation_config: str = setting("auto", "sampling defaults for requests that leave them "
                                     "out: auto, the model's generation_config.json "
                                     "(temperature, top_p, top_k, min_p, repetition_penalty); "
                                     "vllm, none; or a folder holding one")
    max_logprobs: int = setting(20, "most logprobs and prompt_logprobs a request may ask for "
                                "per token; more: 400")  # vLLM's default
    # So that requests without a seed of their own sample the same across restarts (given the
    # same batches).
    seed: int | None = setting(None, "seed of the engine's random generator, for requests "
                               "without a seed of their own", none="not seeded")
    enforce_eager: bool = setting(False, "CUDA: run decode steps eagerly, not as captured CUDA "
                                  "graphs")  # vLLM's flag
    # vLLM's flags and defaults (max_lora_rank 16, max_cpu_loras: max_loras' by default there).
    enable_lora: bool = setting(False, "serve LoRA adapters (PEFT folders, GGUF LoRA files) "
                                       "per request")
    max_lora_rank: int = setting(16, "largest LoRA rank an adapter may have")
    lora_dtype: str = setting("auto", "LoRA adapters' weights in memory: auto, bfloat16 "
                              "beside quantized weights (half what a step with many adapters "
                              "reads; its rounding far below the blocks'), else the model's "
                              "dtype", choices=DTYPES)
    max_cpu_loras: int = setting(8, "most LoRA adapters kept loaded in memory (least recently "
                                 "used dropped, reloaded from their folder when asked again)")

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.lora_dtype not in DTYPES:
            raise ValueError(f"lora_dtype must be one of {DTYPES}, got {self.lora_dtype!r}")
        if self.max_lora_rank < 1 or self.max_cpu_loras < 1:
            raise ValueError("max_lora_rank and max_cpu_loras must be >= 1")
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

    block_size: int = setting(16, "token slots per KV cache block")
    num_blocks: int | None = setting(None, "KV cache blocks",
                                     none="as many as --kv-cache-memory-bytes holds")
    # The rule and why: treadle/model/memory.py size_kv_cache.
    kv_cache_memory_bytes: int | None = setting(
        None, "memory of the KV cache: bytes, or 512MiB, 2GiB", none="max_num_seqs requests of "
        "max_model_len, at most half the memory free after the weights")
    gpu_memory_utilization: float = setting(0.9, "CUDA: the share of GPU memory for weights, "
                                            "activations and KV cache; the cache takes what is "
                                            "left")  # vLLM's flag and default
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of prompts' shared "
                                          "prefixes")
    kv_cache_dtype: str = setting("auto", "keys and values stored as: auto, the model's dtype, "
                                  "but bfloat16 for a float32 model on the CPU (half the bytes, "
                                  "as llama.cpp's f16 cache); bfloat16; float32 (a float32 "
                                  "model's only); int8, 8 bits with a float32 scale per token "
                                  "and KV head (a quarter of float32's bytes; CPU only)",
                                  choices=KV_CACHE_DTYPES)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be >= 1 (or None: from free memory)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits (tokens and sequences in one pass, prefill per request and at once), the
    queue time limit, and what every policy shares: the preemption guard, tenants' weights and
    KV caps. A policy's own settings are in its section (`EngineConfig.policies`)."""

    max_num_batched_tokens: int = setting(512, "most tokens in one model pass")
    max_num_seqs: int = setting(128, "most sequences in one model pass")
    # vLLM's default is 1; 4 lets a few tenants' adapters share each step.
    max_loras: int = setting(4, "most distinct LoRA adapters in one model pass (with "
                             "--enable-lora)")
    # So a long prompt cannot starve short ones.
    long_prefill_token_threshold: int = setting(256, "most prompt tokens one request computes "
                                                "in one step")
    # Long prompts cannot hold every prefill slot (vLLM's name).
    max_num_partial_prefills: int = setting(4, "most requests mid-prefill that get a chunk in "
                                            "one step")
    # Then it finishes with finish_reason "queue_timeout".
    max_queue_wait: float | None = setting(
        None, "seconds a request may wait without being scheduled; then it ends with 503 / an "
        "SSE queue_timeout error / gRPC DEADLINE_EXCEEDED", none="no limit",
        flag={"metavar": "SECONDS"})
    # Displacement counts the policy's own (running short of blocks may still preempt a request);
    # fair share's step order, which picks the victims for blocks, counts every preemption.
    max_policy_preemptions: int = setting(2, "times a request may be displaced by a waiting one "
                                          "its policy ranks higher (fair share: also the "
                                          "preemptions of any kind after which an over-share "
                                          "tenant's request goes ahead of its tenant's others "
                                          "in the step order)")
    # Set by --tenant-weight and the API keys' weights (absent: 1).
    tenant_weights: Mapping[str, float] = setting({}, "each tenant's weight, for policies that "
                                                  "share by tenant", flag={"skip": True})
    max_kv_blocks_per_tenant: int | None = setting(
        None, "KV cache blocks one tenant's running requests may hold when another of its "
        "requests is admitted", none="no cap; under --policy fair, its share of the cache while "
        "another tenant is present")

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
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
        if self.max_kv_blocks_per_tenant is not None and self.max_kv_blocks_per_tenant < 1:
            raise ValueError("max_kv_blocks_per_tenant must be >= 1 (or None: the default)")


@dataclass(frozen=True)
class APIKey:
    """A bearer key and its name, the tenant of its requests (treadle/server/auth.py reads
    them)."""

    name: str
    key: str
    weight: float | None = None  # the tenant's fair-share weight (None: not set here)
    # The LoRA adapters the key may use besides the base model; None: every adapter.
    adapters: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ServerConfig:
    """The frontends `treadle serve` runs over one engine: REST always, gRPC only when
    `grpc_port` is set (as vLLM's gRPC server is opt-in)."""

    host: str = setting("127.0.0.1", "address of both frontends")
    port: int = setting(8000, "the REST frontend's port")
    grpc_port: int | None = setting(None, "serve gRPC too, on this port", none="no gRPC")
    served_model_name: tuple[str, ...] = setting(
        (), "the names a request's `model` may be (one or more); the first is the one "
        "responses give", none="the model's own name", flag={"nargs": "+"})
    # Given by --api-key and --api-key-file; empty: no auth.
    api_keys: tuple[APIKey, ...] = setting((), "bearer keys; each key's name is the tenant of "
                                           "its requests", flag={"skip": True})
    metrics_without_auth: bool = setting(False, "serve /metrics without a key, for scrapers "
                                         "that cannot send one")
    allowed_origins: tuple[str, ...] = setting((), "an origin browsers may call from (CORS; "
                                               "repeatable)", flag={"action": "append"})
    max_request_bytes: int = setting(4 << 20, "larger request bodies get 413 (bytes, or 8MiB)")
    enable_debug_endpoints: bool = setting(False, "GET /debug/requests/{id}: a recent request's "
                                           "timeline")
    chat_template: str | None = setting(None, "a Jinja chat template, its text or a file "
                                        "holding it, replacing the model's own (a base model "
                                        "has none)")
    # As vLLM's flag; the parsers: server/openai/tool_parsers.py.
    tool_call_parser: str = setting("hermes", "how the model writes tool calls: hermes "
                                    "(<tool_call> JSON) or llama3_json")
    shutdown_timeout: float = setting(30.0, "on SIGTERM, seconds in-flight requests may take to "
                                      "finish before they end with a server_shutdown error")
    # So that proxies with idle timeouts (nginx's 60 s by default) keep the response open.
    sse_keepalive_interval: float = setting(15.0, "seconds a streamed response may stay silent "
                                            "(queued, or holding text back) before it gets a "
                                            "`: keep-alive` comment")
    uvicorn_log_level: str = setting("info", "uvicorn's log level", choices=UVICORN_LOG_LEVELS)
    disable_uvicorn_access_log: bool = setting(False, "no log line per HTTP request")
    root_path: str = setting("", "the path prefix a proxy serves the API under (ASGI "
                             "root_path)")  # for its docs' links
    ssl_keyfile: str | None = setting(None, "serve REST over HTTPS with this private key (PEM)")
    ssl_certfile: str | None = setting(None, "... and this certificate (PEM)")
    # vLLM's flag: a request's `model` picks one by name.
    lora_modules: tuple[str, ...] = setting((), "LoRA adapters served by name, name=path (a PEFT "
                                            "folder or a GGUF LoRA file; with --enable-lora)",
                                            flag={"nargs": "+"})

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
        for module in self.lora_modules:
            name, _, path = module.partition("=")
            if not name or not path:
                raise ValueError(f"lora_modules must be name=path, got {module!r}")
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

    engine_threads: int | None = setting(None, "torch threads of the engine process; this "
                                         "process keeps to HTTP and tokenizing",
                                         none="one per core", flag={"aliases": ("--threads",)})
    # treadle/core/executor/tensor_parallel.py; whether the model's heads allow it is checked
    # when its config is read, before any worker starts.
    tensor_parallel_size: int = setting(1, "split the model's layers across this many "
                                        "processes (torch.distributed), each on engine_threads "
                                        "/ N threads")

    def __post_init__(self) -> None:
        if self.engine_threads is not None and self.engine_threads < 1:
            raise ValueError(f"engine_threads must be >= 1, got {self.engine_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")


@dataclass(frozen=True)
class RegisteredPolicy:
    """What configuration knows of a queue policy: its part of --policy's help, and its
    settings section (a frozen dataclass of `setting`s; None: it has no settings)."""

    summary: str
    settings: type | None


# Every queue policy by name, in the order registered (treadle/core/sched/policy.py's
# register_policy adds each; the package's own are registered as `treadle` is imported).
POLICIES: dict[str, RegisteredPolicy] = {}


def register_policy(name: str, summary: str, settings: type | None) -> None:
    """Make `name` a valid `policy`, and the fields of `settings` settings of every config built
    from now on. ValueError if the name or one of the settings' names is taken."""
    if name in POLICIES:
        raise ValueError(f"policy {name!r} is already registered")
    taken = setting_fields(ServeConfig)
    clash = [f.name for f in fields(settings) if f.name in taken] if settings else []
    if clash:
        raise ValueError(f"policy {name!r}: a setting named {clash[0]!r} already exists")
    POLICIES[name] = RegisteredPolicy(summary, settings)


def policy_help() -> str:
    return "queue order: " + "; ".join(f"{name} ({p.summary})" if p.summary else name
                                       for name, p in POLICIES.items())


def policy_sections() -> dict[str, Any]:
    """Each registered policy's settings section, at its defaults, by policy name."""
    return {name: p.settings() for name, p in POLICIES.items() if p.settings}


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (treadle/core/spec_decode/): vLLM's `--speculative-config` keys. The
    ngram method proposes the tokens that followed the latest earlier occurrence of the
    sequence's last `prompt_lookup_min`..`prompt_lookup_max` tokens; suffix looks for them in
    the last `suffix_decoding_max_cached_requests` finished requests too; draft_model runs
    `model` (a smaller model sharing the tokenizer, served as `quantization` says)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # most tokens proposed per request and step
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # Steps with more running requests than this propose nothing: their model pass already
    # computes enough rows that extra positions cost time, not just weight reads (vLLM v0's key).
    disable_by_batch_size: int = 4
    suffix_decoding_max_cached_requests: int = 64  # suffix: finished requests looked up
    model: str | None = None  # draft_model: an HF folder or .gguf file
    quantization: str = "auto"  # draft_model: as --quantization says for the target

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {SPECULATIVE_METHODS}, "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size", "suffix_decoding_max_cached_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, "
                                 f"got {value!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: `model` (the draft model) goes with method "
                             "draft_model, and only with it")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config: model must be a path, got {self.model!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"speculative_config: quantization must be one of "
                             f"{QUANTIZATION_CHOICES}, got {self.quantization!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")


def speculative_help() -> str:
    defaults = json.dumps({f.name: f.default for f in fields(SpeculativeConfig)})
    return (f"speculative decoding, as JSON, e.g. {defaults}; keys other than method left out "
            "take those values")


def parse_speculative_config(value: str | Mapping[str, Any]) -> SpeculativeConfig:
    """A SpeculativeConfig from its JSON text or a mapping of its keys; ValueError naming the
    key or the JSON error."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; known: "
                         f"{', '.join(sorted(known))}")
    if "method" not in value:
        raise ValueError("speculative_config: `method` is required (one of "
                         f"{', '.join(SPECULATIVE_METHODS)})")
    return SpeculativeConfig(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine process needs, built once and passed whole."""

    model: ModelConfig = section(ModelConfig, MODEL)
    cache: CacheConfig = section(CacheConfig, CACHE)
    scheduler: SchedulerConfig = section(SchedulerConfig, SCHEDULING)
    parallel: ParallelConfig = section(ParallelConfig, MODEL)
    policy: str = setting("fcfs", policy_help, choices=POLICIES, group=SCHEDULING)
    # Every registered policy's section, not only the chosen one's: a config file may set
    # several, and each is checked.
    policies: Mapping[str, Any] = field(default_factory=policy_sections,
                                        metadata={"title": SCHEDULING, "policies": True})
    trace_file: str | None = setting(None, "write every engine step to this Chrome-trace/"
                                     "Perfetto JSON file", group=OPERATIONS)
    # Given as JSON (flag, environment) or a mapping (LLM, config file); a SpeculativeConfig
    # once built.
    speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = setting(
        None, lambda: speculative_help(), none="off", group=SCHEDULING,
        flag={"metavar": "JSON"})

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {tuple(POLICIES)}, got {self.policy!r}")
        if self.speculative_config is not None and \
                not isinstance(self.speculative_config, SpeculativeConfig):
            object.__setattr__(self, "speculative_config",
                               parse_speculative_config(self.speculative_config))

    @property
    def policy_settings(self) -> Any:
        """The chosen policy's settings section (None: it has none)."""
        return self.policies.get(self.policy)


@dataclass(frozen=True)
class AdmissionConfig:
    """What the frontend checks before a request reaches the engine: queue and tenant limits,
    tenants, cache isolation, default objectives. See treadle/frontend/admission.py."""

    # None: no limit.
    max_queued_requests: int | None = setting(256, "requests waiting for their first token "
                                              "(a batch of prompts is one); past it: 429")
    max_queued_tokens: int | None = setting(None, "prompt tokens waiting for their first "
                                            "token; past it: 429", none="no limit")
    max_requests_per_tenant: int | None = setting(None, "requests in flight per tenant; past "
                                                  "it: 429 tenant_requests", none="no limit")
    max_queued_tokens_per_tenant: int | None = setting(
        None, "prompt tokens waiting for their first token, per tenant; past it: 429 "
        "tenant_queued_tokens", none="no limit")
    # Bounded, as each tenant is a metrics label and an entry in the admission's tables.
    max_tenants: int = setting(1024, "distinct tenants named by clients' `user` fields that "
                               "are tracked; later ones share the tenant 'other'")
    isolate_prefix_cache_by_tenant: bool = setting(
        False, "tenants never share prefix-cache blocks (the cache salt includes the tenant), "
        "so none can probe another's prompts through timing")
    # Milliseconds.
    default_ttft_ms: float | None = setting(None, "TTFT objective of requests that set none")
    default_tpot_ms: float | None = setting(None, "TPOT objective of requests that set none")

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

    # 0: never restart (--no-restart-engine).
    max_engine_restarts: int = setting(5, "restarts of a dead engine in a row (backing off "
                                       "0.5 s, 1 s, 2 s, ...) before the server exits with "
                                       "status 1")
    engine_stall_timeout: float = setting(30.0, "seconds a busy engine may go without "
                                          "finishing a step before /ready and /health turn 503 "
                                          "(status stalled)")

    def __post_init__(self) -> None:
        if self.max_engine_restarts < 0:
            raise ValueError(f"max_engine_restarts must be >= 0, got {self.max_engine_restarts}")
        if not self.engine_stall_timeout > 0:
            raise ValueError(f"engine_stall_timeout must be > 0 seconds, "
                             f"got {self.engine_stall_timeout}")


@dataclass(frozen=True)
class ObservabilityConfig:
    """Metrics labels, request timelines and the request log."""

    log_prompts: bool = setting(False, "include the prompt text in each finished request's log "
                                "line")
    # Of the last finished samples, for /debug/requests.
    max_timelines: int = setting(1000, "finished requests' timelines kept for the debug "
                                 "endpoint")
    max_tenant_labels: int = setting(32, "distinct `tenant` label values in the metrics; later "
                                     "tenants are labelled 'other'")
    otlp_traces_endpoint: str | None = setting(  # vLLM's flag
        None, "send one OpenTelemetry span per request (queue, prefill, decode inside) to this "
        "OTLP endpoint, http://host:4317 (gRPC) or http://host:4318/v1/traces (HTTP); needs "
        "pip install 'treadle[otlp]'", none="no tracing")

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

    data_parallel_size: int = setting(1, "engine replicas, each a Ray actor with its own KV "
                                      "cache and --engine-threads, on the cluster RAY_ADDRESS "
                                      "names or a local one")
    router: str = setting("prefix", "how a request's replica is picked: round-robin; "
                          "least-load (fewest outstanding tokens); prefix (where its first "
                          "blocks were last sent, unless that replica is overloaded)",
                          choices=ROUTER_NAMES)

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.router not in ROUTER_NAMES:
            raise ValueError(f"router must be one of {ROUTER_NAMES}, got {self.router!r}")


@dataclass(frozen=True)
class AsyncEngineConfig:
    """What `AsyncEngine` needs: the engine process's config and the frontend's side of it."""

    engine: EngineConfig = section(EngineConfig)
    admission: AdmissionConfig = section(AdmissionConfig, ADMISSION)
    supervision: SupervisionConfig = section(SupervisionConfig, OPERATIONS)
    observability: ObservabilityConfig = section(ObservabilityConfig, OPERATIONS)
    data_parallel: DataParallelConfig = section(DataParallelConfig, DATA_PARALLEL)


@dataclass(frozen=True)
class ServeConfig:
    """What `treadle serve` runs: one engine and the frontends over it."""

    engine: AsyncEngineConfig = section(AsyncEngineConfig)
    server: ServerConfig = section(ServerConfig, SERVER)


Config = TypeVar("Config")


def is_section(f: Field) -> bool:
    return f.default_factory is not MISSING and is_dataclass(f.default_factory)


def is_policy_sections(f: Field) -> bool:
    return bool(f.metadata.get("policies"))


def grouped_settings(cls: type, title: str | None = None) -> Iterator[tuple[str | None, Field]]:
    """Every flat setting of `cls` and its sections (the registered policies' too), in order,
    with the title of its group in the help."""
    for f in fields(cls):
        if is_section(f):
            yield from grouped_settings(f.default_factory, f.metadata["title"] or title)
        elif is_policy_sections(f):
            for policy in POLICIES.values():
                if policy.settings:
                    yield from grouped_settings(policy.settings, f.metadata["title"])
        else:
            yield f.metadata.get("group") or title, f


def setting_fields(cls: type) -> dict[str, Field]:
    """Every flat setting of `cls` and its sections, by name."""
    return {f.name: f for _, f in grouped_settings(cls)}


def field_default(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default


def policy_setting_fields() -> dict[str, Field]:
    """The registered policies' settings, by name."""
    return {f.name: f for policy in POLICIES.values() if policy.settings
            for f in fields(policy.settings)}


def setting_default(cls: type, name: str) -> Any:
    return field_default(setting_fields(cls)[name])


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
    values: dict[str, Any] = {}
    for f in fields(cls):
        if is_section(f):
            values[f.name] = _build(f.default_factory, settings)
        elif is_policy_sections(f):
            values[f.name] = {name: _build(policy.settings, settings)
                              for name, policy in POLICIES.items() if policy.settings}
        elif f.name in settings:
            values[f.name] = settings[f.name]
    return cls(**values)


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
