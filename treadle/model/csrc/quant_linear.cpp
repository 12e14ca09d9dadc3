// Linear layers over GGUF's quantized blocks as stored (Q4_0, Q4_1, Q5_0, Q8_0: 32 weights a
// block; Q4_K, Q6_K: 256 a super-block of 32-wide sub-blocks), never expanded: each activation
// row is quantized to int8 per block of 32 (llama.cpp's Q8 scheme, with the block's sums for
// the offset term) and multiplied with integer dot products (AVX2 maddubs, AVX-512 VNNI
// dpbusd where built for it; a scalar loop elsewhere). One activation block of 32 meets one
// weight block, or one K-quant sub-block, so every type shares the activation path.
//
// The 32-wide types' row kernel gives each output a vector lane: 8 weight rows' products with
// an activation block are summed in int32 and scaled as the panel GEMM (quant_gemm.cpp) scales
// them, so the row kernel and the GEMM give an output the same bits: a row's result is the same
// alone, in a verifying step of a few rows and in a large batch.
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

// lo . a_lo + hi . a_hi in 8 int32 partial sums, for 4-bit weights (unsigned bytes below 16:
// AVX2's 16-bit pair sums of the two stay below 2 x 2 x 15 x 128).
inline __m256i dot_nibbles(__m256i lo, __m256i a_lo, __m256i hi, __m256i a_hi) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, a_lo), hi, a_hi);
#else
  return _mm256_madd_epi16(
      _mm256_add_epi16(_mm256_maddubs_epi16(lo, a_lo), _mm256_maddubs_epi16(hi, a_hi)),
      _mm256_set1_epi16(1));
#endif
}

// Signed int8 weights times signed activations: maddubs wants unsigned x signed, so |w| times a
// with w's sign.
inline __m256i dot_pairs_s8_s8(__m256i w, __m256i a) {
  return dot_pairs_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}
#endif

// Each block of 32: scale amax / 127, values rounded to nearest even (as nearbyint), the
// block's exact sum in units of the scale, and the sum of its int8 values.
template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t k) {
  const int64_t nb = k / QK;
  QuantizedRows out{k, nb, std::vector<int8_t>(rows * k), std::vector<float>(rows * nb),
                    std::vector<float>(rows * nb), std::vector<int32_t>(rows * nb)};
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
      const float sum = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
      out.sum[i] = d > 0.f ? sum / d : 0.f;
      out.qsum[i] = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                                _mm256_add_epi32(q[2], q[3])));
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
      int32_t qsum = 0;
      for (int j = 0; j < QK; ++j) {
        out.q[i * QK + j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
        qsum += out.q[i * QK + j];
      }
      out.d[i] = d;
      out.sum[i] = d > 0.f ? sum / d : 0.f;
      out.qsum[i] = qsum;
#endif
    }
  });
  return out;
}

#if !defined(__AVX2__)
// Dot product of one weight row (nb blocks) with one quantized activation row: the portable
// build's loop for the 32-wide types (AVX2 builds run lane_tile below; this build has no GEMM
// to agree with).
template <int64_t QTYPE>
float row_dot(const uint8_t* w_row, const int8_t* aq, const float* ad, const float* sum_units,
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
        total += half_to_float(blk->m) * sum_units[b] * ad[b];
      } else if constexpr (QTYPE == Q5_0) {
        const auto* blk = reinterpret_cast<const BlockQ5_0*>(w_row) + b;
        qs = blk->qs;
        std::memcpy(&qh, blk->qh, sizeof(qh));
        dw = half_to_float(blk->d);
        total -= 16.f * dw * sum_units[b] * ad[b];
      } else {
        const auto* blk = reinterpret_cast<const BlockQ4_0*>(w_row) + b;
        qs = blk->qs;
        dw = half_to_float(blk->d);
        total -= 8.f * dw * sum_units[b] * ad[b];
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
// What lane_tile needs of a 32-wide block type: its block, and for the types whose weights
// are not 4-bit nibbles (block_dots reads those itself), the 32 weights as bytes (unsigned, but
// Q8_0's signed) and their dot products with 32 activations.
template <int64_t QTYPE> struct Block32;

template <> struct Block32<Q8_0> {  // w = d q
  using Block = BlockQ8_0;
  static __m256i weights(const Block& b) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
  }
  static __m256i dot(__m256i w, __m256i a) { return dot_pairs_s8_s8(w, a); }
};

template <> struct Block32<Q4_1> { using Block = BlockQ4_1; };  // w = d q + m
template <> struct Block32<Q4_0> { using Block = BlockQ4_0; };  // w = d (q - 8)

