// Linear layers over GGUF's quantized blocks as stored (Q4_0, Q4_1, Q5_0, Q8_0: 32 weights a
// block; Q4_K, Q6_K: 256 a super-block of 32-wide sub-blocks), never expanded: each activation
// row is quantized to int8 per block of 32 (llama.cpp's Q8 scheme, with the block's exact float
// sum for the offset term) and multiplied with integer dot products (AVX2 maddubs, AVX-512 VNNI
// dpbusd where built for it; a scalar loop elsewhere). One activation block of 32 meets one
// weight block, or one K-quant sub-block, so every type shares the activation path.
//
// The 32-wide types run tiles of 4 weight rows x 2 activation rows (4 with AVX-512): each weight
// block is unpacked once for the tile's activation rows and each activation block loaded once
// for its weight rows, and a row's result does not depend on the rows beside it. Two blocks per
// 512-bit register (zmm maddubs) measured 15-40% slower than 256-bit code on a Xeon: AVX-512
// builds run the 256-bit code with more rows a tile.
#include "kernels.h"
#include "quant_blocks.h"

#include <ATen/Parallel.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace quant;

// Sum over one block of w[j] * a[j] for 32 unsigned 4-bit weights (in the GGUF nibble order:
// low nibbles are weights 0-15, high nibbles 16-31) and 32 signed int8 activations.
#if defined(__AVX2__)
inline __m256i dot_pairs_u8_s8(__m256i w, __m256i a) {  // 8 int32 partial sums
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
#endif
}

// Signed int8 weights times signed activations: maddubs wants unsigned x signed, so |w| times a
// with w's sign.
inline __m256i dot_pairs_s8_s8(__m256i w, __m256i a) {
  return dot_pairs_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}
#endif

// Each block of 32: scale amax / 127, values rounded to nearest even (as nearbyint), and the
// block's exact sum.
template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t k) {
  const int64_t nb = k / QK;
  QuantizedRows out{k, nb, std::vector<int8_t>(rows * k), std::vector<float>(rows * nb),
                    std::vector<float>(rows * nb)};
  at::parallel_for(0, rows * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* src = x + i * QK;
#if defined(__AVX2__)
      __m256 v[4];
      for (int j = 0; j < 4; ++j) v[j] = load8(src + 8 * j);
      const __m256 sign = _mm256_set1_ps(-0.f);
      const __m256 amax8 = _mm256_max_ps(
          _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
          _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      const float d = hmax(amax8) / 127.f;
      // 0 where 1 / d is not finite (an all-zero block, or values below ~1e-36)
      const __m256 id = _mm256_set1_ps(d >= FLT_MIN ? 1.f / d : 0.f);
      __m256i q[4];
      for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
      store_int8x32(out.q.data() + i * QK, q[0], q[1], q[2], q[3]);
      out.d[i] = d;
      out.sum[i] = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
#else
      float v[QK];
      float amax = 0.f, sum = 0.f;
      for (int j = 0; j < QK; ++j) {
        v[j] = static_cast<float>(src[j]);
        amax = std::max(amax, std::fabs(v[j]));
        sum += v[j];
      }
      const float d = amax / 127.f;
      const float id = d >= FLT_MIN ? 1.f / d : 0.f;
      for (int j = 0; j < QK; ++j) out.q[i * QK + j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
      out.d[i] = d;
      out.sum[i] = sum;
#endif
    }
  });
  return out;
}

