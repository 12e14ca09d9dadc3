"""How much fits: the memory of the weights as served, of the KV cache and of one step's
activations, against the memory this machine has free.

The engine sizes its KV cache here (`size_kv_cache`) and reports the result (`KVCacheSize`) at
ready; `treadle plan` (`plan`) runs the same arithmetic before any weights are loaded.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from treadle.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from treadle.model.family import ModelSpec

# The default KV cache takes at most this share of the memory available once the weights are
# loaded (less a step's activations). Its pages are committed only as blocks fill, so the rest
# stays free for the frontend process, the tokenizer, the model file's page cache and whatever
# else the host runs while the cache fills.
DEFAULT_KV_MEMORY_FRACTION = 0.5


class InsufficientMemoryError(ValueError):
    """The weights, the KV cache and the activations would not fit in the memory available."""


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def available_memory() -> int:
    """Bytes this process may still take: /proc/meminfo's MemAvailable, or less under a cgroup
    (v2) memory limit (a container's)."""
    available = None
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:  # not Linux: what the OS reports as physical memory
        import os

        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        used = int((cgroup / "memory.current").read_text())
    except (OSError, ValueError):
        return available
    return available if limit == "max" else min(available, max(0, int(limit) - used))


KV_SCALE_BYTES = 4  # an int8 KV cache's float32 scale per token slot and KV head, K and V each


KV_ITEMSIZES = {"float32": 4, "bfloat16": 2, "int8": 1}


def kv_bytes_per_token(spec: ModelSpec, kv_cache_dtype: str) -> int:
    """Keys and values of one token over all layers (sliding-window layers keep every block):
    each KV head's vector in the cache's storage as resolved (resolve_kv_cache_dtype: float32,
    bfloat16 or int8), an int8 cache's with its scale."""
    per_head = spec.head_dim * KV_ITEMSIZES[kv_cache_dtype]
    if kv_cache_dtype == "int8":
        per_head += KV_SCALE_BYTES
    return 2 * spec.num_layers * spec.num_kv_heads * per_head


def activation_bytes(spec: ModelSpec, itemsize: int, scheduler: SchedulerConfig,
                     max_model_len: int, native_decode_attention: bool) -> int:
    """An upper estimate of one step's transient memory: the per-token buffers of a full step
    (float32 at worst), float32 logits with the sampler's copy for every row (prompt logprobs
    ask for them all), one prefill chunk's attention over the whole context (keys and values
    repeated per query head, float32 scores), and without the native decode kernel the torch
    path's gather of every decode sequence's blocks padded to the context length."""
    tokens, seqs = scheduler.max_num_batched_tokens, scheduler.max_num_seqs
    chunk = min(tokens, scheduler.long_prefill_token_threshold)
    per_token = (3 * spec.hidden_size + (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
                 + 2 * spec.intermediate_size) * 4
    logits = tokens * spec.vocab_size * 4 * 2
    prefill = (2 * max_model_len * spec.num_heads * spec.head_dim * itemsize
               + chunk * max_model_len * spec.num_heads * 4)
    decode = 0 if native_decode_attention else (
        2 * seqs * max_model_len * spec.num_kv_heads * spec.head_dim * itemsize)
    return tokens * per_token + logits + prefill + decode


@dataclass(frozen=True)
class KVCacheSize:
    """What the KV cache holds: reported at startup (log, EngineReady, GET /v1/models)."""

    block_size: int
    num_blocks: int
    bytes_per_token: int
    max_model_len: int
    dtype: str  # the keys' and values' storage: float32, bfloat16 or int8

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    @property
    def max_concurrency(self) -> float:
        """Requests of the full context (max_model_len tokens) the cache holds at once."""
        return self.tokens / self.max_model_len

    def as_dict(self) -> dict[str, int | float | str]:
        return {**asdict(self), "tokens": self.tokens, "bytes": self.bytes,
                "max_concurrency": round(self.max_concurrency, 2)}

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens = {self.tokens} "
                f"tokens, {self.dtype}, {self.bytes_per_token} bytes/token, "
                f"{gib(self.bytes)}; maximum "
                f"concurrency for {self.max_model_len} tokens per request: "
                f"{self.max_concurrency:.2f}x")


def size_kv_cache(cache: CacheConfig, scheduler: SchedulerConfig, bytes_per_token: int,
                  max_model_len: int, activations: int, available: int, dtype: str
                  ) -> KVCacheSize:
    """The KV cache's blocks, of keys and values stored as `dtype`: `num_blocks` if set, else as
    many as `kv_cache_memory_bytes` holds, else (the default) enough for max_num_seqs requests
    of max_model_len tokens, capped at DEFAULT_KV_MEMORY_FRACTION of the memory `available`
    (measured with the weights loaded) less `activations`. InsufficientMemoryError when the
    cache and the activations would not fit in `available`."""
    block_bytes = bytes_per_token * cache.block_size
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    elif cache.kv_cache_memory_bytes is not None:
        num_blocks = max(1, cache.kv_cache_memory_bytes // block_bytes)
    else:
        needed = scheduler.max_num_seqs * math.ceil(max_model_len / cache.block_size)
        budget = int(DEFAULT_KV_MEMORY_FRACTION * (available - activations))
        num_blocks = min(needed, budget // block_bytes)
        if num_blocks < 1:
            raise InsufficientMemoryError(
                f"no memory left for the KV cache: {gib(available)} available with the weights "
                f"loaded, a step's activations need about {gib(activations)}; free memory, or "
                f"lower max_num_batched_tokens / max_model_len")
    size = KVCacheSize(cache.block_size, num_blocks, bytes_per_token, max_model_len, dtype)
    if size.bytes + activations > available:
        raise InsufficientMemoryError(
            f"a KV cache of {num_blocks} blocks ({gib(size.bytes)}) and a step's activations "
            f"(about {gib(activations)}) do not fit in the {gib(available)} available with "
            f"the weights loaded; lower --num-blocks / --kv-cache-memory-bytes, or leave them "
            f"unset to size the cache from free memory")
    return size


def size_kv_cache_on_gpu(cache: CacheConfig, bytes_per_token: int, max_model_len: int,
                         activations: int, free: int, total: int, dtype: str) -> KVCacheSize:
    """The KV cache's blocks, of keys and values stored as `dtype`, on a GPU whose memory is
    `free` of `total` with the weights loaded: `num_blocks` or `kv_cache_memory_bytes` if set,
    else, as vLLM does, all that `gpu_memory_utilization` of `total` leaves after what is in use
    now (`total - free`: the weights, the CUDA context, other processes) and a step's
    `activations`. Unlike the CPU's default it is not capped by max_num_seqs: on a GPU the
    memory is the engine's, and a larger cache keeps more prefixes. InsufficientMemoryError when
    that leaves no block, or a set size does not fit in what is free."""
    block_bytes = bytes_per_token * cache.block_size
    budget = int(cache.gpu_memory_utilization * total) - (total - free) - activations
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    elif cache.kv_cache_memory_bytes is not None:
        num_blocks = max(1, cache.kv_cache_memory_bytes // block_bytes)
    else:
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise InsufficientMemoryError(
                f"no GPU memory left for the KV cache: {gib(total - free)} of {gib(total)} in "
                f"use with the weights loaded, a step's activations need about "
                f"{gib(activations)}, and --gpu-memory-utilization "
                f"{cache.gpu_memory_utilization} allows {gib(cache.gpu_memory_utilization * total)}"
                f"; raise it, or lower max_num_batched_tokens / max_model_len")
    size = KVCacheSize(cache.block_size, num_blocks, bytes_per_token, max_model_len, dtype)
    if size.bytes + activations > free:
        raise InsufficientMemoryError(
            f"a KV cache of {num_blocks} blocks ({gib(size.bytes)}) and a step's activations "
            f"(about {gib(activations)}) do not fit in the {gib(free)} of GPU memory free with "
            f"the weights loaded; lower --num-blocks / --kv-cache-memory-bytes, or leave them "
            f"unset to size the cache by --gpu-memory-utilization")
    return size


def served_weight_bytes(spec: ModelSpec, itemsize: int, quantization: str,
                        dense_batch_weights: bool, gguf: Path | None) -> int:
    """Bytes of the weights as the engine holds them (`DecoderModel.resident_bytes`), from the
    spec's shapes and, for a GGUF served as stored, its tensors' types: no weights read.
    Quantized matrices count their blocks, plus a dense copy in the served dtype for the LM head
    and the layers with dense_batch_weights; the rest count in the served dtype."""
    from treadle.model.quantization import AT_LOAD, BLOCK_BYTES, BLOCK_WEIGHTS, quantizable

    stored: dict[str, int] = {}  # HF name -> GGUF type kept as blocks
    if quantization == "gguf" and gguf is not None:
        from treadle.model.gguf_file import read_gguf
        from treadle.model.loader import gguf_matrices
        from treadle.model.registry import family_of

        family = family_of(spec)
        for t in read_gguf(gguf).tensors:
            if t.name not in family.gguf_ignored_tensors:
                stored |= {name: int(t.tensor_type) for name, _ in gguf_matrices(t, family)}
    total = 0
    for name, shape in spec.expected_shapes().items():
        numel = math.prod(shape)
        qtype = AT_LOAD.get(quantization, stored.get(name))
        if quantizable(name, shape, qtype):
            total += numel // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]
            is_embedding_only = name == "model.embed_tokens.weight" and not spec.tie_word_embeddings
            if dense_batch_weights and not is_embedding_only:
                total += numel * itemsize
        else:
            total += numel * itemsize
    return total


@dataclass(frozen=True)
class ServedWeights:
    """A model's weights as the engine would serve them, before any is read."""

    name: str
    spec: ModelSpec
    dtype: str  # resolved: float32 or bfloat16
    quantization: str  # resolved: none, gguf, int8, int4
    bytes: int


def served_weights(model: ModelConfig) -> ServedWeights:
    from treadle.model.capabilities import resolve_device, resolve_dtype, torch_dtype
    from treadle.model.loader import read_spec
    from treadle.model.quantization import resolve_quantization
    from treadle.model.source import resolve_model

    source = resolve_model(model.model)
    spec = read_spec(source.folder)
    device = resolve_device(model.device)
    dtype, _ = resolve_dtype(model.dtype, device)
    quantization = resolve_quantization(model.quantization, source.gguf is not None, device)
    return ServedWeights(source.name, spec, dtype, quantization, served_weight_bytes(
        spec, torch_dtype(dtype, device).itemsize, quantization, model.dense_batch_weights,
        source.gguf))


def check_weights_fit(model: ModelConfig) -> None:
    """Before loading (into this host's memory, on any device): InsufficientMemoryError if the
    weights as served exceed the memory
    available, rather than the process being killed while it loads them."""
    weights, available = served_weights(model), available_memory()
    if weights.bytes > available:
        raise InsufficientMemoryError(
            f"the weights of {weights.name} served as {weights.quantization} / {weights.dtype} "
            f"take {gib(weights.bytes)}, more than the {gib(available)} available; try "
            f"--quantization int4 or int8, --no-dense-batch-weights, or a smaller model")


def plan(config: EngineConfig, concurrency: int | None = None) -> dict:
    """`treadle plan`: the memory of `config`'s model served with its settings for
    `concurrency` requests (None: max_num_seqs) of max_model_len tokens, against this machine's
    available memory, and the concurrency that fits in what the weights and a step's
    activations leave."""
    from treadle.model.capabilities import (
        probe,
        resolve_device,
        resolve_kv_cache_dtype,
        torch_dtype,
    )

    weights = served_weights(config.model)
    spec, itemsize = weights.spec, torch_dtype(weights.dtype).itemsize
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, weights.dtype,
                                      resolve_device(config.model.device))
    context = min(config.model.max_model_len or spec.context_limit, spec.context_limit)
    concurrency = concurrency or config.scheduler.max_num_seqs
    activations = activation_bytes(spec, itemsize, config.scheduler, context,
                                   probe().native_kernels_allowed)
    block_size = config.cache.block_size
    blocks_per_request = math.ceil(context / block_size)
    kv = KVCacheSize(block_size, concurrency * blocks_per_request,
                     kv_bytes_per_token(spec, kv_dtype), context, kv_dtype)
    request_bytes = blocks_per_request * block_size * kv.bytes_per_token
    available = available_memory()
    total = weights.bytes + activations + kv.bytes
    return {"model": weights.name, "dtype": weights.dtype, "quantization": weights.quantization,
            "parameters": spec.num_parameters(), "active_parameters": spec.active_parameters(),
            "max_model_len": context, "concurrency": concurrency, "weights_bytes": weights.bytes,
            "activations_bytes": activations, "kv_cache": kv.as_dict(), "total_bytes": total,
            "available_bytes": available, "fits": total <= available,
            "max_concurrency_that_fits": max(0, (available - weights.bytes - activations)
                                             // request_bytes)}


def format_plan(report: dict) -> str:
    kv = report["kv_cache"]
    verdict = "fits" if report["fits"] else "does NOT fit"
    return "\n".join([
        f"{report['model']}: dtype {report['dtype']}, quantization {report['quantization']}, "
        f"max_model_len {report['max_model_len']}",
        f"parameters   {report['parameters'] / 1e9:>10.2f} B"
        + (f"  ({report['active_parameters'] / 1e9:.2f} B active per token)"
           if report["active_parameters"] != report["parameters"] else ""),
        f"weights      {gib(report['weights_bytes']):>12}",
        f"activations  {gib(report['activations_bytes']):>12}  (one step, upper estimate)",
        f"KV cache     {gib(kv['bytes']):>12}  ({report['concurrency']} x "
        f"{report['max_model_len']} tokens: {kv['num_blocks']} blocks of {kv['block_size']}, "
        f"{kv['dtype']}, {kv['bytes_per_token']} bytes/token)",
        f"total        {gib(report['total_bytes']):>12}  {verdict} in "
        f"{gib(report['available_bytes'])} available (MemAvailable)",
        f"concurrency that fits at {report['max_model_len']} tokens per request: "
        f"{report['max_concurrency_that_fits']}",
    ])
