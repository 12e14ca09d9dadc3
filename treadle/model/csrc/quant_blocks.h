// GGUF's block layouts and what the quantized-linear sources share: quant_linear.cpp (the
// 32-wide types, the entry points), quant_kblocks.cpp (the 256-wide K-quants) and
// dequantize.cpp (blocks to float weights).
#pragma once

#include "vec_math.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace quant {

constexpr int QK = 32;  // weights per block (and per activation block)
constexpr int QK_K = 256;  // weights per K-quant super-block: 8 sub-blocks of 32
// ggml's type ids, as the gguf package numbers them.
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14;

struct BlockQ4_0 { uint16_t d; uint8_t qs[QK / 2]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[QK / 2]; };
// q = low nibble | bit j of qh << 4 (weights 0-15 in the low nibbles, 16-31 in the high ones).
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[QK]; };
// Sub-block j: w = d * scale_j * q - dmin * min_j, 6-bit scales and mins packed in 12 bytes;
// 32 bytes of qs hold sub-block 2c in their low nibbles and 2c + 1 in their high ones.
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; };
// Q4_K plus a fifth bit: bit j of qh[l] is weight l of sub-block j's.
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8];
                   uint8_t qs[QK_K / 2]; };
// w = d * scales[i / 16] * (q - 32), q 6 bits: 4 from ql, 2 from qh (see q6_k_values).
struct BlockQ6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16];
                   uint16_t d; };
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 &&
              sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_K) == 144 &&
              sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "GGUF block layouts");

inline float half_to_float(uint16_t bits) {
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

#if defined(__AVX2__)
// An empty asm keeps a kernel's integer adds a chain: GCC reassociates them into a tree whose
// products, all live at once, spill a tile's registers to the stack.
inline __m256i in_order(__m256i sum) {
  asm("" : "+x"(sum));
  return sum;
}

// A 32-wide block's 16 bytes of 4-bit weights as 32 bytes in GGUF's order: the low nibbles are
// weights 0-15, the high nibbles 16-31.
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// 32 bytes, byte j 0xFF where bit j of the 4 bytes at x is set (llama.cpp's bytes_from_bits_32).
inline __m256i bytes_from_bits(const uint8_t* x) {
  uint32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                            0x0101010101010101, 0x0000000000000000);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
  const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL);  // all but bit j of byte j
  return _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1));
}

// 32 bytes of 4-bit values: the low (HIGH false) or high nibbles of `at`.
inline __m256i nibbles32(const uint8_t* at, bool high) {
  __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  if (high) bytes = _mm256_srli_epi16(bytes, 4);
  return _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
}

// 32 bytes of `bits` wide values from bit `shift` of each of the 32 bytes at `at`, moved up to
// bit `to`.
inline __m256i bit_field32(const uint8_t* at, int shift, int bits, int to) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  const __m256i field = _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(shift)),
                                         _mm256_set1_epi8(static_cast<char>((1 << bits) - 1)));
  return _mm256_sll_epi16(field, _mm_cvtsi32_si128(to));  // stays within each byte
}

// One-row steps stream the weights from memory faster with software prefetch than with the
// hardware prefetcher alone. A tile of `rows` consecutive weight rows reads [offset, offset +
// bytes) of each row this pass: this prefetches PREFETCH_AHEAD further on, a narrow tile as one
// stream, wide rows each as a stream of its own that runs on into the same row of the next tile
// (docs/decisions.md, "Prefetching wide rows").
constexpr int64_t PREFETCH_AHEAD = 4096;

// Inlined by force: an out-of-line call in a kernel's loop spilled its accumulators.
__attribute__((always_inline)) inline void prefetch_lines(const uint8_t* at, int64_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(at);
  for (uintptr_t line = begin & ~uintptr_t{63}; line < begin + bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
  }
}

