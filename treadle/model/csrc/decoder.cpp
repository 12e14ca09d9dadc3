// A Llama-family model's decode steps when every projection is in GGUF blocks and takes the
// integer kernels (row kernels or GEMM): one call runs all layers (norms, projections, rope,
// cache writes, attention, residual adds) instead of some 15 torch ops a layer dispatched from
// Python, whose overhead
// (~5 us each) was a quarter of a one-token step (Zen 3, 2 threads: ~2.3 of ~9 ms). The same
// kernels run in the same order as in the Python path, so both give the same bits.
#include "kernels.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

LlamaDecoder::LlamaDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                           double scale)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
      scale_(scale) {}

void LlamaDecoder::add_layer(at::Tensor input_norm, at::Tensor post_norm,
                             std::vector<at::Tensor> qkv, std::vector<int64_t> qkv_types,
                             c10::optional<at::Tensor> qkv_bias, std::vector<at::Tensor> o,
                             std::vector<int64_t> o_types, std::vector<at::Tensor> gate_up,
                             std::vector<int64_t> gate_up_types, std::vector<at::Tensor> down,
                             std::vector<int64_t> down_types,
                             std::vector<int64_t> row_kernel_rows) {
  TORCH_CHECK(row_kernel_rows.size() == 4, "add_layer: row_kernel_rows a projection");
  layers_.push_back({input_norm, post_norm, qkv, o, gate_up, down, qkv_bias, qkv_types, o_types,
                     gate_up_types, down_types, row_kernel_rows, {}});
}

void LlamaDecoder::set_lora(int64_t layer, std::vector<at::Tensor> a, std::vector<at::Tensor> b,
                            std::vector<std::vector<int64_t>> offsets, int64_t rank) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && a.size() == 4 &&
              b.size() == 4 && offsets.size() == 4, "set_lora: one a, b, offsets a projection");
  std::vector<Lora> lora;
  for (size_t i = 0; i < 4; ++i) lora.push_back({a[i], b[i], offsets[i]});
  layers_[layer].lora = std::move(lora);
  lora_rank_ = rank;
}

namespace {

// Where slot `slot` of a cache [blocks, block_size, ...] (blocks packed, stride(0) apart)
// starts, in elements, `width` of them a slot.
int64_t checked_slot(const at::Tensor& cache, int64_t slot, int64_t width) {
  TORCH_CHECK(slot >= 0 && slot < cache.size(0) * cache.size(1), "slot ", slot, " out of range");
  return slot / cache.size(1) * cache.stride(0) + slot % cache.size(1) * width;
}

// Rows [tokens, width] at `src` (rows `src_stride` elements apart) into the cache's slots.
void write_slots(const at::Tensor& cache, const char* src, int64_t src_stride,
                 const int64_t* slots, int64_t tokens, int64_t width) {
  const int64_t item = cache.element_size();
  char* dst = static_cast<char*>(cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(dst + checked_slot(cache, slots[t], width) * item, src + t * src_stride * item,
                width * item);
  }
}

// The same float32 rows into a bfloat16 cache, rounded to nearest even as torch's conversion.
void write_slots_bf16(const at::Tensor& cache, const float* src, int64_t src_stride,
                      const int64_t* slots, int64_t tokens, int64_t width) {
  at::BFloat16* dst = cache.data_ptr<at::BFloat16>();
  for (int64_t t = 0; t < tokens; ++t) {
    at::BFloat16* row = dst + checked_slot(cache, slots[t], width);
    for (int64_t i = 0; i < width; ++i) row[i] = src[t * src_stride + i];
  }
}

// The same rows into an int8 cache: each head's vector over its absmax / 127, rounded half to
// even, and its scale beside it; attention.py's quantize_kv in the same float32 operations, so
// the same bytes.
template <typename T>
void write_slots_int8(const at::Tensor& cache, const at::Tensor& scales, const T* src,
                      int64_t src_stride, const int64_t* slots, int64_t tokens,
                      int64_t kv_heads, int64_t dim) {
  int8_t* dst = cache.data_ptr<int8_t>();
  float* dst_scales = scales.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    int8_t* row = dst + checked_slot(cache, slots[t], kv_heads * dim);
    float* row_scales = dst_scales + checked_slot(scales, slots[t], kv_heads);
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T* x = src + t * src_stride + h * dim;
      float amax = 0.f;
      for (int64_t d = 0; d < dim; ++d) {  // a NaN propagates, as torch's amax
        const float a = std::abs(static_cast<float>(x[d]));
        amax = a > amax || std::isnan(a) ? a : amax;
      }
      const float scale = amax / 127.f, divisor = std::max(scale, FLT_MIN);
      int8_t* q = row + h * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const float v = std::nearbyint(static_cast<float>(x[d]) / divisor);
        q[d] = std::isnan(v) ? 0 : static_cast<int8_t>(std::clamp(v, -127.f, 127.f));
      }
      row_scales[h] = scale;
    }
  }
}