#if !defined(__AVX2__)
// Dot product of one weight row (nb blocks) with one quantized activation row: the portable
// build's loop for the 32-wide types (AVX2 builds run rows_dot below).
template <int64_t QTYPE>
float row_dot(const uint8_t* w_row, const int8_t* aq, const float* ad, const float* asum,
              int64_t nb) {
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* a = aq + b * QK;
    int32_t isum = 0;
    float dw;
    if constexpr (QTYPE == Q8_0) {
      const auto* blk = reinterpret_cast<const BlockQ8_0*>(w_row) + b;
      for (int j = 0; j < QK; ++j) isum += int32_t(blk->qs[j]) * a[j];
      dw = half_to_float(blk->d);
    } else {
      const uint8_t* qs;
      uint32_t qh = 0;  // Q5_0's fifth bits
      if constexpr (QTYPE == Q4_1) {
        const auto* blk = reinterpret_cast<const BlockQ4_1*>(w_row) + b;
        qs = blk->qs;
        dw = half_to_float(blk->d);
        total += half_to_float(blk->m) * asum[b];
      } else if constexpr (QTYPE == Q5_0) {
        const auto* blk = reinterpret_cast<const BlockQ5_0*>(w_row) + b;
        qs = blk->qs;
        std::memcpy(&qh, blk->qh, sizeof(qh));
        dw = half_to_float(blk->d);
        total -= 16.f * dw * asum[b];
      } else {
        const auto* blk = reinterpret_cast<const BlockQ4_0*>(w_row) + b;
        qs = blk->qs;
        dw = half_to_float(blk->d);
        total -= 8.f * dw * asum[b];
      }
      for (int j = 0; j < QK / 2; ++j) {
        const int32_t lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        const int32_t hi = (qs[j] >> 4) | (((qh >> (j + QK / 2)) & 1) << 4);
        isum += lo * a[j] + hi * a[j + QK / 2];
      }
    }
    total += dw * ad[b] * static_cast<float>(isum);
  }
  return total;
}
#endif

#if defined(__AVX2__)
// What rows_dot needs of a 32-wide block type: its 32 weights as bytes (unsigned, but Q8_0's
// signed), their dot products with 32 activations, and the offset term: offset_factor times the
// sum over blocks of d (Q4_1: m) times the activation block's exact sum.
template <int64_t QTYPE> struct Block32;

template <> struct Block32<Q8_0> {  // w = d q
  using Block = BlockQ8_0;
  static constexpr float offset_factor = 0.f;
  static __m256i weights(const Block& b) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
  }
  static __m256i dot(__m256i w, __m256i a) { return dot_pairs_s8_s8(w, a); }
};

template <> struct Block32<Q4_1> {  // w = d q + m
  using Block = BlockQ4_1;
  static constexpr float offset_factor = 1.f;
  static uint16_t offset_half(const Block& b) { return b.m; }
  static __m256i weights(const Block& b) { return unpack_nibbles(b.qs); }
  static __m256i dot(__m256i w, __m256i a) { return dot_pairs_u8_s8(w, a); }
};

template <> struct Block32<Q4_0> {  // w = d (q - 8)
  using Block = BlockQ4_0;
  static constexpr float offset_factor = -8.f;
  static uint16_t offset_half(const Block& b) { return b.d; }
  static __m256i weights(const Block& b) { return unpack_nibbles(b.qs); }
  static __m256i dot(__m256i w, __m256i a) { return dot_pairs_u8_s8(w, a); }
};

template <> struct Block32<Q5_0> {  // w = d (q - 16)
  using Block = BlockQ5_0;
  static constexpr float offset_factor = -16.f;
  static uint16_t offset_half(const Block& b) { return b.d; }
  static __m256i weights(const Block& b) {
    const __m256i high = _mm256_and_si256(bytes_from_bits(b.qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(unpack_nibbles(b.qs), high);
  }
  static __m256i dot(__m256i w, __m256i a) { return dot_pairs_u8_s8(w, a); }
};

// Every fp16 value as a float: a block's scales read through this table need no shuffle, where
// converting them in registers took 2-3 port-5 shuffles a block (the port-bound part of the loop
// on a Skylake Xeon).
const float* half_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(1 << 16);
    for (uint32_t h = 0; h < t.size(); ++h) t[h] = half_to_float(static_cast<uint16_t>(h));
    return t;
  }();
  return table.data();
}