template <> struct Block32<Q5_0> {  // w = d (q - 16)
  using Block = BlockQ5_0;
  static __m256i weights(const Block& b) {
    const __m256i high = _mm256_and_si256(bytes_from_bits(b.qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(unpack_nibbles(b.qs), high);
  }
  static __m256i dot(__m256i w, __m256i a) { return dot_pairs_u8_s8(w, a); }
};

// dots[r] lane i: the int32 dot product of block b of row i with activation row r's block a[r].
template <int64_t QTYPE, int R>
inline void block_dots(const typename Block32<QTYPE>::Block* const* row, int64_t b,
                       const __m256i* a, __m256i* dots) {
  using T = Block32<QTYPE>;
  __m256i pairs[R][2];
  if constexpr (QTYPE == Q4_0 || QTYPE == Q4_1) {
    // Rows j and j + 4 share a vector, their 16 bytes of nibbles side by side: the low nibbles
    // (weights 0-15) meet activations 0-15 in both halves, the high ones 16-31. Three rounds
    // of pair sums then leave rows 0-7 in order.
    __m256i a_lo[R], a_hi[R], first[R];
    for (int r = 0; r < R; ++r) {
      a_lo[r] = _mm256_permute4x64_epi64(a[r], 0x44);
      a_hi[r] = _mm256_permute4x64_epi64(a[r], 0xEE);
    }
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(row[j + 4][b].qs),
                                              reinterpret_cast<const __m128i*>(row[j][b].qs));
      const __m256i lo = _mm256_and_si256(raw, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      for (int r = 0; r < R; ++r) {
        const __m256i sums = dot_nibbles(lo, a_lo[r], hi, a_hi[r]);
        if (j % 2 == 0) {
          first[r] = sums;
        } else {
          pairs[r][j / 2] = _mm256_hadd_epi32(first[r], sums);
        }
      }
    }
    for (int r = 0; r < R; ++r) dots[r] = _mm256_hadd_epi32(pairs[r][0], pairs[r][1]);
  } else {
    // Each row's 8 partial sums alone: pair sums of rows 0-3 and of 4-7, each 128-bit half
    // holding half of each row's sum, then the halves added across.
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 4; j += 2) {
        const __m256i w0 = T::weights(row[4 * h + j][b]);
        const __m256i w1 = T::weights(row[4 * h + j + 1][b]);
        for (int r = 0; r < R; ++r) {
          const __m256i pair = _mm256_hadd_epi32(T::dot(w0, a[r]), T::dot(w1, a[r]));
          pairs[r][h] = j == 0 ? pair : _mm256_hadd_epi32(pairs[r][h], pair);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      dots[r] = _mm256_add_epi32(_mm256_permute2x128_si256(pairs[r][0], pairs[r][1], 0x20),
                                 _mm256_permute2x128_si256(pairs[r][0], pairs[r][1], 0x31));
    }
  }
}

// out[r * ldo + i] = weight row i . activation row r0 + r for the `count` (<= 8) weight rows at
// w and R activation rows, output i in lane i. Per block, each row's 32 products are summed in
// int32 (block_dots) and the sums scaled as the panel GEMM's panel_tile scales its lanes:
// fma(dot, scale, 0), then + offset x the activations' offset sum, then x the activation scale
// into the total.
template <int64_t QTYPE, int R>
void lane_tile(const uint8_t* w, int64_t row_bytes, int count, const QuantizedRows& xq,
               int64_t r0, float* out, int64_t ldo, bool prefetch) {
  using T = Block32<QTYPE>;
  using Block = typename T::Block;
  const Block* row[8];
  alignas(32) int32_t offsets[8];
  for (int i = 0; i < 8; ++i) {  // rows past count repeat the last: read, never stored
    const int64_t at = std::min(i, count - 1) * row_bytes;
    row[i] = reinterpret_cast<const Block*>(w + at);
    offsets[i] = static_cast<int32_t>(at);
  }
  const __m256i head_offsets = _mm256_load_si256(reinterpret_cast<const __m256i*>(offsets));
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  // Prefetched 8 blocks at a time: a block is 18-34 bytes, and per block the prefetches'
  // arithmetic slowed these kernels.
  constexpr int64_t block = sizeof(Block), blocks_prefetched = 8;
  for (int64_t b = 0; b < xq.nb; ++b) {
    if (prefetch && b % blocks_prefetched == 0) {
      prefetch_rows(w, count, row_bytes, b * block, blocks_prefetched * block);
    }
    __m256i a[R];
    for (int r = 0; r < R; ++r) {
      a[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q_row(r0 + r) + b * QK));
    }
    __m256i dots[R];
    block_dots<QTYPE, R>(row, b, a, dots);
    __m256 scale, offset;
    block32_scales<QTYPE>(
        _mm256_i32gather_epi32(reinterpret_cast<const int*>(w + b * block), head_offsets, 1),
        &scale, &offset);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * xq.nb + b;
      if constexpr (QTYPE == Q8_0 && Q8_0_GEMM) {  // the GEMM's q + 128: + 128 x the int8 sum
        dots[r] = _mm256_add_epi32(dots[r], _mm256_set1_epi32(128 * xq.qsum[i]));
      }
      __m256 part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), scale, _mm256_setzero_ps());
      // Without a Q8_0 GEMM to agree with, d q as it is: the + 128 and its offset would cancel.
      if constexpr (QTYPE != Q8_0 || Q8_0_GEMM) {
        part = _mm256_fmadd_ps(offset, _mm256_set1_ps(offset_sum<QTYPE>(xq, i)), part);
      }
      acc[r] = _mm256_fmadd_ps(part, _mm256_set1_ps(xq.d[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    std::memcpy(out + r * ldo, lanes, count * sizeof(float));
  }
}

// Activation rows a tile takes: with AVX-512's 32 vector registers, 4 rows' sums stay in
// registers beside the blocks; AVX2's 16 hold 2.
#if defined(__AVX512VL__)
constexpr int ROW_TILE = 4;
#else
constexpr int ROW_TILE = 2;
#endif

// lane_tile for the R (or, past the last full tile, fewer) activation rows from r0.
template <int64_t QTYPE, int R>
void lane_tile_upto(int64_t left, const uint8_t* w, int64_t row_bytes, int count,
                    const QuantizedRows& xq, int64_t r0, float* out, int64_t ldo, bool prefetch) {
  if constexpr (R > 1) {
    if (left < R) {
      return lane_tile_upto<QTYPE, R - 1>(left, w, row_bytes, count, xq, r0, out, ldo, prefetch);
    }
  }
  lane_tile<QTYPE, R>(w, row_bytes, count, xq, r0, out, ldo, prefetch);
}

// lane_tile for `count` weight rows and activation rows [r0, r0 + rows), ROW_TILE at a time
// while the weight rows' blocks stay in L1; only the first pass prefetches.
template <int64_t QTYPE>
void lane_rows(const uint8_t* w, int64_t row_bytes, int count, const QuantizedRows& xq,
               int64_t r0, int64_t rows, float* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; r += ROW_TILE) {
    lane_tile_upto<QTYPE, ROW_TILE>(rows - r, w, row_bytes, count, xq, r0 + r, out + r * ldo,
                                    ldo, r == 0);
  }
}
#endif