// Rows [tokens, kv_heads * dim] at `src` (rows `src_stride` elements apart) into the cache's
// slots, in its dtype: the rows' own, bfloat16 under float32 rows, or int8 (`scales` given).
void write_kv(const at::Tensor& cache, const at::Tensor* scales, const at::Tensor& rows,
              const char* src, int64_t src_stride, const int64_t* slots, int64_t tokens,
              int64_t kv_heads, int64_t dim) {
  if (scales == nullptr && cache.scalar_type() == rows.scalar_type()) {
    return write_slots(cache, src, src_stride, slots, tokens, kv_heads * dim);
  }
  if (scales == nullptr) {
    TORCH_CHECK(cache.scalar_type() == at::kBFloat16 && rows.scalar_type() == at::kFloat,
                "a cache in the rows' dtype, or bfloat16 under float32 rows");
    return write_slots_bf16(cache, reinterpret_cast<const float*>(src), src_stride, slots,
                            tokens, kv_heads * dim);
  }
  TORCH_CHECK(rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16,
              "an int8 cache's rows: float32 or bfloat16");
  if (rows.scalar_type() == at::kBFloat16) {
    return write_slots_int8(cache, *scales, reinterpret_cast<const at::BFloat16*>(src),
                            src_stride, slots, tokens, kv_heads, dim);
  }
  write_slots_int8(cache, *scales, reinterpret_cast<const float*>(src), src_stride, slots, tokens,
                   kv_heads, dim);
}

}  // namespace

