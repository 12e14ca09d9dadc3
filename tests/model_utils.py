"""Helpers shared by the model tests: tiny random-weight models of each architecture, saved as
Hugging Face folders by transformers itself, and a greedy decoding loop over the ModelRunner that
hands out blocks trivially (the engine's cache manager is tested on its own)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf.quants import dequantize, quantize

from treadle.config import CacheConfig, ModelConfig, SchedulerConfig
from treadle.model.batch import ModelInput, ScheduledSequence
from treadle.model.capabilities import resolve_device, torch_dtype
from treadle.model.family import ModelSpec
from treadle.model.loader import load_model
from treadle.model.models.llama import GGUF_TENSOR_NAMES
from treadle.model.runner import ModelRunner

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   {"tie_word_embeddings": True}),
    "llama3-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        "rope_theta": 500000.0}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    # Windows smaller than the tests' prompts, local layers around a global one, a local rope
    # base far from the global one, a query scale that is not head_dim's.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, GEMMA3 := {
        "num_hidden_layers": 4, "sliding_window": 9, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}}),
    "gemma3-softcap-untied": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, {
        **GEMMA3, "final_logit_softcapping": 2.0, "tie_word_embeddings": False}),
    # Mixtures of experts: 4 experts, 2 per token; Qwen3-MoE with a dense layer among sparse
    # ones and renormalized top-k; OLMoE without renormalization, q/k norms over all heads.
    "qwen3-moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, {
        "num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
        "sliding_window": None}),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM, {
        "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
        "norm_topk_prob": False}),
}


def build_tiny_model(arch: str, folder: Path, seed: int = 0) -> torch.nn.Module:
    """A random-weight model of `arch` saved to `folder`; every tensor (norms and biases too)
    is random so that a wrong mapping of any one of them shows in the logits."""
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **extra})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def make_runner(model: str | Path | None, dtype: str = "float32", block_size: int = 16,
                num_blocks: int = 512, quantization: str = "none",
                quant_gemv_max_rows: int | None = None, device: str = "auto",
                enforce_eager: bool = False, max_num_seqs: int = 16,
                kv_cache_dtype: str | None = None, enable_lora: bool = False,
                max_loras: int = 4, lora_dtype: str = "auto",
                max_cpu_loras: int = 8) -> ModelRunner:
    """`max_num_seqs`: the largest decode step captured as a CUDA graph, on a GPU.
    `kv_cache_dtype` None: the model's dtype, so that a float32 model's logits are its own
    float32 math (the CPU's default bfloat16 cache is tests/test_kv_int8.py's)."""
    if kv_cache_dtype is None:
        kv_cache_dtype = dtype if dtype in ("float32", "bfloat16") else "auto"
    model_config = ModelConfig(model=None if model is None else str(model), dtype=dtype,
                               quantization=quantization, device=device,
                               quant_gemv_max_rows=quant_gemv_max_rows,
                               enforce_eager=enforce_eager, enable_lora=enable_lora,
                               lora_dtype=lora_dtype, max_cpu_loras=max_cpu_loras)
    cache_config = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                               kv_cache_dtype=kv_cache_dtype)
    device = resolve_device(device)
    loaded = load_model(model_config.model, torch_dtype(dtype, device), quantization,
                        device=device)
    return ModelRunner(loaded, model_config, cache_config,
                       SchedulerConfig(max_num_seqs=max_num_seqs, max_loras=max_loras))


def permute_like_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutes q/k rows so that rope pairs are interleaved."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(model: torch.nn.Module, spec: ModelSpec, path: Path,
                    qtype: gguf.GGMLQuantizationType) -> dict[str, np.ndarray]:
    """`model`'s tensors as llama.cpp writes them (q/k rows permuted, matrices in `qtype`,
    norms in F32; tensors only, no metadata); returns what each should dequantize to."""
    to_gguf = {hf.replace("{}", "{i}"): g.replace("{}", "{i}")
               for g, hf in GGUF_TENSOR_NAMES.items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    expected = {}
    for hf_name, tensor in model.state_dict().items():
        array = tensor.numpy()
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        template = hf_name if layer is None else hf_name.replace(f".{layer}.", ".{i}.", 1)
        gguf_name = to_gguf[template].format(i=layer)
        stored, row_of = array, np.arange(array.shape[0])
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = spec.num_heads if "q_proj" in hf_name else spec.num_kv_heads
            stored = permute_like_llama_cpp(array, heads)
            row_of = permute_like_llama_cpp(row_of, heads)  # stored row r is original row_of[r]
        kind = qtype if array.ndim == 2 else gguf.GGMLQuantizationType.F32  # as llama.cpp
        data = quantize(stored, kind)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
        expected[hf_name] = np.empty_like(array)
        expected[hf_name][row_of] = dequantize(data, kind).reshape(stored.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def greedy_decode(runner: ModelRunner, prompts: list[list[int]], max_tokens: int,
                  chunk_size: int | None = None, together: bool = True) -> list[list[int]]:
    """Greedy tokens for each prompt. `together`: every sequence in the same steps (prefill
    chunks mixed with other sequences' decodes); else one sequence after another.
    `chunk_size`: prefill in pieces of at most that many tokens."""
    if not together:
        return [greedy_decode(runner, [p], max_tokens, chunk_size)[0] for p in prompts]
    bs = runner.block_size
    blocks_per_seq = (max(len(p) for p in prompts) + max_tokens + bs - 1) // bs
    assert blocks_per_seq * len(prompts) <= runner.num_blocks
    # Interleave block ids across sequences so that no table is a contiguous range.
    tables = [list(range(i, blocks_per_seq * len(prompts), len(prompts)))
              for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < max_tokens for o in outputs):
        seqs, owners = [], []
        for i, toks in enumerate(tokens):
            if len(outputs[i]) >= max_tokens:
                continue
            n = len(toks) - computed[i]
            if chunk_size is not None:
                n = min(n, chunk_size)
            seqs.append(ScheduledSequence(toks[computed[i]:computed[i] + n], computed[i],
                                          tables[i]))
            owners.append(i)
        logits = runner.execute(ModelInput(seqs))
        for row, (i, seq) in enumerate(zip(owners, seqs, strict=True)):
            computed[i] += len(seq.token_ids)
            if computed[i] == len(tokens[i]):
                token = int(logits[row].argmax())
                tokens[i].append(token)
                outputs[i].append(token)
    return outputs


def save_random_adapter(base_folder: Path, folder: Path, seed: int, r: int = 4) -> Path:
    """A PEFT LoRA adapter over the model in `base_folder` with random A and B (peft's
    init_lora_weights=False: B not zero, so the adapter changes the logits), saved to `folder`:
    for tests that need a servable adapter, not a trained one."""
    import peft

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"],
                             init_lora_weights=False)
    peft.get_peft_model(base, config).save_pretrained(folder)
    return folder


def preload_adapters(engine, loras) -> None:
    """Each LoRARequest's adapter in an EngineCore's memory before requests come: a cold one
    holds its requests back for the steps its load takes, off the step."""
    for lora in loras:
        while not engine.executor.lora_ready(lora.lora_int_id, lora.lora_path):
            engine.executor.runner.lora.loading[1].result()