__attribute__((always_inline)) inline void prefetch_rows(const uint8_t* w, int rows,
                                                        int64_t row_bytes, int64_t offset,
                                                        int64_t bytes) {
  if (row_bytes < PREFETCH_AHEAD) {
    prefetch_lines(w + PREFETCH_AHEAD + rows * offset, rows * bytes);
    return;
  }
  const int64_t ahead = offset + PREFETCH_AHEAD, tiles = ahead / row_bytes;
  const int64_t column = ahead - tiles * row_bytes;
  const int64_t in_row = std::min(bytes, row_bytes - column);  // the rest: the next tile's row
  const uint8_t* at = w + tiles * rows * row_bytes + column;
  for (int i = 0; i < rows; ++i) {
    prefetch_lines(at + i * row_bytes, in_row);
    if (in_row < bytes) prefetch_lines(at + (rows + i) * row_bytes - column, bytes - in_row);
  }
}
#endif

inline bool is_k_quant(int64_t qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K; }

inline int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return sizeof(BlockQ4_0);
    case Q4_1: return sizeof(BlockQ4_1);
    case Q5_0: return sizeof(BlockQ5_0);
    case Q8_0: return sizeof(BlockQ8_0);
    case Q4_K: return sizeof(BlockQ4_K);
    case Q5_K: return sizeof(BlockQ5_K);
    case Q6_K: return sizeof(BlockQ6_K);
  }
  TORCH_CHECK(false, "unsupported quantized type ", qtype);
}

inline int64_t block_weights(int64_t qtype) { return is_k_quant(qtype) ? QK_K : QK; }

// A quantized weight as the kernels take it: contiguous uint8 rows of k / block_weights blocks.
inline void check_weight(const at::Tensor& weight, int64_t qtype, int64_t k) {
  TORCH_CHECK(weight.dtype() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be contiguous uint8 [out_features, row_bytes]");
  const int64_t width = block_weights(qtype), row_bytes = k / width * block_bytes(qtype);
  TORCH_CHECK(k % width == 0, "in_features must be a multiple of ", width);
  TORCH_CHECK(weight.size(1) == row_bytes, "weight rows hold ", weight.size(1), " bytes, not ",
              row_bytes);
}

// Activation rows quantized per block: int8 values, each block's scale, and the two sums an
// offset term multiplies: the block's exact float sum in units of its scale (0 for a zero
// scale), and the sum of its int8 values.
struct QuantizedRows {
  int64_t k, nb;              // row length, blocks a row
  std::vector<int8_t> q;      // [rows, k]
  std::vector<float> d;       // [rows, nb]
  std::vector<float> sum;     // [rows, nb] exact sum / d
  std::vector<int32_t> qsum;  // [rows, nb]
  const int8_t* q_row(int64_t r) const { return q.data() + r * k; }
  const float* d_row(int64_t r) const { return d.data() + r * nb; }
  const float* sum_row(int64_t r) const { return sum.data() + r * nb; }
};

// Whether this build's integer GEMM serves Q8_0: VNNI's dpbusd takes its q + 128 as unsigned
// bytes, AVX2's maddubs would overflow its 16-bit pair sums on them.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool Q8_0_GEMM = true;
#else
constexpr bool Q8_0_GEMM = false;
#endif

#if defined(__AVX2__)
// The fp16 numbers in the low (HIGH false) or high 16 bits of each 32-bit lane, as floats.
inline __m256 halves(__m256i words, bool high) {
  const __m256i bits = high ? _mm256_srli_epi32(words, 16)
                            : _mm256_and_si256(words, _mm256_set1_epi32(0xFFFF));
  return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(bits),
                                          _mm256_extracti128_si256(bits, 1)));
}

// A 32-wide type's weights as w = scale q + offset, q unsigned (Q8_0's stored q + 128), for 8
// rows from the first 4 bytes of each row's block (d, and m for Q4_1). The panel GEMM and the
// row kernel scale by these same floats, in the same order, so that they agree to the bit.
template <int64_t QTYPE>
inline void block32_scales(__m256i head, __m256* scale, __m256* offset) {
  *scale = halves(head, false);
  if constexpr (QTYPE == Q4_1) {
    *offset = halves(head, true);
  } else {
    constexpr float shift = QTYPE == Q4_0 ? -8.f : QTYPE == Q5_0 ? -16.f : -128.f;
    *offset = _mm256_mul_ps(_mm256_set1_ps(shift), *scale);
  }
}

