"""ModelRunner: turns a step's batch description into tensors, runs the model, returns logits
(and, for the sequences that ask, final hidden states to pool into embeddings).

It knows sequences only as token ids, a count of tokens already cached and a block table; it knows
nothing of requests, sampling or where a request came from.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from treadle.config import CacheConfig, ModelConfig, SchedulerConfig
from treadle.model.attention import AttentionMetadata, KVCache, PrefillChunk
from treadle.model.batch import ModelInput, ModelOutput, ScheduledSequence
from treadle.model.capabilities import (
    probe,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    torch_dtype,
    use_onednn_linear,
)
from treadle.model.cuda_graphs import capture_decode_graphs, graph_output_bytes
from treadle.model.kernels import paged_decode_attention, quant_linear_kernels
from treadle.model.linear import tune_gemv_rows
from treadle.model.loader import LoadedModel, load_model
from treadle.model.lora import LoraSlots
from treadle.model.memory import (
    activation_bytes,
    available_memory,
    kv_bytes_per_token,
    size_kv_cache,
    size_kv_cache_on_gpu,
)
from treadle.model.registry import build_model


class ModelRunner:
    def __init__(self, loaded: LoadedModel, model_config: ModelConfig,
                 cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig | None = None,
                 verify_rows: int = 1) -> None:
        """`scheduler_config` (None: the defaults): the step sizes the KV cache's default size
        and the activation estimate follow (treadle/model/memory.py). `verify_rows`: the rows
        of a step verifying one sequence's proposed tokens (speculative decoding), which stay on
        the row kernels of a layer whose integer GEMM rounds otherwise (choose_gemv_rows)."""
        scheduler_config = scheduler_config or SchedulerConfig()
        spec = loaded.spec
        self.spec = spec
        self.device = torch.device(resolve_device(model_config.device))
        device = self.device.type
        self.dtype_name, self.dtype_reason = resolve_dtype(model_config.dtype, device)
        self.dtype = torch_dtype(self.dtype_name, device)
        limit = spec.context_limit
        self.max_model_len = min(model_config.max_model_len or limit, limit)
        self.block_size = cache_config.block_size
        # Refused before the weights load where the device cannot serve it.
        self.kv_cache_dtype = resolve_kv_cache_dtype(cache_config.kv_cache_dtype,
                                                     self.dtype_name, device)
        # On CUDA the weights are plain tensors (resolve_quantization) moved there, and what the
        # model builds (rope tables, scales) is built there.
        weights = loaded.weights if device == "cpu" else {
            name: w.to(self.device) for name, w in loaded.weights.items()}
        with self.device:
            self.model = build_model(spec, weights, self.dtype, self.max_model_len,
                                     dense_for_batches=model_config.dense_batch_weights)
        del weights  # on CUDA, q/k/v and gate/up now live fused: free the separate copies
        # Sliding-window layers' windows: each gets its own attention metadata per step.
        self.windows = sorted({w for w in spec.layer_windows() if w is not None})
        self.quantization, self.quantized_types = loaded.quantization, loaded.quantized_types()
        self.gemv_rows = self.choose_gemv_rows(model_config.quant_gemv_max_rows, verify_rows)
        # After the gemv tuning, which times the bare layers.
        lora_dtype = (getattr(torch, model_config.lora_dtype) if model_config.lora_dtype != "auto"
                      else torch.bfloat16 if self.quantized_types else self.dtype)
        self.lora = (LoraSlots(spec, self.model.layers, scheduler_config.max_loras,
                               model_config.max_lora_rank, model_config.max_cpu_loras, lora_dtype)
                     if model_config.enable_lora else None)
        self.model.lora = None if self.lora is None else self.lora.batch
        # Built (or imported) now, not in a step.
        native_decode = paged_decode_attention(device) is not None
        # Sized after the model is built: what is available then excludes the weights, their
        # dense copies and prepacked forms.
        per_token = kv_bytes_per_token(spec, self.kv_cache_dtype)
        activations = activation_bytes(spec, self.dtype.itemsize, scheduler_config,
                                       self.max_model_len, native_decode)
        capture = device == "cuda" and native_decode and not model_config.enforce_eager
        if capture:  # the graphs' outputs stay allocated
            activations += graph_output_bytes(scheduler_config.max_num_seqs, spec.vocab_size)
        if device == "cuda":
            torch.cuda.empty_cache()  # what the build freed counts as free
            free, total = torch.cuda.mem_get_info(self.device)
            self.kv_size = size_kv_cache_on_gpu(cache_config, per_token, self.max_model_len,
                                                activations, free, total, self.kv_cache_dtype)
        else:
            self.kv_size = size_kv_cache(cache_config, scheduler_config, per_token,
                                         self.max_model_len, activations, available_memory(),
                                         self.kv_cache_dtype)
        self.kv_cache = KVCache(spec.num_layers, self.kv_size.num_blocks, self.block_size,
                                spec.num_kv_heads, spec.head_dim, self.kv_storage_dtype(),
                                self.device)
        # On the CPU, a chunk's gather into new memory at every layer cost more than its
        # attention (16 tokens over 3,000: docs/decisions.md); CUDA's allocator caches.
        self.gather_buffers = None
        if self.device.type == "cpu" and self.kv_cache.dtype != torch.int8:
            shape = (-(-self.max_model_len // self.block_size), *self.kv_cache.keys[0].shape[1:])
            self.gather_buffers = (torch.empty(shape, dtype=self.kv_cache.dtype),
                                   torch.empty(shape, dtype=self.kv_cache.dtype))
        # Only over the Triton kernel (`capture`): the torch path would gather every row's
        # blocks to the static tables' full width, max_model_len, at every step.
        self.decode_graphs = (capture_decode_graphs(self, scheduler_config.max_num_seqs)
                              if capture else None)

    def kv_storage_dtype(self) -> torch.dtype:
        """The KV cache tensors' dtype: int8 (scaled), bfloat16 or float32."""
        return getattr(torch, self.kv_cache_dtype)

    @classmethod
    def from_config(cls, model_config: ModelConfig, cache_config: CacheConfig) -> ModelRunner:
        device = resolve_device(model_config.device)
        loaded = load_model(model_config.model, torch_dtype(model_config.dtype, device),
                            model_config.quantization, device=device,
                            load_format=model_config.load_format)
        return cls(loaded, model_config, cache_config)

    def choose_gemv_rows(self, fixed: int | None, verify_rows: int) -> dict[str, int]:
        """Up to how many rows each quantized layer shape takes the row kernels: `fixed`, else
        measured, and at least `verify_rows` where the batch path rounds otherwise than the row
        kernels (the K-quants' GEMM, Q8_0 without VNNI, the float paths): greedy decoding with
        speculation gives the tokens it gives without only while a verifying step's rows get
        the bits they would get alone."""
        layers = self.model.quantized_layers()
        if fixed is None:
            tune_gemv_rows(layers, self.dtype)
        for layer in layers:
            if fixed is not None:
                layer.max_gemv_rows = fixed
            if not layer.gemm_same_bits:
                layer.max_gemv_rows = max(layer.max_gemv_rows, verify_rows)
        return {layer.shape_name: layer.max_gemv_rows for layer in layers
                if layer.kernels is not None}

    def platform_info(self) -> dict:
        """The dtype served and why, and which fast paths run: for logs, /v1/models, benches."""
        caps = probe()
        device = self.device.type
        info = {"device": (torch.cuda.get_device_name(self.device) if device == "cuda"
                           else "cpu")}
        if self.decode_graphs is not None:
            info["cuda_graphs"] = (f"{len(self.decode_graphs.sizes)} batch sizes up to "
                                   f"{self.decode_graphs.sizes[-1]}, captured in "
                                   f"{self.decode_graphs.capture_seconds:.1f} s")
        return {**info, "dtype": self.dtype_name, "dtype_reason": self.dtype_reason,
                "kv_cache_dtype": self.kv_cache_dtype,
                "isa": caps.isa,
                "onednn_linear": device == "cpu" and use_onednn_linear(self.dtype),
                "native_attention": paged_decode_attention(device) is not None,
                "quantization": self.quantization,
                "quantized_types": ", ".join(f"{n} {t}" for t, n in self.quantized_types.items())
                or "none", "quant_kernels": device == "cpu" and quant_linear_kernels() is not None,
                "gemv_rows": ", ".join(f"{k}: {v}" for k, v in self.gemv_rows.items()) or "none"}

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def execute(self, model_input: ModelInput) -> torch.Tensor:
        """The logits of `run` alone, for a batch of generating sequences."""
        return self.run(model_input).logits

    @torch.inference_mode()
    def run(self, model_input: ModelInput) -> ModelOutput:
        """One model pass; the final norm and the LM head run only on the rows asked for, so
        generating sequences pay nothing for pooling ones and pooling ones skip the LM head."""
        if self.lora is not None:
            self.lora.set_rows([None if s.lora_id is None else (s.lora_id, s.lora_path)
                                for s in model_input.sequences for _ in s.token_ids],
                               self.device)
        if (self.decode_graphs is not None and not self.model.lora_in_step()
                and self.decode_graphs.serves(model_input)):
            for seq in model_input.sequences:
                self.check(seq)
            return ModelOutput(self.decode_graphs.run(model_input))
        input_ids, positions, attention, logits_indices, hidden_indices = \
            self.prepare(model_input)
        model = self.model
        hidden = model.hidden_states(input_ids, positions, attention, self.kv_cache)
        rows = hidden if logits_indices is None else hidden[logits_indices]
        logits = (model.logits(model.final_hidden(rows)) if rows.shape[0]
                  else torch.empty(0, self.spec.vocab_size, device=self.device))
        pooled = (None if hidden_indices is None
                  else model.final_hidden(hidden[hidden_indices]).float())
        return ModelOutput(logits, pooled, self.take_experts_read())

    def take_experts_read(self) -> int:
        """The experts the layers ran since the last call (the count starts again)."""
        total = 0
        for moe in self.model.expert_layers():
            total += moe.experts_run
            moe.experts_run = 0
        return total

    def prepare(self, model_input: ModelInput) -> tuple[
            torch.Tensor, torch.Tensor, dict[int | None, AttentionMetadata], torch.Tensor | None,
            torch.Tensor | None]:
        """Input ids, positions, attention metadata by window (None: global layers), the rows
        to compute logits at (None: all) and those to return hidden states at (None: none)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        hidden_rows: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        windowed_prefills: dict[int, list[PrefillChunk]] = {w: [] for w in self.windows}
        for seq in model_input.sequences:
            self.check(seq)
            start, n = seq.num_computed_tokens, len(seq.token_ids)
            context_len = start + n
            row = len(input_ids)
            input_ids.extend(seq.token_ids)
            table = seq.block_table
            for pos in range(start, context_len):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            if seq.num_hidden_rows is not None:
                hidden_rows.extend(range(row + n - seq.num_hidden_rows, row + n))
            elif seq.all_logits:
                logits_rows.extend(range(row, row + n))
            else:
                logits_rows.append(row + n - 1)
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(table[:(context_len + bs - 1) // bs])
                decode_lens.append(context_len)
            elif seq.decode_rows:  # every token's KV is written before any attention reads
                for i in range(n):
                    decode_rows.append(row + i)
                    decode_tables.append(table[:(start + i + bs) // bs])
                    decode_lens.append(start + i + 1)
            else:
                prefills.append(self.prefill_chunk(row, start, n, table))
                for window, chunks in windowed_prefills.items():
                    chunks.append(self.prefill_chunk(row, start, n, table, window))

        num_tokens = len(input_ids)
        meta = AttentionMetadata(
            slot_mapping=self.index_tensor(slots),
            decode_indices=None, decode_block_tables=None, decode_context_lens=None,
            prefills=prefills, max_context_len=self.max_model_len,
            gather_buffers=self.gather_buffers)
        if decode_rows:
            max_blocks = max(len(t) for t in decode_tables)
            meta.decode_block_tables = self.index_tensor(
                [t + [0] * (max_blocks - len(t)) for t in decode_tables])
            meta.decode_context_lens = self.index_tensor(decode_lens)
            if len(decode_rows) < num_tokens:
                meta.decode_indices = self.index_tensor(decode_rows)
        logits_indices = (None if len(logits_rows) == num_tokens
                          else self.index_tensor(logits_rows))
        attention: dict[int | None, AttentionMetadata] = {None: meta}
        for window, chunks in windowed_prefills.items():
            attention[window] = replace(meta, prefills=chunks, window=window)
        hidden_indices = self.index_tensor(hidden_rows) if hidden_rows else None
        return (self.index_tensor(input_ids), self.index_tensor(positions), attention,
                logits_indices, hidden_indices)

    def index_tensor(self, values: list) -> torch.Tensor:
        """A long tensor of `values` on the model's device."""
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def check(self, seq: ScheduledSequence) -> None:
        """ValueError for a sequence the cache or the context length cannot hold."""
        context_len = seq.num_computed_tokens + len(seq.token_ids)
        if context_len > self.max_model_len:
            raise ValueError(f"sequence of {context_len} tokens exceeds max_model_len "
                             f"{self.max_model_len}")
        if len(seq.block_table) * self.block_size < context_len:
            raise ValueError(f"block table of {len(seq.block_table)} blocks cannot hold "
                             f"{context_len} tokens")

    def prefill_chunk(self, row: int, start: int, n: int, table: list[int],
                      window: int | None = None) -> PrefillChunk:
        """Tokens start .. start + n of a sequence. Query i sits at position start + i and sees
        keys 0 .. start + i, or with a window only the last `window` of them: the chunk's block
        table then starts at the block holding the first key any of its queries sees."""
        bs = self.block_size
        context_len = start + n
        first_block = 0 if window is None else max(0, start - window + 1) // bs
        key_start = first_block * bs
        mask = None
        if start > 0 or (window is not None and n > window):
            keys = torch.arange(key_start, context_len, device=self.device)[None, :]
            queries = torch.arange(start, context_len, device=self.device)[:, None]
            mask = keys <= queries
            if window is not None:
                mask &= keys > queries - window
        blocks = table[first_block:(context_len + bs - 1) // bs]
        return PrefillChunk(start=row, end=row + n, context_len=context_len,
                            block_table=self.index_tensor(blocks), mask=mask,
                            key_start=key_start)
