"""A GGUF of random bfloat16 weights in the shape a Llama-family or Qwen3-MoE config.json gives
(bench/configs/), with the default model's tokenizer: what llama.cpp's `llama-quantize` turns
into a Q4_K_M file for side-by-side runs of Treadle and llama.cpp's server at sizes nobody can
download here.

    python bench/random_gguf.py bench/configs/llama-3.1-8b llama8b-bf16.gguf
    llama-quantize llama8b-bf16.gguf llama8b-q4km.gguf Q4_K_M

Tensors are written one at a time: an 8B shape needs its 15 GB of disk, not of memory. Where
the bfloat16 file would not fit the disk (Qwen3-30B-A3B's is 61 GB), `--q4-k-m` writes random
blocks of Q4_K_M's types directly.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch

from treadle.model.source import default_model_path

INIT_STD = 0.02  # Hugging Face's initializer_range for Llama
Q = gguf.GGMLQuantizationType
# --q4-k-m: each type's fp16 scale fields (byte offset, value) in a block of random bytes, the
# weights then within about +-0.06: Q4_K's d and dmin, Q6_K's d.
SCALE_FIELDS = {Q.Q4_K: ((0, 6.1e-5), (2, 6.1e-5)), Q.Q6_K: ((208, 7.4e-6),)}
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen3_moe": "qwen3moe"}  # -> GGUF's


def rope_settings(config: dict) -> dict:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def rope_theta(config: dict) -> float:
    return rope_settings(config).get("rope_theta", config.get("rope_theta", 10000.0))


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def rope_freqs(config: dict) -> np.ndarray | None:
    """llama3 rope scaling's per-frequency factors, as llama.cpp's converter stores them; None
    for unscaled rope. Other scalings are refused: the file would not say them."""
    rope = rope_settings(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise SystemExit(f"rope_type {kind!r}: only unscaled and llama3 rope are written")
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    dim = head_dim(config)
    factors = []
    for freq in 1.0 / rope_theta(config) ** (np.arange(0, dim, 2, dtype=np.float64) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def tensor_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Each tensor's name and shape (numpy's order); a mixture of experts' router
    (`ffn_gate_inp`) and experts stacked per matrix as llama.cpp's converter writes them."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = head_dim(config)
    experts = config.get("num_experts", 0)
    shapes = [("token_embd.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        shapes += [(f"blk.{i}.attn_norm.weight", (hidden,)),
                   (f"blk.{i}.attn_q.weight", (heads * dim, hidden)),
                   (f"blk.{i}.attn_k.weight", (kv_heads * dim, hidden)),
                   (f"blk.{i}.attn_v.weight", (kv_heads * dim, hidden)),
                   (f"blk.{i}.attn_output.weight", (hidden, heads * dim)),
                   (f"blk.{i}.ffn_norm.weight", (hidden,))]
        if experts:
            width = config["moe_intermediate_size"]
            shapes += [(f"blk.{i}.attn_q_norm.weight", (dim,)),
                       (f"blk.{i}.attn_k_norm.weight", (dim,)),
                       (f"blk.{i}.ffn_gate_inp.weight", (experts, hidden)),
                       (f"blk.{i}.ffn_gate_exps.weight", (experts, width, hidden)),
                       (f"blk.{i}.ffn_up_exps.weight", (experts, width, hidden)),
                       (f"blk.{i}.ffn_down_exps.weight", (experts, hidden, width))]
        else:
            shapes += [(f"blk.{i}.ffn_gate.weight", (inter, hidden)),
                       (f"blk.{i}.ffn_up.weight", (inter, hidden)),
                       (f"blk.{i}.ffn_down.weight", (hidden, inter))]
    shapes.append(("output_norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        shapes.append(("output.weight", (config["vocab_size"], hidden)))
    return shapes


def q4_k_m_type(name: str, layers: int) -> gguf.GGMLQuantizationType:
    """llama.cpp's Q4_K_M type for a matrix: Q6_K for the output, and for attn_v and ffn_down in
    the layers its use_more_bits picks (the first and last eighth, every third between); Q4_K
    elsewhere."""
    if name == "output.weight":
        return Q.Q6_K
    if ".attn_v." in name or ".ffn_down" in name:
        i, eighth = int(name.split(".")[1]), layers // 8
        if i < eighth or i >= 7 * layers // 8 or (i - eighth) % 3 == 2:
            return Q.Q6_K
    return Q.Q4_K


def random_blocks(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType,
                  rng: np.random.Generator) -> np.ndarray:
    """Random bytes in `qtype`'s blocks along the last dimension, the scales set."""
    weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // weights, block_bytes),
                          dtype=np.uint8)
    for offset, value in SCALE_FIELDS[qtype]:
        blocks[..., offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def write_random_gguf(config_folder: Path, out: Path, seed: int = 0, q4_k_m: bool = False
                      ) -> None:
    config = json.loads((config_folder / "config.json").read_text())
    architecture = ARCHITECTURES.get(config.get("model_type"))
    if architecture is None:
        raise SystemExit(f"{config.get('model_type')!r}: only {', '.join(ARCHITECTURES)} "
                         "shapes are written")
    tokenizer = gguf.GGUFReader(str(default_model_path()))
    tokens = tokenizer.fields["tokenizer.ggml.tokens"]
    if len(tokens.data) != config["vocab_size"]:
        raise SystemExit(f"vocab_size {config['vocab_size']} is not the default tokenizer's "
                         f"{len(tokens.data)}")
    factors = rope_freqs(config)
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_name(f"random {config_folder.name}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_rope_dimension_count(head_dim(config))
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("num_experts"):
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if q4_k_m
                         else gguf.LlamaFileType.MOSTLY_BF16)
    for key, field in tokenizer.fields.items():
        if key.startswith("tokenizer."):
            kinds = field.types
            writer.add_key_value(key, field.contents(), kinds[0],
                                 sub_type=kinds[-1] if kinds[0] == gguf.GGUFValueType.ARRAY
                                 else None)
    shapes = tensor_shapes(config)
    if factors is not None:
        writer.add_tensor_info("rope_freqs.weight", factors.shape, factors.dtype, factors.nbytes)
    for name, shape in shapes:
        if len(shape) == 1 or name.endswith("ffn_gate_inp.weight"):  # float32, as converted
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * math.prod(shape))
        elif q4_k_m:
            qtype = q4_k_m_type(name, config["num_hidden_layers"])
            weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // weights * block_bytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape),
                                   raw_dtype=qtype)
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.uint16), 2 * math.prod(shape),
                                   raw_dtype=Q.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if factors is not None:
        writer.write_tensor_data(factors)
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    for name, shape in shapes:
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
        elif name.endswith("ffn_gate_inp.weight"):
            writer.write_tensor_data(torch.empty(shape).normal_(0, INIT_STD, generator=generator)
                                     .numpy())
        elif q4_k_m:
            writer.write_tensor_data(random_blocks(shape, q4_k_m_type(
                name, config["num_hidden_layers"]), rng))
        else:
            weights = torch.empty(shape, dtype=torch.bfloat16).normal_(0, INIT_STD,
                                                                       generator=generator)
            writer.write_tensor_data(weights.view(torch.int16).numpy().view(np.uint16))
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config_folder", type=Path, help="a folder with a config.json")
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--q4-k-m", action="store_true",
                        help="random blocks of Q4_K_M's types instead of bfloat16 weights")
    args = parser.parse_args()
    write_random_gguf(args.config_folder, args.out, args.seed, args.q4_k_m)


if __name__ == "__main__":
    main()