// The activation sum a 32-wide type's offset multiplies: Q8_0's only undoes its + 128 (the sum
// of the int8 values), the others' offsets are the weights' own (the exact sum).
template <int64_t QTYPE>
inline float offset_sum(const QuantizedRows& xq, int64_t i) {
  if constexpr (QTYPE == Q8_0) return static_cast<float>(xq.qsum[i]);
  return xq.sum[i];
}
#endif

// Q4_K / Q5_K: the 8 six-bit scales and 8 mins of a super-block as bytes (llama.cpp's
// unpacking of get_scale_min_k4's layout): scales in sm[0..7], mins in sm[8..15].
inline void k4_scales_mins(const uint8_t* packed, uint8_t* sm) {
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  constexpr uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
  u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
  const uint32_t mins_low = u[1] & m1;
  u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
  u[2] = mins_low;
  u[0] &= m1;
  std::memcpy(sm, u, 16);
}

// Activation rows for the K-quants, llama.cpp's Q8_K: int8 values under one scale per 256
// (amax / 127) and each 16 values' integer sum, which the weights' offsets (Q4_K/Q5_K mins,
// Q6_K's -32) multiply, so that a super-block's dot product stays in integers.
struct Q8KRows {
  int64_t k, nsb;              // row length, super-blocks a row
  std::vector<int8_t> q;       // [rows, k]
  std::vector<float> d;        // [rows, nsb]
  std::vector<int16_t> bsums;  // [rows, nsb, 16]
  const int8_t* q_row(int64_t r) const { return q.data() + r * k; }
};

Q8KRows quantize_rows_q8k(const at::Tensor& x);

// out[r * ldo + o] = weight row o . activation row r, for the n rows of `w` (a K-quant) and
// the rows of `xq`; threads split the weight rows.
void k_quant_rows(int64_t qtype, const uint8_t* w, int64_t n, const Q8KRows& xq, int64_t rows,
                  float* out, int64_t ldo);
// k_quant_rows for weight rows [begin, end) and activation rows [r0, r0 + rows) (out at row
// r0), run by the calling thread.
void k_quant_rows_range(int64_t qtype, const uint8_t* w, int64_t begin, int64_t end,
                        const Q8KRows& xq, int64_t r0, int64_t rows, float* out, int64_t ldo);

// quant_linear.cpp: rows [rows, k] (float32 or bfloat16) quantized for the 32-wide types, and
// the row kernels of any type over weight rows [begin, end) and activation rows [r0, r0 +
// rows) (xq for the 32-wide types, xk for the K-quants), run by the calling thread.
QuantizedRows quantize_rows_q8(const at::Tensor& x);
void quant_rows_range(int64_t qtype, const uint8_t* w, int64_t begin, int64_t end,
                      const QuantizedRows& xq, const Q8KRows& xk, int64_t r0, int64_t rows,
                      float* out, int64_t ldo);

// quant_gemm.cpp: the GEMM of many rows over panels of 16 (AVX2: 8) weight rows repacked per
// call, for the types this build serves that way (panel_gemm_types).
// Out: float, or at::BFloat16 (rounded as at::BFloat16 rounds).
std::vector<int64_t> panel_gemm_types();
template <typename Out>
void panel_gemm(int64_t qtype, const uint8_t* w, int64_t n, const QuantizedRows& xq,
                int64_t rows, Out* out, int64_t ldo);
template <typename Out>
void panel_gemm(int64_t qtype, const uint8_t* w, int64_t n, const Q8KRows& xq, int64_t rows,
                Out* out, int64_t ldo);

}  // namespace quant