// Weight rows [begin, end) of a 32-wide type against activation rows [r0, r0 + rows):
// out[r * ldo + o], run by the calling thread.
template <int64_t QTYPE>
void rows32_range(const uint8_t* w, int64_t begin, int64_t end, const QuantizedRows& xq,
                  int64_t r0, int64_t rows, float* out, int64_t ldo) {
  const int64_t row_bytes = xq.nb * block_bytes(QTYPE);
#if defined(__AVX2__)
  for (int64_t o = begin; o < end; o += 8) {
    const int count = static_cast<int>(std::min<int64_t>(8, end - o));
    lane_rows<QTYPE>(w + o * row_bytes, row_bytes, count, xq, r0, rows, out + o, ldo);
  }
#else
  for (int64_t o = begin; o < end; ++o) {
    for (int64_t r = 0; r < rows; ++r) {
      out[r * ldo + o] = row_dot<QTYPE>(w + o * row_bytes, xq.q_row(r0 + r), xq.d_row(r0 + r),
                                        xq.sum_row(r0 + r), xq.nb);
    }
  }
#endif
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
  if (blocks32) xq = quantize_rows_q8(x);
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
      if (is_k_quant(qtype)) {
        k_quant_rows(qtype, w, n, xk, rows, o, total);
      } else {
        at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
          quant_rows_range(qtype, w, begin, end, xq, xk, 0, rows, o, total);
        });
      }
    }
    column += n;
  }
  if (direct_bf16) return out;
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type());
}

}  // namespace

namespace quant {

QuantizedRows quantize_rows_q8(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1);
  return x.scalar_type() == at::kBFloat16 ? quantize_rows(x.data_ptr<at::BFloat16>(), rows, k)
                                          : quantize_rows(x.data_ptr<float>(), rows, k);
}

void quant_rows_range(int64_t qtype, const uint8_t* w, int64_t begin, int64_t end,
                      const QuantizedRows& xq, const Q8KRows& xk, int64_t r0, int64_t rows,
                      float* out, int64_t ldo) {
  switch (qtype) {
    case Q4_0: return rows32_range<Q4_0>(w, begin, end, xq, r0, rows, out, ldo);
    case Q4_1: return rows32_range<Q4_1>(w, begin, end, xq, r0, rows, out, ldo);
    case Q5_0: return rows32_range<Q5_0>(w, begin, end, xq, r0, rows, out, ldo);
    case Q8_0: return rows32_range<Q8_0>(w, begin, end, xq, r0, rows, out, ldo);
    default: k_quant_rows_range(qtype, w, begin, end, xk, r0, rows, out, ldo);
  }
}

}  // namespace quant

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

std::vector<int64_t> quant_gemm_same_bits_types() {
  std::vector<int64_t> same;  // the 32-wide types (lane_tile); the K-quants' differ in rounding
  for (int64_t qtype : panel_gemm_types()) {
    if (!is_k_quant(qtype)) same.push_back(qtype);
  }
  return same;
}

at::Tensor quant_linear(at::Tensor x, at::Tensor weight, int64_t qtype,
                           c10::optional<at::Tensor> bias) {
  return quant_linear_parts(x, {weight}, {qtype}, bias);
}