at::Tensor LlamaDecoder::forward(at::Tensor hidden, at::Tensor cos, at::Tensor sin,
                                    const std::vector<at::Tensor>& k_caches,
                                    const std::vector<at::Tensor>& v_caches,
                                    const std::vector<at::Tensor>& k_scales,
                                    const std::vector<at::Tensor>& v_scales,
                                    at::Tensor slots, at::Tensor block_tables,
                                    at::Tensor context_lens,
                                    c10::optional<at::Tensor> lora_slots) const {
  const int64_t layers = static_cast<int64_t>(layers_.size());
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers &&
              static_cast<int64_t>(v_caches.size()) == layers, "one cache per layer");
  const bool int8_cache = !k_scales.empty();
  TORCH_CHECK(!int8_cache || (static_cast<int64_t>(k_scales.size()) == layers &&
                              static_cast<int64_t>(v_scales.size()) == layers),
              "an int8 cache's scales: one a layer");
  TORCH_CHECK(hidden.dim() == 2 && slots.scalar_type() == at::kLong &&
              slots.numel() == hidden.size(0));
  const int64_t tokens = hidden.size(0), heads = num_heads_, kv_heads = num_kv_heads_,
                dim = head_dim_;
  const int64_t qk_width = (heads + kv_heads) * dim, kv_width = kv_heads * dim;
  slots = slots.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  hidden = hidden.clone();  // the residual stream, updated in place
  for (int64_t i = 0; i < layers; ++i) {
    const Layer& layer = layers_[i];
    // Projection p's output y of input x, plus each row's adapter where the step has any.
    const auto adapted = [&](at::Tensor y, const at::Tensor& x, size_t p) {
      if (lora_slots.has_value() && !layer.lora.empty()) {
        const Lora& lora = layer.lora[p];
        lora_add(y, x.contiguous(), lora.a, lora.b, *lora_slots, lora.offsets, lora_rank_);
      }
      return y;
    };
    // Projection p of x: the row kernels up to its row_kernel_rows, else the integer GEMM.
    const auto project = [&](const at::Tensor& x, const std::vector<at::Tensor>& parts,
                             const std::vector<int64_t>& types,
                             const c10::optional<at::Tensor>& bias, size_t p) {
      return tokens <= layer.row_kernel_rows[p] ? quant_linear_parts(x, parts, types, bias)
                                                 : quant_gemm_parts(x, parts, types, bias);
    };
    const at::Tensor& k_cache = k_caches[i];
    const at::Tensor& v_cache = v_caches[i];
    const at::Tensor* k_scale = int8_cache ? &k_scales[i] : nullptr;
    const at::Tensor* v_scale = int8_cache ? &v_scales[i] : nullptr;
    TORCH_CHECK(packed_blocks(k_cache) && packed_blocks(v_cache) &&
                (int8_cache ? k_cache.scalar_type() == at::kChar
                            : k_cache.scalar_type() == hidden.scalar_type() ||
                                  k_cache.scalar_type() == at::kBFloat16) &&
                (!int8_cache || (packed_blocks(*k_scale) && packed_blocks(*v_scale) &&
                                 k_scale->scalar_type() == at::kFloat &&
                                 v_scale->scalar_type() == at::kFloat &&
                                 k_scale->sizes() == k_cache.sizes().slice(0, 3) &&
                                 v_scale->sizes() == v_cache.sizes().slice(0, 3))) &&
                k_cache.size(2) * k_cache.size(3) == kv_width &&
                v_cache.sizes() == k_cache.sizes());
    at::Tensor x = rms_norm(hidden, layer.input_norm, eps_, false);
    const at::Tensor qkv =
        adapted(project(x, layer.qkv, layer.qkv_types, layer.qkv_bias, 0), x, 0);
    const at::Tensor qk = rope(qkv.narrow(1, 0, qk_width).view({tokens, heads + kv_heads, dim}),
                                  cos, sin);
    const char* qk_bytes = static_cast<const char*>(qk.data_ptr());
    const char* v_bytes = static_cast<const char*>(qkv.data_ptr()) + qk_width * qkv.element_size();
    write_kv(k_cache, k_scale, qk, qk_bytes + heads * dim * qk.element_size(), qk_width, slot,
             tokens, kv_heads, dim);
    write_kv(v_cache, v_scale, qkv, v_bytes, qkv.size(1), slot, tokens, kv_heads, dim);
    const auto optional = [](const at::Tensor* t) {
      return t == nullptr ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(*t);
    };
    const at::Tensor attn = paged_decode_attention(qk.narrow(1, 0, heads), k_cache, v_cache,
                                                      block_tables, context_lens, scale_, 0,
                                                      optional(k_scale), optional(v_scale));
    const at::Tensor attn_rows = attn.view({tokens, heads * dim});
    hidden.add_(adapted(project(attn_rows, layer.o, layer.o_types, c10::nullopt, 1), attn_rows, 1));
    x = rms_norm(hidden, layer.post_norm, eps_, false);
    const at::Tensor act = silu_and_mul(adapted(
        project(x, layer.gate_up, layer.gate_up_types, c10::nullopt, 2), x, 2));
    hidden.add_(adapted(project(act, layer.down, layer.down_types, c10::nullopt, 3), act, 3));
  }
  return hidden;
}