// out[r * ldo + i] = weight row i . activation row r0 + r for a tile of W consecutive weight
// rows and R activation rows. Each weight block is unpacked once for the R rows and each
// activation block loaded once for the W rows. Every (weight row, activation row) pair runs the
// same operations in the same order whatever W, R and the step's row count, so a row's result
// is the same bits alone as in any batch (greedy decoding and speculative verification agree).
template <int64_t QTYPE, int W, int R>
void tile_dot(const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq, int64_t r0,
              float* out, int64_t ldo, bool prefetch) {
  using T = Block32<QTYPE>;
  constexpr bool has_offset = T::offset_factor != 0.f;
  const float* half = half_table();
  __m256 acc[R][W];
  float offset[R][W];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < W; ++i) {
      acc[r][i] = _mm256_setzero_ps();
      offset[r][i] = 0.f;
    }
  }
  // Prefetched 8 blocks at a time: a block is 18-34 bytes, and per block the prefetches'
  // arithmetic slowed these kernels.
  constexpr int64_t block = sizeof(typename T::Block), blocks_prefetched = 8;
  for (int64_t b = 0; b < xq.nb; ++b) {
    if (prefetch && b % blocks_prefetched == 0) {
      prefetch_rows(w, W, row_bytes, b * block, blocks_prefetched * block);
    }
    __m256i a[R];
    __m256 da[R];
    for (int r = 0; r < R; ++r) {
      a[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q_row(r0 + r) + b * QK));
      da[r] = _mm256_broadcast_ss(xq.d_row(r0 + r) + b);
    }
    for (int i = 0; i < W; ++i) {
      const auto& blk = reinterpret_cast<const typename T::Block*>(w + i * row_bytes)[b];
      const __m256i weights = T::weights(blk);
      const __m256 dw = _mm256_broadcast_ss(half + blk.d);
      for (int r = 0; r < R; ++r) {
        if constexpr (has_offset) {
          offset[r][i] = std::fma(half[T::offset_half(blk)], xq.sum_row(r0 + r)[b],
                                  offset[r][i]);
        }
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T::dot(weights, a[r])),
                                    _mm256_mul_ps(dw, da[r]), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < W; ++i) {
      out[r * ldo + i] = std::fma(T::offset_factor, offset[r][i], hsum(acc[r][i]));
    }
  }
}

// Activation rows a tile takes: its 4 x 2 accumulators stay in AVX2's 16 registers beside the
// blocks (larger tiles spill; docs/decisions.md).
constexpr int ROW_TILE = 2;

// tile_dot for W weight rows and every activation row, ROW_TILE at a time while the W rows'
// blocks stay in L1; only the first pass prefetches.
template <int64_t QTYPE, int W>
void weight_tile_dot(const uint8_t* w, int64_t row_bytes, const QuantizedRows& xq,
                     int64_t rows, float* out, int64_t ldo) {
  for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
    const bool first = r0 == 0;
    float* o = out + r0 * ldo;
    switch (std::min<int64_t>(ROW_TILE, rows - r0)) {
      case 1: tile_dot<QTYPE, W, 1>(w, row_bytes, xq, r0, o, ldo, first); break;
      default: tile_dot<QTYPE, W, ROW_TILE>(w, row_bytes, xq, r0, o, ldo, first);
    }
  }
}
#endif

// out[r * ldo + o] for the n weight rows of a 32-wide type and every activation row.
template <int64_t QTYPE>
void gemv_rows(const uint8_t* w, int64_t n, int64_t k, const QuantizedRows& xq, int64_t rows,
               float* out, int64_t ldo) {
  const int64_t row_bytes = k / QK * block_bytes(QTYPE);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX2__)
    constexpr int W = 4;  // weight rows a tile (2 and 8 measured slower at one row on a Xeon)
    int64_t o = begin;
    for (; o + W <= end; o += W) {
      weight_tile_dot<QTYPE, W>(w + o * row_bytes, row_bytes, xq, rows, out + o, ldo);
    }
    for (; o < end; ++o) {
      weight_tile_dot<QTYPE, 1>(w + o * row_bytes, row_bytes, xq, rows, out + o, ldo);
    }
#else
    for (int64_t o = begin; o < end; ++o) {
      for (int64_t r = 0; r < rows; ++r) {
        out[r * ldo + o] = row_dot<QTYPE>(w + o * row_bytes, xq.q_row(r), xq.d_row(r),
                                          xq.sum_row(r), xq.nb);
      }
    }
#endif
  });
}

