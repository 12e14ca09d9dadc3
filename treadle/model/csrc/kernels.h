// The native kernels' entry points, shared by their sources, the fused decoder and the bindings.
// All are built into one library per variant (setup.py, kernels.py): the fused decoder calls the
// others directly.
#pragma once

// ATen's tensor and the two factories the kernels call, not <torch/extension.h>: its
// Python and pybind11 headers are bindings.cpp's alone.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <tuple>
#include <vector>

// elementwise.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps, bool scale_in_float32);
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor silu_and_mul(at::Tensor gate_up);

// Whether a paged cache's layer [blocks, block_size, ...] has each block's slots packed; its
// blocks may lie stride(0) elements apart (on the CPU every layer's block b lies together in
// one mapping: attention.py's KVCache).
inline bool packed_blocks(const at::Tensor& cache) {
  if (cache.dim() < 2) return false;
  int64_t block = 1;  // elements in one block, packed
  for (int64_t d = cache.dim() - 1; d >= 1; --d) {
    if (cache.size(d) != 1 && cache.stride(d) != block) return false;
    block *= cache.size(d);
  }
  return cache.stride(0) >= block;  // blocks never overlap
}

// paged_attention.cpp
// k_scales, v_scales: an int8 cache's float32 scale per slot and KV head; none for a cache in
// q's dtype.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor context_lens,
                                     double scale, int64_t window,
                                     c10::optional<at::Tensor> k_scales,
                                     c10::optional<at::Tensor> v_scales);
// A prefill chunk's causal attention over keys and values contiguous in q's dtype (AVX2 builds).
at::Tensor prefill_attention(at::Tensor q, at::Tensor keys, at::Tensor values, double scale,
                             int64_t window);
bool prefill_attention_available();

// quant_linear.cpp (the K-quants' kernels in quant_kblocks.cpp)
at::Tensor quant_linear(at::Tensor x, at::Tensor weight, int64_t qtype,
                           c10::optional<at::Tensor> bias);
at::Tensor quant_linear_parts(at::Tensor x, const std::vector<at::Tensor>& weights,
                                 const std::vector<int64_t>& qtypes,
                                 c10::optional<at::Tensor> bias);
// quant_gemm.cpp's panels for steps of many rows; the types this build serves so.
at::Tensor quant_gemm_parts(at::Tensor x, const std::vector<at::Tensor>& weights,
                               const std::vector<int64_t>& qtypes,
                               c10::optional<at::Tensor> bias);
std::vector<int64_t> quant_gemm_types();
// The types whose row kernels give the GEMM's bits: a layer of these may take either for any
// number of rows and a row's result stays the same.
std::vector<int64_t> quant_gemm_same_bits_types();
at::Tensor dequantize(at::Tensor weight, int64_t qtype, int64_t k);
at::Tensor dequantize_bf16(at::Tensor weight, int64_t qtype, int64_t k);

// sampling.cpp: one token a row from softmax(logits / temperature) at u ~ U[0, 1) a row.
at::Tensor sample_rows(at::Tensor logits, at::Tensor temperatures, at::Tensor u);

// lora.cpp: y[t] += (x[t] · a[slots[t]]) · b[slots[t]] in place, for rows whose slot is not -1;
// a [slots, in, parts·rank], b [slots, parts·rank, out] block-diagonal by part; offsets: the
// parts' first output columns, then out.
void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const at::Tensor& slots, const std::vector<int64_t>& offsets, int64_t rank);

