// The native kernels' entry points, shared by their sources, the fused decoder and the bindings.
// All are built into one extension (kernels.py): the fused decoder calls the others directly.
#pragma once

#include <torch/extension.h>

#include <vector>

// elementwise.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool scale_in_float32);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor gate_up);

// paged_attention.cpp
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale, int64_t window);

// quant_linear.cpp (the K-quants' kernels in quant_kblocks.cpp)
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor weight, int64_t qtype,
                           c10::optional<torch::Tensor> bias);
torch::Tensor quant_linear_parts(torch::Tensor x, const std::vector<torch::Tensor>& weights,
                                 const std::vector<int64_t>& qtypes,
                                 c10::optional<torch::Tensor> bias);
torch::Tensor dequantize(torch::Tensor weight, int64_t qtype, int64_t k);
torch::Tensor dequantize_bf16(torch::Tensor weight, int64_t qtype, int64_t k);

// sampling.cpp: one token a row from softmax(logits / temperature) at u ~ U[0, 1) a row.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperatures, torch::Tensor u);

// decoder.cpp: a Llama-family model's decode steps over GGUF-block projections, one call a step.
class LlamaDecoder {
 public:
  LlamaDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
               double scale);
  // Each projection as its parts (q/k/v, gate/up), each part's blocks and type.
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm,
                 std::vector<torch::Tensor> qkv, std::vector<int64_t> qkv_types,
                 c10::optional<torch::Tensor> qkv_bias, std::vector<torch::Tensor> o,
                 std::vector<int64_t> o_types, std::vector<torch::Tensor> gate_up,
                 std::vector<int64_t> gate_up_types, std::vector<torch::Tensor> down,
                 std::vector<int64_t> down_types);
  // hidden [tokens, hidden] (the embeddings; not modified); cos, sin [tokens, head_dim / 2];
  // one key and one value cache a layer; slots [tokens]; block_tables [tokens, max_blocks];
  // context_lens [tokens]. Returns the residual stream after the last layer.
  torch::Tensor forward(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin,
                        const std::vector<torch::Tensor>& k_caches,
                        const std::vector<torch::Tensor>& v_caches, torch::Tensor slots,
                        torch::Tensor block_tables, torch::Tensor context_lens) const;

 private:
  struct Layer {
    torch::Tensor input_norm, post_norm;
    std::vector<torch::Tensor> qkv, o, gate_up, down;
    c10::optional<torch::Tensor> qkv_bias;
    std::vector<int64_t> qkv_types, o_types, gate_up_types, down_types;
  };
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};