// y = x [W_0; W_1; ...]^T (+ bias) for x [rows, k] float32 or bfloat16; each W_i in GGUF
// blocks [n_i, row_bytes_i] of its own type (q/k/v or gate/up kept apart: a file may store them
// in different types, and they stay the file's bytes). Each activation row is quantized once
// for every part of its scheme. `gemm`: the panel GEMM for many rows, else the row tiles.
at::Tensor linear_parts(at::Tensor x, const std::vector<at::Tensor>& weights,
                        const std::vector<int64_t>& qtypes, c10::optional<at::Tensor> bias,
                        bool gemm) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features]");
  TORCH_CHECK(!weights.empty() && weights.size() == qtypes.size(), "one type per weight");
  x = x.contiguous();
  if (x.scalar_type() != at::kBFloat16) x = x.to(at::kFloat);
  const int64_t rows = x.size(0), k = x.size(1);
  int64_t total = 0;
  bool blocks32 = false, blocks256 = false;
  for (size_t i = 0; i < weights.size(); ++i) {
    check_weight(weights[i], qtypes[i], k);
    total += weights[i].size(0);
    (is_k_quant(qtypes[i]) ? blocks256 : blocks32) = true;
  }
  QuantizedRows xq;
  Q8KRows xk;
  if (blocks32) {
    xq = x.scalar_type() == at::kBFloat16 ? quantize_rows(x.data_ptr<at::BFloat16>(), rows, k)
                                             : quantize_rows(x.data_ptr<float>(), rows, k);
  }
  if (blocks256) xk = quantize_rows_q8k(x);
  // The GEMM writes bfloat16 outputs itself where no bias is added after it (a pass less).
  const bool direct_bf16 = gemm && !bias.has_value() && x.scalar_type() == at::kBFloat16;
  auto out = at::empty({rows, total},
                       x.options().dtype(direct_bf16 ? at::kBFloat16 : at::kFloat));
  int64_t column = 0;  // the part's first output
  for (size_t i = 0; i < weights.size(); ++i) {
    const uint8_t* w = weights[i].data_ptr<uint8_t>();
    const int64_t n = weights[i].size(0), qtype = qtypes[i];
    auto run_gemm = [&](auto* o) {
      if (is_k_quant(qtype)) return panel_gemm(qtype, w, n, xk, rows, o, total);
      panel_gemm(qtype, w, n, xq, rows, o, total);
    };
    if (direct_bf16) {
      run_gemm(out.data_ptr<at::BFloat16>() + column);
    } else if (gemm) {
      run_gemm(out.data_ptr<float>() + column);
    } else {
      float* o = out.data_ptr<float>() + column;
      switch (qtype) {
        case Q4_0: gemv_rows<Q4_0>(w, n, k, xq, rows, o, total); break;
        case Q4_1: gemv_rows<Q4_1>(w, n, k, xq, rows, o, total); break;
        case Q5_0: gemv_rows<Q5_0>(w, n, k, xq, rows, o, total); break;
        case Q8_0: gemv_rows<Q8_0>(w, n, k, xq, rows, o, total); break;
        default: k_quant_rows(qtype, w, n, xk, rows, o, total);
      }
    }
    column += n;
  }
  if (direct_bf16) return out;
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type());
}

}  // namespace

at::Tensor quant_linear_parts(at::Tensor x, const std::vector<at::Tensor>& weights,
                                 const std::vector<int64_t>& qtypes,
                                 c10::optional<at::Tensor> bias) {
  return linear_parts(x, weights, qtypes, bias, false);
}

at::Tensor quant_gemm_parts(at::Tensor x, const std::vector<at::Tensor>& weights,
                               const std::vector<int64_t>& qtypes,
                               c10::optional<at::Tensor> bias) {
  return linear_parts(x, weights, qtypes, bias, true);
}

std::vector<int64_t> quant_gemm_types() { return panel_gemm_types(); }

at::Tensor quant_linear(at::Tensor x, at::Tensor weight, int64_t qtype,
                           c10::optional<at::Tensor> bias) {
  return quant_linear_parts(x, {weight}, {qtype}, bias);
}