// decoder.cpp: a Llama-family model's decode steps over GGUF-block projections, one call a step.
class LlamaDecoder {
 public:
  LlamaDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
               double scale);
  // Each projection as its parts (q/k/v, gate/up), each part's blocks and type; row_kernel_rows:
  // per projection (qkv, o, gate_up, down), the most rows a step may have for the row kernels,
  // above which it takes the integer GEMM.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm,
                 std::vector<at::Tensor> qkv, std::vector<int64_t> qkv_types,
                 c10::optional<at::Tensor> qkv_bias, std::vector<at::Tensor> o,
                 std::vector<int64_t> o_types, std::vector<at::Tensor> gate_up,
                 std::vector<int64_t> gate_up_types, std::vector<at::Tensor> down,
                 std::vector<int64_t> down_types, std::vector<int64_t> row_kernel_rows);
  // A layer's LoRA slots, per projection (qkv, o, gate_up, down): lora_add's a, b and offsets.
  // The tensors are shared with model/lora.py, which writes adapters into them in place.
  void set_lora(int64_t layer, std::vector<at::Tensor> a, std::vector<at::Tensor> b,
                std::vector<std::vector<int64_t>> offsets, int64_t rank);
  // hidden [tokens, hidden] (the embeddings; not modified); cos, sin [tokens, head_dim / 2];
  // one key and one value cache a layer, in hidden's dtype or int8 with k_scales and v_scales
  // (one a layer, else empty: attention.py's int8 cache); slots [tokens]; block_tables
  // [tokens, max_blocks]; context_lens [tokens]; lora_slots [tokens]: each row's adapter slot,
  // -1 for the base (none: every row the base's). Returns the residual stream after the last
  // layer.
  at::Tensor forward(at::Tensor hidden, at::Tensor cos, at::Tensor sin,
                        const std::vector<at::Tensor>& k_caches,
                        const std::vector<at::Tensor>& v_caches,
                        const std::vector<at::Tensor>& k_scales,
                        const std::vector<at::Tensor>& v_scales, at::Tensor slots,
                        at::Tensor block_tables, at::Tensor context_lens,
                        c10::optional<at::Tensor> lora_slots) const;

 private:
  struct Lora {
    at::Tensor a, b;
    std::vector<int64_t> offsets;
  };
  struct Layer {
    at::Tensor input_norm, post_norm;
    std::vector<at::Tensor> qkv, o, gate_up, down;
    c10::optional<at::Tensor> qkv_bias;
    std::vector<int64_t> qkv_types, o_types, gate_up_types, down_types;
    std::vector<int64_t> row_kernel_rows;  // qkv, o, gate_up, down
    std::vector<Lora> lora;  // qkv, o, gate_up, down; empty without LoRA
  };
  int64_t num_heads_, num_kv_heads_, head_dim_, lora_rank_ = 0;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

// quant_moe.cpp: a mixture-of-experts feed-forward over GGUF-block experts, one call a layer:
// y[t] = sum over j of weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = chosen[t, j].
class QuantMoE {
 public:
  // Per expert: its gate and up matrices as parts (their rows concatenated: gate, then up),
  // each part's blocks and type; its down matrix and type. Every type must have this build's
  // integer GEMM.
  QuantMoE(std::vector<std::vector<at::Tensor>> gate_up,
           std::vector<std::vector<int64_t>> gate_up_types, std::vector<at::Tensor> down,
           std::vector<int64_t> down_types);
  // x [tokens, hidden]; chosen [tokens, k] int64; weights [tokens, k] float32; *_rows: the most
  // rows of one expert the row kernels take, above which the expert's projection takes the
  // integer GEMM. Returns y in x's dtype and the number of experts the step read.
  std::tuple<at::Tensor, int64_t> forward(at::Tensor x, at::Tensor chosen, at::Tensor weights,
                                          int64_t gate_up_rows, int64_t down_rows) const;

 private:
  struct Projection {
    std::vector<at::Tensor> weights;
    std::vector<int64_t> types;
  };
  struct Expert {
    Projection gate_up, down;
  };
  struct Forms {  // the activation forms a projection's types take: 32-wide, K-quant
    bool q8 = false, q8k = false;
  };
  std::vector<Expert> experts_;
  Forms gate_up_forms_, down_forms_;
  int64_t hidden_ = 0, gate_up_width_ = 0;
};
